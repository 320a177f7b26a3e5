"""Import an OpenRLHF launch (the arguments of ``openrlhf.cli.train_ppo_ray``, from a file of
them or a run script) as a job and a plan, read against OpenRLHF 0.11.2's argument defaults
("O" = openrlhf/cli/train_ppo_ray.py of pip openrlhf==0.11.2).

OpenRLHF spells flags both ``--group.name`` and, before 0.10, ``--name`` (``LEGACY``); both
are read. A setting the planner does not price is refused in one line naming it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.export.importing import (
    ImportContext,
    LaunchLayout,
    build_plan,
    clean,
    launch_cluster,
    parse_float,
    parse_int,
    read_launch_as,
    resolve_model,
    response_lengths,
)
from planner.export.launch import Launch
from planner.export.openrlhf import ESTIMATOR, PAIRS
from profiles.datafile import SpecError
from simulator.costs.context_parallel import KV_HEADS_PER_GATHER
from simulator.plan import Plan, RolePlan, torch_family_backend
from simulator.specs.job import RULE, JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.workload import Workload

DEFAULTS: dict[str, Any] = {
    # O cli/train_ppo_ray.py add_argument defaults
    "actor.num_nodes": 1, "actor.num_gpus_per_node": 8,
    "critic.num_nodes": 1, "critic.num_gpus_per_node": 8,
    "ref.num_nodes": 1, "ref.num_gpus_per_node": 8,
    "reward.num_nodes": 1, "reward.num_gpus_per_node": 8,
    "ds.zero_stage": 2, "ds.tensor_parallel_size": 1,
    "vllm.tensor_parallel_size": 1, "vllm.gpu_memory_utilization": 0.95,
    "rollout.batch_size": 1024, "rollout.n_samples_per_prompt": 1,
    "train.batch_size": 128, "train.max_epochs": 1, "train.micro_batch_size": 1,
    "rollout.micro_batch_size": 1, "data.max_len": 2048,
    "algo.kl.init_coef": 0.01, "train.async_queue_size": 1,
    "algo.advantage.estimator": "gae", "train.max_tokens_per_gpu": 16192,
    "ds.ring_attn_size": 1, "ds.ring_attn_head_stride": 1,
}

LEGACY = {
    "colocate_all_models": "train.colocate_all", "colocate_actor_ref": "train.colocate_actor_ref",
    "colocate_critic_reward": "train.colocate_critic_reward",
    "zero_stage": "ds.zero_stage", "vllm_num_engines": "vllm.num_engines",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "pretrain": "actor.model_name_or_path", "reward_pretrain": "reward.model_name_or_path",
    "critic_pretrain": "critic.model_name_or_path", "remote_rm_url": "reward.remote_url",
    "rollout_batch_size": "rollout.batch_size", "n_samples_per_prompt":
    "rollout.n_samples_per_prompt", "train_batch_size": "train.batch_size",
    "micro_train_batch_size": "train.micro_batch_size",
    "micro_rollout_batch_size": "rollout.micro_batch_size", "max_epochs": "train.max_epochs",
    "prompt_max_len": "data.prompt_max_len", "generate_max_len": "rollout.max_new_tokens",
    "advantage_estimator": "algo.advantage.estimator", "init_kl_coef": "algo.kl.init_coef",
    "use_kl_loss": "algo.kl.use_loss", "gradient_checkpointing":
    "actor.gradient_checkpointing_enable", "packing_samples": "ds.packing_samples",
    "enforce_eager": "vllm.enforce_eager", "adam_offload": "ds.adam_offload",
    "ref_reward_offload": "ref.offload", "async_train": "train.async_enable",
    "actor_num_nodes": "actor.num_nodes", "actor_num_gpus_per_node": "actor.num_gpus_per_node",
    "critic_num_nodes": "critic.num_nodes",
    "critic_num_gpus_per_node": "critic.num_gpus_per_node",
    "ref_num_nodes": "ref.num_nodes", "ref_num_gpus_per_node": "ref.num_gpus_per_node",
    "reward_num_nodes": "reward.num_nodes",
    "reward_num_gpus_per_node": "reward.num_gpus_per_node",
}
"""Flags of OpenRLHF before 0.10 -> their 0.11 names."""

UNPRICED = {
    "ds.adam_offload": "optimizer offload to host is not priced yet",
    "ref.offload": "a reference model kept in host memory is not priced yet",
    "reward.offload": "a reward model kept in host memory is not priced yet",
    "vllm.enforce_eager": "an eager vLLM engine is not what the openrlhf profile prices",
    "ds.load_in_4bit": "4-bit weights are not priced",
}
"""Flags that change the priced work in ways the planner does not model."""


def openrlhf_values(launch: Launch) -> dict[str, str | bool]:
    """'--key=value' / '--key value' / '--flag' -> {key: value or True}, old names renamed."""
    values: dict[str, str | bool] = {}
    words = list(launch.arguments)
    while words:
        word = words.pop(0)
        if not word.startswith("--"):
            continue
        key, sep, value = word[2:].partition("=")
        key = LEGACY.get(key, key)
        if sep:
            values[key] = clean(value)
        elif words and not words[0].startswith("--"):
            values[key] = clean(words.pop(0))
        else:
            values[key] = True
    return values


class Settings:
    def __init__(self, values: dict[str, str | bool]):
        self.values = values

    def flag(self, key: str) -> bool:
        value = self.values.get(key, False)
        return value is True or str(value).lower() == "true"

    def int(self, key: str) -> int:
        if key not in self.values and key not in DEFAULTS:
            raise SpecError("needed (no OpenRLHF default)", key=f"--{key}")
        return parse_int(self.values.get(key, DEFAULTS.get(key)), f"--{key}")

    def float(self, key: str) -> float:
        return parse_float(self.values.get(key, DEFAULTS.get(key)), f"--{key}")

    def text(self, key: str) -> str | None:
        value = self.values.get(key, DEFAULTS.get(key))
        return None if value is None or value is True else str(value)


def import_openrlhf(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    """The job and plan an OpenRLHF launch runs."""
    return read_launch_as(launch, context, _import)


def _import(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    s = Settings(openrlhf_values(launch))
    for key, why in UNPRICED.items():
        if s.flag(key):
            raise SpecError(why, key=f"--{key}")
    if s.int("ds.ring_attn_head_stride") != KV_HEADS_PER_GATHER:
        raise SpecError(f"ring attention is priced at {KV_HEADS_PER_GATHER} KV head per "
                        "all-gather (OpenRLHF's default)", key="--ds.ring_attn_head_stride")
    # --train.dynamic_batch_enable and --ds.ring_attn_size turn packing on themselves
    # (O cli/train_ppo_ray.py:686-694).
    if not s.flag("ds.packing_samples") and not s.flag("train.dynamic_batch_enable") \
            and s.int("ds.ring_attn_size") == 1:
        raise SpecError("padded micro-batches are not priced (the price counts real tokens); "
                        "add --ds.packing_samples", key="--ds.packing_samples")
    estimator = s.text("algo.advantage.estimator") or "gae"
    algorithm = next((a for a, e in ESTIMATOR.items() if e == estimator), None)
    if algorithm is None:
        raise SpecError(f"{estimator}: the planner has dataflows for gae (PPO) and group_norm "
                        "(GRPO)", key="--algo.advantage.estimator")
    kl = "loss" if s.flag("algo.kl.use_loss") else (
        "none" if s.float("algo.kl.init_coef") == 0 else "reward")
    rule = "reward.remote_url" in s.values
    roles = ["actor"] + (["critic"] if algorithm == "ppo" else []) + \
        (["ref"] if kl != "none" else []) + ([] if rule else ["reward"])
    models: dict[str, Any] = {"actor": resolve_model(
        "actor", s.text("actor.model_name_or_path"), "--actor.model_name_or_path", context)}
    if "critic" in roles:
        critic = s.text("critic.model_name_or_path") or s.text("reward.model_name_or_path")
        models["critic"] = resolve_model("critic", critic, "--critic.model_name_or_path",
                                         context)
    if "ref" in roles:
        models["ref"] = models["actor"]
    models["reward"] = RULE if rule else resolve_model(
        "reward", s.text("reward.model_name_or_path"), "--reward.model_name_or_path", context)
    is_async = s.flag("train.async_enable")
    gpus = {r: s.int(f"{r}.num_nodes") * s.int(f"{r}.num_gpus_per_node") for r in roles}
    groups = _groups(s, roles)
    gen_tp = s.int("vllm.tensor_parallel_size")
    engines = s.int("vllm.num_engines") if "vllm.num_engines" in s.values else None
    rollout_gpus = (engines or 0) * gen_tp if is_async else 0
    if is_async and not rollout_gpus:
        raise SpecError("asynchronous training needs vLLM engines of their own",
                        key="--vllm.num_engines")
    gpn = s.int("actor.num_gpus_per_node")
    total = sum(gpus[g[0]] for g in groups) + rollout_gpus
    cluster = launch_cluster(total, gpn, context, key="--actor.num_nodes")
    prompts = s.int("rollout.batch_size")
    samples = s.int("rollout.n_samples_per_prompt")
    per_step = s.int("train.batch_size")
    if (prompts * samples) % per_step:
        raise SpecError(f"{prompts * samples} sequences do not split into mini-batches of "
                        f"{per_step}", key="--train.batch_size")
    max_len = s.int("data.max_len")
    new_tokens = s.int("rollout.max_new_tokens") if "rollout.max_new_tokens" in s.values \
        else None
    if new_tokens is None:
        raise SpecError("needed: the longest response (OpenRLHF derives it per prompt "
                        "otherwise)", key="--rollout.max_new_tokens")
    workload = Workload(
        prompts_per_iteration=prompts, samples_per_prompt=samples,
        generated_prompts_per_iteration=_generated(s, prompts, context),
        prompt_length=max_len - new_tokens,
        response_length=response_lengths(new_tokens, context),
        ppo_epochs=s.int("train.max_epochs"),
        mini_batches_per_epoch=prompts * samples // per_step,
        infer_micro_batch_size=s.int("rollout.micro_batch_size"))
    if context.job is not None:
        workload = replace(workload, dtype=context.job.workload.dtype,
                           rule_reward_seconds_per_sample=context.job.workload
                           .rule_reward_seconds_per_sample,
                           controller_seconds_per_sample=context.job.workload
                           .controller_seconds_per_sample)
    staleness = s.int("train.async_queue_size") if is_async else 0
    partial = is_async and s.flag("train.partial_rollout_enable")
    mode = "sync" if not is_async else (
        "one_step_off" if staleness == 1 and not partial else "async")
    job = JobSpec(
        name=(context.job.name if context.job else "") or "imported-openrlhf",
        algorithm=algorithm, models=models, cluster=cluster, workload=workload,
        framework=context.job.framework if context.job else "openrlhf", kl=kl,  # type: ignore[arg-type]
        mode=mode, max_staleness=staleness if mode == "async" else None,  # type: ignore[arg-type]
        partial_rollout=partial,
        reward_function=context.job.reward_function if context.job else None)
    plan = build_plan(job, _layout(s, job, groups, gpus, gen_tp, rollout_gpus, mode,
                                   staleness, partial))
    plan.validate(job)
    return job, plan


def _groups(s: Settings, roles: list[str]) -> list[tuple[str, ...]]:
    if s.flag("train.colocate_all"):
        return [tuple(roles)]
    groups: list[tuple[str, ...]] = []
    placed: set[str] = set()
    for pair, flag in PAIRS.items():
        if s.flag(flag[2:]) and pair <= set(roles):
            groups.append(tuple(r for r in roles if r in pair))
            placed |= pair
    groups += [(r,) for r in roles if r not in placed]
    return sorted(groups, key=lambda g: roles.index(g[0]))


def _generated(s: Settings, prompts: int, context: ImportContext) -> int | None:
    if not s.flag("algo.dynamic_filtering_enable"):
        return None
    if context.job is not None and context.job.workload.generated_prompts_per_iteration:
        return context.job.workload.generated_prompts_per_iteration
    context.notes.append("--algo.dynamic_filtering_enable: priced as if every generated group "
                         "is kept (give --job with workload.generated_prompts_per_iteration)")
    return None


def _token_budgets(s: Settings) -> tuple[int, int]:
    """(training, experience) token budgets per GPU under --train.dynamic_batch_enable (the
    experience's defaults to the training's, O cli/train_ppo_ray.py:691-697); (0, 0)
    without it."""
    if not s.flag("train.dynamic_batch_enable"):
        return 0, 0
    train = s.int("train.max_tokens_per_gpu")
    forward = s.int("rollout.max_tokens_per_gpu") if "rollout.max_tokens_per_gpu" in s.values \
        else train
    for key, value in (("train.max_tokens_per_gpu", train),
                       ("rollout.max_tokens_per_gpu", forward)):
        if value < 1:
            raise SpecError(f"{value}: a token budget is a positive number of tokens",
                            key=f"--{key}")
    return train, forward


def _layout(s: Settings, job: JobSpec, groups: list[tuple[str, ...]], gpus: dict[str, int],
            gen_tp: int, rollout_gpus: int, mode: str, staleness: int,
            partial: bool) -> LaunchLayout:
    stage = s.int("ds.zero_stage")
    tp = s.int("ds.tensor_parallel_size")
    cp = s.int("ds.ring_attn_size")
    recompute = "full" if s.flag("actor.gradient_checkpointing_enable") else "none"
    train_tokens, forward_tokens = _token_budgets(s)
    trained_sharding = {0: "none", 1: "optimizer", 2: "optimizer", 3: "fsdp"}.get(stage)
    if trained_sharding is None:
        raise SpecError(f"{stage}: ZeRO stages are 0-3", key="--ds.zero_stage")
    plans: dict[str, RolePlan] = {}
    for role in job.gpu_roles:
        world = gpus[role]
        dp = world // tp
        if cp < 1 or dp % cp:
            raise SpecError(f"{cp}: ring attention groups split the {dp} GPUs / tp of "
                            f"{role}; it must divide them", key="--ds.ring_attn_size")
        trained = role in job.dataflow.trained_roles
        sharding = (trained_sharding if dp > 1 else "none") if trained else (
            "fsdp" if stage == 3 and dp > 1 else "none")
        grad, param = job.overlap_for(role)
        if trained and sharding != "fsdp":
            grad = s.flag("ds.overlap_comm")
        par = ParallelConfig(tp=tp, pp=1, dp=dp, sharding=sharding,  # type: ignore[arg-type]
                             recompute=recompute if trained else "none",  # type: ignore[arg-type]
                             sequence_parallel=False,
                             micro_batch_size=s.int("train.micro_batch_size") if trained
                             else job.workload.infer_micro_batch_size,
                             overlap_grad_reduce=grad, overlap_param_gather=param,
                             micro_batch_tokens=train_tokens if trained else 0,
                             infer_micro_batch_tokens=forward_tokens, cp=cp)
        plans[role] = RolePlan(parallel=par, training_backend=torch_family_backend(par))
    seqs, _ = job.rollout_defaults()
    plans["actor"] = replace(plans["actor"], generation=GenerationConfig(
        tp=gen_tp, pp=1, max_num_seqs=seqs,
        memory_utilization=s.float("vllm.gpu_memory_utilization")))
    return LaunchLayout(sets=[(g, gpus[g[0]]) for g in groups], roles=plans, mode=mode,
                        max_staleness=staleness, partial_rollout=partial,
                        rollout_gpus=rollout_gpus)
