"""Import a verl launch (Hydra overrides, or a run script calling one of its trainers) as a
job and a plan, read against verl 0.9.1's defaults (``VERL_DEFAULTS``, from its config tree:
"C" = verl/trainer/config/ of pip verl==0.9.1).

Every setting that changes the work the planner prices is read; one the planner does not
price is refused in one line naming the key (``UNPRICED``); settings that change nothing it
prices (learning rates, loggers, data files) are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from planner.export.importing import (
    ImportContext,
    LaunchLayout,
    build_plan,
    clean,
    launch_cluster,
    parse_bool,
    parse_float,
    parse_int,
    read_launch_as,
    resolve_model,
    response_lengths,
)
from planner.export.launch import Launch
from planner.export.verl import CONFIG, ENTRY, ESTIMATOR
from profiles.datafile import SpecError
from profiles.framework import load_framework
from simulator.plan import Plan, RolePlan
from simulator.specs.job import RULE, JobSpec
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.workload import Workload

VERL_DEFAULTS: dict[str, Any] = {
    # C _generated_ppo_trainer.yaml / _generated_ppo_megatron_trainer.yaml
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "critic.ppo_max_token_len_per_gpu": 32768,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "critic.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": -1,
    "actor_rollout_ref.ref.fsdp_config.fsdp_size": -1,
    "critic.fsdp.fsdp_size": -1,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": 1,
    "actor_rollout_ref.rollout.expert_parallel_size": 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.free_cache_engine": True,
    "reward.reward_model.rollout.tensor_model_parallel_size": 2,
    "reward.reward_model.rollout.pipeline_model_parallel_size": 1,
    "megatron.tensor_model_parallel_size": 1,
    "megatron.context_parallel_size": 1,
    "megatron.pipeline_model_parallel_size": 1,
    "megatron.virtual_pipeline_model_parallel_size": None,
    "megatron.expert_model_parallel_size": 1,
    "megatron.expert_tensor_parallel_size": None,
    "megatron.use_distributed_optimizer": True,
    "megatron.sequence_parallel": True,
    "megatron.override_transformer_config.recompute_granularity": None,
}
"""verl 0.9.1's defaults of the settings read (``megatron.*``: each role's Megatron engine,
C engine/megatron.yaml; the reference takes the actor's unless it sets its own)."""

LEGACY = {
    # verl <= 0.6 spelled the reward model's settings at the top level.
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "custom_reward_function.path": "reward.custom_reward_function.path",
    "custom_reward_function.name": "reward.custom_reward_function.name",
}
"""Older spellings read as verl 0.9's."""


def _true(value: Any) -> bool:
    return str(value).lower() in ("true", "1")


def _above_one(value: Any) -> bool:
    return str(value) not in ("1", "None", "null", "none", "")


UNPRICED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("actor_rollout_ref.model.lora_rank", _above_one, "LoRA training is not priced"),
    ("actor_rollout_ref.model.use_remove_padding", lambda v: not _true(v),
     "padded micro-batches are not priced (the price counts real tokens)"),
    ("actor_rollout_ref.rollout.enforce_eager", _true,
     "an eager vLLM engine is not what the verl profile prices (CUDA graphs)"),
    ("actor_rollout_ref.rollout.multi_turn.enable", _true, "multi-turn tool rollouts are not "
     "priced"),
    ("actor_rollout_ref.rollout.name", lambda v: clean(str(v)) not in ("vllm", "sglang"),
     "the vllm and sglang rollout engines are priced; set actor_rollout_ref.rollout.name to "
     "one of them"),
)
"""Settings that change the priced work in ways the planner does not model: (key, whether the
value is one of them, why)."""


def verl_values(launch: Launch) -> tuple[str, str, dict[str, str]]:
    """(mode, engine, key -> value) of a verl launch: the entry module gives the mode, the
    config name (or actor strategy) the engine."""
    mode = next((m for m, module in ENTRY.items() if module == launch.module), None)
    if mode is None:
        # A file of overrides alone: the asynchronous trainers' own keys tell the mode.
        keys = {w.split("=", 1)[0].lstrip("+~") for w in launch.arguments}
        mode = "async" if any(k.startswith("async_training.") for k in keys) else \
            "one_step_off" if "rollout.nnodes" in keys else "sync"
    config = ""
    values: dict[str, str] = {}
    words = list(launch.arguments)
    while words:
        word = words.pop(0)
        if word in ("--config-name", "--config-path", "--config-dir"):
            value = words.pop(0) if words else ""
            if word == "--config-name":
                config = value
            continue
        if word.startswith("--config-name="):
            config = word.split("=", 1)[1]
            continue
        if word.startswith("-"):
            continue
        key, sep, value = word.partition("=")
        if not sep:
            continue
        key = LEGACY.get(key.lstrip("+~"), key.lstrip("+~"))
        values[key] = clean(value)
    config = clean(config)
    strategy = values.get("actor_rollout_ref.actor.strategy", "")
    engine = "megatron" if "megatron" in config or strategy == "megatron" else "fsdp"
    if config and config not in {name for (m, _), name in CONFIG.items() if m == mode} \
            and not config.startswith("ppo_"):
        raise SpecError(f"config {config!r} is not one of verl's trainer configs",
                        key="--config-name", source=launch.source)
    return mode, engine, values


class VerlSettings:
    """A launch's values over verl's defaults."""

    def __init__(self, values: dict[str, str], engine: str, source: str):
        self.values = values
        self.engine = engine
        self.source = source

    def raw(self, key: str) -> Any:
        if key in self.values:
            return self.values[key]
        if key.startswith(("actor_rollout_ref.ref.megatron.", "critic.megatron.")):
            leaf = key.split(".megatron.", 1)[1]
            if key.startswith("actor_rollout_ref.ref.") and \
                    f"actor_rollout_ref.actor.megatron.{leaf}" in self.values:
                return self.values[f"actor_rollout_ref.actor.megatron.{leaf}"]
            return VERL_DEFAULTS.get(f"megatron.{leaf}")
        if key.startswith("actor_rollout_ref.actor.megatron."):
            return VERL_DEFAULTS.get(f"megatron.{key.split('.megatron.', 1)[1]}")
        return VERL_DEFAULTS.get(key)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.raw(key)
        if value is None or str(value) in ("null", "None"):
            if default is None:
                raise SpecError("needed (no verl default)", key=key)
            return default
        return parse_int(value, key)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.raw(key)
        return default if value is None else parse_bool(value, key)

    def float(self, key: str) -> float:
        return parse_float(self.raw(key), key)

    def text(self, key: str) -> str | None:
        value = self.raw(key)
        return None if value is None else clean(str(value))


def check_priced(settings: VerlSettings) -> None:
    """Refuse, naming the key, a setting that changes the work in a way not priced."""
    for key, unpriced, why in UNPRICED:
        if key in settings.values and unpriced(settings.values[key]):
            raise SpecError(f"{settings.values[key]}: {why}", key=key)


def import_verl(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    """The job and plan a verl launch runs."""
    return read_launch_as(launch, context, _import)


def _import(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    mode, engine, values = verl_values(launch)
    s = VerlSettings(values, engine, launch.source)
    check_priced(s)
    framework = context.job.framework if context.job else "verl"
    recompute = load_framework(framework).passes.old_log_prob_in(mode)
    # The fully-async trainer takes the rollout's log-probs whatever bypass_mode says.
    if mode != "async" and s.bool("algorithm.rollout_correction.bypass_mode") == recompute:
        priced = "the actor recomputing the old log-probs" if recompute else \
            "the rollout's log-probs"
        raise SpecError(f"{str(recompute).lower()}: the {framework} profile prices {priced} "
                        f"in {mode} mode", key="algorithm.rollout_correction.bypass_mode")
    estimator = s.text("algorithm.adv_estimator") or "gae"
    algorithm = next((a for a, e in ESTIMATOR.items() if e == estimator), None)
    if algorithm is None:
        raise SpecError(f"{estimator}: the planner has dataflows for gae (PPO), grpo and "
                        "remax", key="algorithm.adv_estimator")
    kl = _kl(s)
    reward_model = s.bool("reward.reward_model.enable")
    gpn = s.int("trainer.n_gpus_per_node")
    trainer_gpus = s.int("trainer.nnodes") * gpn
    own_reward = reward_model and s.bool("reward.reward_model.enable_resource_pool")
    reward_gpus = s.int("reward.reward_model.nnodes", 0) * s.int(
        "reward.reward_model.n_gpus_per_node", gpn) if own_reward else 0
    rollout_gpus = s.int("rollout.nnodes", 0) * s.int("rollout.n_gpus_per_node", gpn) \
        if mode != "sync" else 0
    roles = ["actor"] + (["critic"] if algorithm == "ppo" else []) + \
        (["ref"] if kl != "none" else [])
    models: dict[str, ModelSpec | str] = {
        "actor": resolve_model("actor", s.text("actor_rollout_ref.model.path"),
                               "actor_rollout_ref.model.path", context)}
    if "critic" in roles:
        models["critic"] = resolve_model("critic", s.text("critic.model.path"),
                                         "critic.model.path", context)
    if "ref" in roles:
        models["ref"] = models["actor"]
    models["reward"] = resolve_model(
        "reward", s.text("reward.reward_model.model_path"),
        "reward.reward_model.model_path", context) if reward_model else RULE
    cluster = launch_cluster(trainer_gpus + reward_gpus + rollout_gpus, gpn, context,
                             key="trainer.nnodes")
    prompts = s.int("data.train_batch_size")
    mini = s.int("actor_rollout_ref.actor.ppo_mini_batch_size")
    if mode == "async" and prompts <= 0:
        # The fully-async trainer streams: a parameter version is trigger_parameter_sync_step
        # local updates of require_batches mini-batches each (one iteration here).
        prompts = mini * s.int("async_training.require_batches", 1) * s.int(
            "async_training.trigger_parameter_sync_step", 1)
    if prompts % mini:
        raise SpecError(f"{prompts} prompts do not split into mini-batches of {mini}",
                        key="actor_rollout_ref.actor.ppo_mini_batch_size")
    generated = None
    if s.bool("algorithm.filter_groups.enable"):
        generated = _generated_prompts(prompts, context)
    infer_mbs = s.int("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                      s.int("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 8))
    workload = Workload(
        prompts_per_iteration=prompts, generated_prompts_per_iteration=generated,
        prompt_length=s.int("data.max_prompt_length"),
        response_length=response_lengths(s.int("data.max_response_length"), context),
        samples_per_prompt=s.int("actor_rollout_ref.rollout.n"),
        ppo_epochs=s.int("actor_rollout_ref.actor.ppo_epochs"),
        mini_batches_per_epoch=prompts // mini,
        infer_micro_batch_size=infer_mbs)
    if context.job is not None:
        workload = replace(workload, dtype=context.job.workload.dtype,
                           controller_seconds_per_sample=context.job.workload
                           .controller_seconds_per_sample,
                           rule_reward_seconds_per_sample=context.job.workload
                           .rule_reward_seconds_per_sample)
    staleness = {"sync": 0, "one_step_off": 1}.get(mode)
    if staleness is None:
        # verl's bound: the rollouter runs at most (1 + staleness_threshold) versions' samples
        # ahead; a fraction of a version is staleness 1 (whole versions behind).
        threshold = s.raw("async_training.staleness_threshold")
        staleness = 1 + int(parse_float(threshold, "async_training.staleness_threshold")) \
            if threshold is not None else 1
    job = JobSpec(
        name=(context.job.name if context.job else "") or "imported-verl",
        algorithm=algorithm, models=models, cluster=cluster, workload=workload,
        framework=framework, kl=kl,
        mode=mode, max_staleness=staleness if mode == "async" else None,  # type: ignore[arg-type]
        partial_rollout=mode == "async" and s.bool("async_training.partial_rollout"),
        reward_function=context.job.reward_function if context.job else None,
        rollout_engine=None if _engine(s) == "vllm" else _engine(s))
    layout = _layout(s, job, roles, trainer_gpus, reward_gpus, rollout_gpus, mode, staleness)
    plan = build_plan(job, layout)
    plan.validate(job)
    return job, plan


def _kl(s: VerlSettings) -> str:
    loss = s.bool("actor_rollout_ref.actor.use_kl_loss")
    reward = s.bool("algorithm.use_kl_in_reward")
    if loss:
        return "loss"
    return "reward" if reward else "none"


def _generated_prompts(prompts: int, context: ImportContext) -> int:
    job = context.job
    if job is not None and job.workload.generated_prompts_per_iteration:
        return job.workload.generated_prompts_per_iteration
    context.notes.append("algorithm.filter_groups.enable=true: priced as if every generated "
                         "group is kept (give --job with workload.generated_prompts_per_"
                         "iteration, the prompts generated per step on average)")
    return prompts


def _micro_batch(s: VerlSettings, prefix: str) -> int:
    value = s.raw(f"{prefix}.ppo_micro_batch_size_per_gpu")
    if value is None or str(value) in ("null", "None"):
        raise SpecError("needed: the sequences per GPU of a training micro-batch",
                        key=f"{prefix}.ppo_micro_batch_size_per_gpu")
    return parse_int(value, f"{prefix}.ppo_micro_batch_size_per_gpu")


def _layout(s: VerlSettings, job: JobSpec, roles: list[str], trainer_gpus: int,
            reward_gpus: int, rollout_gpus: int, mode: str, staleness: int) -> LaunchLayout:
    trainer = tuple(r for r in ("actor", "critic", "ref") if r in roles)
    if "reward" in job.gpu_roles and not reward_gpus:
        trainer = (*trainer, "reward")
    sets = [(trainer, trainer_gpus)]
    if reward_gpus:
        sets.append((("reward",), reward_gpus))
    plans: dict[str, RolePlan] = {}
    plans["actor"] = _trained("actor", s, trainer_gpus, "actor_rollout_ref.actor",
                              "actor_rollout_ref.model", job)
    gen_gpus = rollout_gpus or trainer_gpus
    plans["actor"] = replace(plans["actor"], generation=_generation(
        s, gen_gpus, colocated=not rollout_gpus, pipelines=job.rollout.pipeline_parallel))
    if "critic" in roles:
        plans["critic"] = _trained("critic", s, trainer_gpus, "critic", "critic.model", job)
    if "ref" in roles:
        plans["ref"] = _frozen(s, trainer_gpus, job)
    if "reward" in job.gpu_roles:
        tp = s.int("reward.reward_model.rollout.tensor_model_parallel_size")
        pp = s.int("reward.reward_model.rollout.pipeline_model_parallel_size")
        gpus = reward_gpus or trainer_gpus
        grad, param = job.overlap_for("reward")
        plans["reward"] = RolePlan(parallel=ParallelConfig(
            tp=tp, pp=pp, dp=max(1, gpus // (tp * pp)), sharding="none", recompute="none",
            sequence_parallel=False, micro_batch_size=job.workload.infer_micro_batch_size,
            overlap_grad_reduce=grad, overlap_param_gather=param),
            training_backend="torch")
    return LaunchLayout(sets=sets, roles=plans, mode=mode,
                        max_staleness=staleness, partial_rollout=job.partial_rollout,
                        rollout_gpus=rollout_gpus)


def _budgets(s: VerlSettings, role: str, job: JobSpec) -> tuple[int, int]:
    """(training, forward) token budgets of ``role`` (0: micro-batches by sequence count), as
    verl 0.9.1 defaults them: the reference's and the rollout's log-prob settings follow the
    actor's, the critic's forward budget its training one."""
    actor = "actor_rollout_ref.actor"
    dynamic = s.bool(f"{actor}.use_dynamic_bsz")
    budget = s.int(f"{actor}.ppo_max_token_len_per_gpu")
    if role == "actor":
        keys = (f"{actor}.use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz")
        train = budget if dynamic else 0
        forward_on = s.bool(keys[1], dynamic)
        forward = s.int("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", budget)
    elif role == "ref":
        keys = ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz",) * 2
        forward_on = s.bool(keys[0], dynamic)
        train, forward = 0, s.int("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                                  budget)
        return 0, forward if forward_on else 0
    else:
        keys = ("critic.use_dynamic_bsz",) * 2
        on = s.bool(keys[0], dynamic)
        critic_budget = s.int("critic.ppo_max_token_len_per_gpu")
        train = critic_budget if on else 0
        forward_on = on
        forward = s.int("critic.forward_max_token_len_per_gpu", critic_budget)
    if bool(train) != forward_on:
        raise SpecError("token budgets on for the training passes but not the log-prob ones "
                        "(or the other way) are not priced: set both the same", key=keys[1])
    longest = job.workload.max_sequence_tokens
    for value in (train, forward if forward_on else 0):
        if value and value < longest:
            raise SpecError(f"{value} tokens: verl needs a budget of at least the longest "
                            f"sequence ({longest})", key=keys[0])
    return train, forward if forward_on else 0


def _trained(role: str, s: VerlSettings, gpus: int, prefix: str, model_prefix: str,
             job: JobSpec) -> RolePlan:
    tokens, forward_tokens = _budgets(s, role, job)
    mbs = 1 if tokens else _micro_batch(s, prefix)
    grad, param = job.overlap_for(role)
    if s.engine == "fsdp":
        fsdp_key = f"{prefix}.fsdp_config" if role == "actor" else f"{prefix}.fsdp"
        sharding, group = _fsdp_sharding(s, f"{fsdp_key}.fsdp_size", gpus)
        recompute = "full" if s.bool(f"{model_prefix}.enable_gradient_checkpointing") \
            else "none"
        par = ParallelConfig(tp=1, pp=1, dp=gpus, sharding=sharding,  # type: ignore[arg-type]
                             recompute=recompute,  # type: ignore[arg-type]
                             sequence_parallel=False, micro_batch_size=mbs,
                             overlap_grad_reduce=grad, overlap_param_gather=param,
                             offload_params=s.bool(f"{fsdp_key}.param_offload"),
                             offload_optimizer=s.bool(f"{fsdp_key}.optimizer_offload"),
                             micro_batch_tokens=tokens, infer_micro_batch_tokens=forward_tokens,
                             ulysses=s.int(f"{prefix}.ulysses_sequence_parallel_size", 1),
                             fsdp_size=group)
        return RolePlan(parallel=par, training_backend="torch")
    par = _megatron(s, f"{prefix}.megatron", gpus, trained=True, mbs=mbs,
                    overlap=(grad, param))
    return RolePlan(parallel=replace(par, micro_batch_tokens=tokens,
                                     infer_micro_batch_tokens=forward_tokens),
                    training_backend="megatron")


def _fsdp_sharding(s: VerlSettings, key: str, gpus: int) -> tuple[str, int]:
    """(sharding, FSDP group size; 0 = every GPU) of an fsdp_size: verl shards over every GPU
    for -1 or at least the world, keeps whole replicas for 1, and otherwise builds a
    (world / fsdp_size, fsdp_size) hybrid-sharding mesh (verl/workers/engine/fsdp/utils.py
    create_device_mesh)."""
    size = s.int(key)
    if size == 1 or gpus == 1:
        return "none", 0
    if size == -1 or size >= gpus:
        return "fsdp", 0
    if size < 1 or gpus % size:
        raise SpecError(f"{size}: an FSDP group size must divide the {gpus} GPUs (hybrid "
                        "sharding in whole groups), or be -1 (every GPU) or 1 (whole replicas)",
                        key=key)
    return "fsdp", size


def _megatron(s: VerlSettings, prefix: str, gpus: int, *, trained: bool, mbs: int,
              overlap: tuple[bool, bool]) -> ParallelConfig:
    tp = s.int(f"{prefix}.tensor_model_parallel_size")
    pp = s.int(f"{prefix}.pipeline_model_parallel_size")
    vpp = s.int(f"{prefix}.virtual_pipeline_model_parallel_size", 1)
    ep = s.int(f"{prefix}.expert_model_parallel_size")
    cp = s.int(f"{prefix}.context_parallel_size", 1)
    etp = s.int(f"{prefix}.expert_tensor_parallel_size", 1 if ep > 1 else tp)
    if gpus % (tp * pp * cp):
        raise SpecError(f"tp x pp x cp = {tp * pp * cp} does not divide the {gpus} GPUs",
                        key=f"{prefix}.tensor_model_parallel_size")
    dp = gpus // (tp * pp)
    sharding = "optimizer" if trained and dp > 1 and s.bool(
        f"{prefix}.use_distributed_optimizer") else "none"
    granularity = s.text(f"{prefix}.override_transformer_config.recompute_granularity")
    recompute = {"selective": "selective", "full": "full"}.get(granularity or "", "none")
    grad = s.bool(f"{prefix}.override_ddp_config.overlap_grad_reduce", overlap[0])
    gather = s.bool(f"{prefix}.override_ddp_config.overlap_param_gather", overlap[1])
    return ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp,
                          sharding=sharding,  # type: ignore[arg-type]
                          recompute=recompute if trained else "none",  # type: ignore[arg-type]
                          sequence_parallel=s.bool(f"{prefix}.sequence_parallel") and tp > 1,
                          micro_batch_size=mbs, overlap_grad_reduce=grad,
                          overlap_param_gather=gather, ep=ep, etp=etp if ep > 1 else 1,
                          offload_params=s.bool(f"{prefix}.param_offload"),
                          offload_optimizer=trained and s.bool(f"{prefix}.optimizer_offload"))


def _frozen(s: VerlSettings, gpus: int, job: JobSpec) -> RolePlan:
    mbs = s.int("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                job.workload.infer_micro_batch_size)
    grad, param = job.overlap_for("ref")
    _, forward_tokens = _budgets(s, "ref", job)
    if s.engine == "fsdp":
        sharding, group = _fsdp_sharding(s, "actor_rollout_ref.ref.fsdp_config.fsdp_size", gpus)
        par = ParallelConfig(tp=1, pp=1, dp=gpus, sharding=sharding,  # type: ignore[arg-type]
                             fsdp_size=group,
                             recompute="none", sequence_parallel=False, micro_batch_size=mbs,
                             overlap_grad_reduce=grad, overlap_param_gather=param,
                             offload_params=s.bool("actor_rollout_ref.ref.fsdp_config."
                                                   "param_offload"),
                             infer_micro_batch_tokens=forward_tokens,
                             ulysses=s.int("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
                                           s.int("actor_rollout_ref.actor."
                                                 "ulysses_sequence_parallel_size", 1)))
        return RolePlan(parallel=par, training_backend="torch")
    par = _megatron(s, "actor_rollout_ref.ref.megatron", gpus, trained=False, mbs=mbs,
                    overlap=(grad, param))
    return RolePlan(parallel=replace(par, infer_micro_batch_tokens=forward_tokens),
                    training_backend="megatron")


def _engine(s: VerlSettings) -> str:
    """The rollout engine (``actor_rollout_ref.rollout.name``; vllm when the launch says
    none)."""
    return s.text("actor_rollout_ref.rollout.name") or "vllm"


def _generation(s: VerlSettings, gpus: int, *, colocated: bool,
                pipelines: bool = True) -> GenerationConfig:
    """The rollout engine's layout and settings; a colocated engine also says whether it frees
    its KV cache between generations (free_cache_engine; an engine on GPUs of its own never
    sleeps in the price). An engine verl starts with no pipeline size (``pipelines`` False:
    SGLang) runs pp 1 whatever pipeline_model_parallel_size says."""
    prefix = "actor_rollout_ref.rollout"
    return GenerationConfig(tp=s.int(f"{prefix}.tensor_model_parallel_size"),
                            pp=s.int(f"{prefix}.pipeline_model_parallel_size")
                            if pipelines else 1,
                            ep=s.int(f"{prefix}.expert_parallel_size"),
                            max_num_seqs=s.int(f"{prefix}.max_num_seqs"),
                            memory_utilization=s.float(f"{prefix}.gpu_memory_utilization"),
                            free_cache=s.bool(f"{prefix}.free_cache_engine")
                            if colocated else None)
