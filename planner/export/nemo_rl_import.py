"""Import a NeMo-RL 0.7 GRPO launch: a recipe YAML (its ``defaults:`` chain resolved next to
it), or a run script / overrides file calling ``examples/run_grpo.py --config RECIPE key=value``
("N" = NVIDIA-NeMo/RL tag v0.7.0). A recipe the launch names but that is not at hand (a path
inside a NeMo-RL checkout) is read as NeMo-RL's own base recipe, whose values are
``BASE_DEFAULTS`` (N examples/configs/grpo_math_1B.yaml, grpo_math_1B_megatron.yaml), and a
note says so."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from planner.export.importing import (
    ImportContext,
    LaunchLayout,
    build_plan,
    launch_cluster,
    parse_bool,
    parse_float,
    parse_int,
    read_launch_as,
    resolve_model,
    response_lengths,
)
from planner.export.launch import Launch
from profiles.datafile import SpecError, read_mapping
from simulator.plan import Plan, RolePlan
from simulator.specs.cluster import ClusterSpec
from simulator.specs.job import RULE, JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.workload import Workload

BASE_DEFAULTS: dict[str, Any] = {
    # N examples/configs/grpo_math_1B.yaml (resolved), the keys read here.
    "cluster.gpus_per_node": 1, "cluster.num_nodes": 1,
    "policy.model_name": "Qwen/Qwen2.5-1.5B",
    "grpo.num_prompts_per_step": 32, "grpo.num_generations_per_prompt": 16,
    "policy.train_global_batch_size": 512, "policy.train_micro_batch_size": 4,
    "policy.logprob_batch_size": "${policy.train_micro_batch_size}",
    "policy.max_total_sequence_length": 512,
    "data.max_input_seq_length": "${policy.max_total_sequence_length}",
    "policy.generation.max_new_tokens": "${policy.max_total_sequence_length}",
    "policy.dtensor_cfg.enabled": True, "policy.dtensor_cfg.tensor_parallel_size": 1,
    "policy.dtensor_cfg.context_parallel_size": 1,
    "policy.dtensor_cfg.activation_checkpointing": False, "policy.dtensor_cfg.cpu_offload": False,
    "policy.megatron_cfg.enabled": False,
    "policy.megatron_cfg.tensor_model_parallel_size": 1,
    "policy.megatron_cfg.pipeline_model_parallel_size": 1,
    "policy.megatron_cfg.context_parallel_size": 1,
    "policy.megatron_cfg.expert_model_parallel_size": 1,
    "policy.megatron_cfg.expert_tensor_parallel_size": 1,
    "policy.megatron_cfg.sequence_parallel": False,
    "policy.megatron_cfg.activation_checkpointing": False,
    "policy.megatron_cfg.recompute_granularity": "full",
    "policy.megatron_cfg.optimizer.use_distributed_optimizer": True,
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce": True,
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather": True,
    "policy.sequence_packing.enabled": True, "policy.dynamic_batching.enabled": False,
    "policy.generation.backend": "vllm",
    "policy.generation.vllm_cfg.tensor_parallel_size": 1,
    "policy.generation.vllm_cfg.pipeline_parallel_size": 1,
    "policy.generation.vllm_cfg.expert_parallel_size": 1,
    "policy.generation.vllm_cfg.gpu_memory_utilization": 0.6,
    "policy.generation.vllm_cfg.enforce_eager": False,
    "policy.generation.colocated.enabled": True,
    "grpo.async_grpo.enabled": False, "grpo.async_grpo.max_trajectory_age_steps": 1,
    "grpo.async_grpo.in_flight_weight_updates": False,
    "loss_fn.reference_policy_kl_penalty": 0.01, "loss_fn.use_kl_in_reward": False,
    "data.default.env_name": "math",
}
"""NeMo-RL 0.7.0's base GRPO recipe, flattened (the Megatron base differs in
``policy.megatron_cfg.enabled`` / ``policy.dtensor_cfg.enabled``)."""

_REFERENCE = re.compile(r"\$\{([\w.]+)\}")


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> {"a.b.c": value}."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def load_recipe(path: Path, notes: list[str], chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe's flattened values over its ``defaults:`` chain (paths relative to the file
    holding them, N nemo_rl/utils/config.py:47-93); a recipe not at hand is NeMo-RL's base."""
    if not path.is_file():
        notes.append(f"{path} is not here: read as NeMo-RL 0.7.0's base GRPO recipe")
        base = dict(BASE_DEFAULTS)
        if "megatron" in path.name:
            base.update({"policy.megatron_cfg.enabled": True,
                         "policy.dtensor_cfg.enabled": False})
        return base
    if str(path) in chain:
        raise SpecError(f"recipes name each other as defaults: {' -> '.join(chain)}",
                        source=str(path), key="defaults")
    data = read_mapping(path)
    parents = data.pop("defaults", None)
    out: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else (parents or []):
        out.update(load_recipe((path.parent / str(parent)).resolve(), notes,
                               (*chain, str(path))))
    out.update(flatten(data))
    return out


def recipe_values(launch: Launch, notes: list[str]) -> dict[str, Any]:
    """The launch's values: a recipe YAML itself, or ``--config RECIPE`` with the overrides
    after it."""
    source = Path(launch.source)
    if not launch.module and source.suffix in (".yaml", ".yml"):
        return load_recipe(source, notes)
    words = list(launch.arguments)
    recipe = "examples/configs/grpo_math_1B.yaml"
    overrides: dict[str, Any] = {}
    while words:
        word = words.pop(0)
        if word == "--config" and words:
            recipe = words.pop(0)
        elif word.startswith("--config="):
            recipe = word.split("=", 1)[1]
        elif "=" in word and not word.startswith("-"):
            key, _, value = word.partition("=")
            overrides[key.lstrip("+~")] = yaml.safe_load(value) if value else None
    values = load_recipe((source.parent / recipe).resolve(), notes)
    values.update(overrides)
    return values


def resolved(values: dict[str, Any], key: str, depth: int = 0) -> Any:
    """``values[key]`` with its ``${other.key}`` references and ``${mul:a,b}`` resolved."""
    value = values.get(key, BASE_DEFAULTS.get(key))
    if not isinstance(value, str) or "${" not in value or depth > 8:
        return value
    product = re.fullmatch(r"\$\{mul:\s*(.+?)\s*,\s*(.+?)\s*\}", value)
    if product:
        factors = [resolved({**values, "_": f}, "_", depth + 1) for f in product.groups()]
        return parse_float(factors[0], key) * parse_float(factors[1], key)
    whole = _REFERENCE.fullmatch(value)
    if whole:
        return resolved(values, whole.group(1), depth + 1)
    return _REFERENCE.sub(lambda m: str(resolved(values, m.group(1), depth + 1)), value)


def import_nemo_rl(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    """The job and plan a NeMo-RL launch runs."""
    return read_launch_as(launch, context, _import)


def _import(launch: Launch, context: ImportContext) -> tuple[JobSpec, Plan]:
    values = recipe_values(launch, context.notes)

    def get(key: str) -> Any:
        return resolved(values, key)

    megatron = _refuse_what_is_not_priced(get)
    kl = _kl(get)
    actor_model = resolve_model("actor", str(get("policy.model_name")), "policy.model_name",
                                context)
    models: dict[str, Any] = {"actor": actor_model, "reward": RULE}
    if kl != "none":
        models["ref"] = actor_model
    gpus = _gpus(get, context)
    workload = _workload(get, context)
    mode, staleness, partial = _mode(get, colocated=gpus.colocated)
    job = JobSpec(
        name=(context.job.name if context.job else "") or "imported-nemo-rl",
        algorithm="grpo", models=models, cluster=gpus.cluster, workload=workload,
        framework=context.job.framework if context.job else "nemo-rl", kl=kl,  # type: ignore[arg-type]
        mode=mode, max_staleness=staleness if mode == "async" else None,  # type: ignore[arg-type]
        partial_rollout=partial,
        reward_function=context.job.reward_function if context.job else None)
    plans = {"actor": _policy(get, job, gpus.trainer, megatron, trained=True)}
    if kl != "none":
        plans["ref"] = _policy(get, job, gpus.trainer, megatron, trained=False)
    plans["actor"] = replace(plans["actor"], generation=_generation(get, job))
    layout = LaunchLayout(sets=[(tuple(r for r in ("actor", "ref") if r in plans),
                                 gpus.trainer)], roles=plans, mode=mode,
                          max_staleness=staleness, partial_rollout=partial,
                          rollout_gpus=gpus.rollout)
    plan = build_plan(job, layout)
    plan.validate(job)
    return job, plan


Getter = Callable[[str], Any]
"""A recipe value by its dotted key, references resolved (``resolved``)."""


def _refuse_what_is_not_priced(get: Getter) -> bool:
    """Refuse a recipe whose environment, rollout or policy settings the simulator does not
    price; whether the policy trains under Megatron (else DTensor)."""
    if get("data.default.env_name") not in (None, "math", "math_default"):
        raise SpecError(f"{get('data.default.env_name')}: only rule environments (math) are "
                        "read; a reward model environment is not", key="data.default.env_name")
    if str(get("policy.generation.backend")) != "vllm":
        raise SpecError("only the vLLM rollout is priced", key="policy.generation.backend")
    if parse_bool(get("policy.dynamic_batching.enabled"), "policy.dynamic_batching.enabled"):
        raise SpecError("dynamic batching is not priced for NeMo-RL (sequence packing is)",
                        key="policy.dynamic_batching.enabled")
    megatron = parse_bool(get("policy.megatron_cfg.enabled"), "policy.megatron_cfg.enabled")
    cfg = "policy.megatron_cfg" if megatron else "policy.dtensor_cfg"
    if not megatron and parse_int(get(f"{cfg}.context_parallel_size"),
                                  f"{cfg}.context_parallel_size") > 1:
        raise SpecError("context parallelism of the DTensor policy is not priced (Megatron's "
                        "is: policy.megatron_cfg.context_parallel_size)",
                        key=f"{cfg}.context_parallel_size")
    if not megatron and parse_bool(get(f"{cfg}.cpu_offload"), f"{cfg}.cpu_offload"):
        raise SpecError("host offload of the DTensor policy is not priced",
                        key=f"{cfg}.cpu_offload")
    return megatron


def _kl(get: Getter) -> str:
    """Where the KL term enters: nowhere (penalty 0), the reward or the loss."""
    penalty = parse_float(get("loss_fn.reference_policy_kl_penalty"),
                          "loss_fn.reference_policy_kl_penalty")
    if penalty == 0:
        return "none"
    return "reward" if parse_bool(get("loss_fn.use_kl_in_reward"), "loss_fn.use_kl_in_reward") \
        else "loss"


@dataclass(frozen=True, slots=True)
class _Gpus:
    """The launch's cluster and how its GPUs divide."""

    cluster: ClusterSpec
    trainer: int
    """GPUs that train (every GPU not generating on a set of its own)."""
    rollout: int
    """GPUs of the generation set of its own (0: generation colocated with training)."""
    colocated: bool


def _gpus(get: Getter, context: ImportContext) -> _Gpus:
    gpn = parse_int(get("cluster.gpus_per_node"), "cluster.gpus_per_node")
    nodes = parse_int(get("cluster.num_nodes"), "cluster.num_nodes")
    colocated = parse_bool(get("policy.generation.colocated.enabled"),
                           "policy.generation.colocated.enabled")
    rollout_gpus = 0
    if not colocated:
        res = "policy.generation.colocated.resources"
        gen_nodes = parse_int(get(f"{res}.num_nodes") or 1, f"{res}.num_nodes")
        gen_gpn = parse_int(get(f"{res}.gpus_per_node") or gpn, f"{res}.gpus_per_node")
        rollout_gpus = gen_gpn if nodes == 1 else gen_nodes * gpn
    cluster = launch_cluster(gpn * nodes, gpn, context, key="cluster.num_nodes")
    return _Gpus(cluster=cluster, trainer=gpn * nodes - rollout_gpus, rollout=rollout_gpus,
                 colocated=colocated)


def _workload(get: Getter, context: ImportContext) -> Workload:
    """Lengths and batches of the recipe (the prompt length from ``--job`` where the recipe's
    prompt and response maxima overrun its total sequence length)."""
    total_tokens = parse_int(get("policy.max_total_sequence_length"),
                             "policy.max_total_sequence_length")
    new_tokens = parse_int(get("policy.generation.max_new_tokens"),
                           "policy.generation.max_new_tokens")
    prompt = parse_int(get("data.max_input_seq_length"), "data.max_input_seq_length")
    if prompt + new_tokens > total_tokens:
        if context.job is None:
            raise SpecError(f"prompts of up to {prompt} and responses of up to {new_tokens} "
                            f"tokens share {total_tokens}: give --job with the prompt length "
                            "(or set data.max_input_seq_length and policy.generation."
                            "max_new_tokens to add up)", key="data.max_input_seq_length")
        prompt = context.job.workload.prompt_length
        new_tokens = min(new_tokens, total_tokens - prompt)
    prompts = parse_int(get("grpo.num_prompts_per_step"), "grpo.num_prompts_per_step")
    samples = parse_int(get("grpo.num_generations_per_prompt"),
                        "grpo.num_generations_per_prompt")
    global_batch = parse_int(get("policy.train_global_batch_size"),
                             "policy.train_global_batch_size")
    if (prompts * samples) % global_batch:
        raise SpecError(f"{prompts * samples} samples do not split into global batches of "
                        f"{global_batch}", key="policy.train_global_batch_size")
    workload = Workload(
        prompts_per_iteration=prompts, samples_per_prompt=samples, prompt_length=prompt,
        response_length=response_lengths(new_tokens, context), ppo_epochs=1,
        mini_batches_per_epoch=prompts * samples // global_batch,
        infer_micro_batch_size=parse_int(get("policy.logprob_batch_size"),
                                         "policy.logprob_batch_size"))
    if context.job is not None:
        workload = replace(workload, dtype=context.job.workload.dtype,
                           rule_reward_seconds_per_sample=context.job.workload
                           .rule_reward_seconds_per_sample,
                           controller_seconds_per_sample=context.job.workload
                           .controller_seconds_per_sample)
    return workload


def _mode(get: Getter, *, colocated: bool) -> tuple[str, int, bool]:
    """(mode, staleness, partial rollout) of the recipe's GRPO: synchronous and colocated,
    or async GRPO on generation GPUs of its own."""
    is_async = parse_bool(get("grpo.async_grpo.enabled"), "grpo.async_grpo.enabled")
    if is_async and colocated:
        raise SpecError("async GRPO needs generation on GPUs of its own (NeMo-RL asserts it)",
                        key="policy.generation.colocated.enabled")
    if not is_async and not colocated:
        raise SpecError("synchronous GRPO on generation GPUs of its own is not priced (the "
                        "rollout set is for async GRPO)", key="policy.generation.colocated.enabled")
    staleness = parse_int(get("grpo.async_grpo.max_trajectory_age_steps"),
                          "grpo.async_grpo.max_trajectory_age_steps") if is_async else 0
    partial = is_async and parse_bool(get("grpo.async_grpo.in_flight_weight_updates"),
                                      "grpo.async_grpo.in_flight_weight_updates")
    mode = "sync" if not is_async else (
        "one_step_off" if staleness == 1 and not partial else "async")
    return mode, staleness, partial


def _generation(get: Getter, job: JobSpec) -> GenerationConfig:
    """The vLLM rollout's layout (max_num_seqs: the framework's default)."""
    seqs, _ = job.rollout_defaults()
    vllm = "policy.generation.vllm_cfg"
    return GenerationConfig(
        tp=parse_int(get(f"{vllm}.tensor_parallel_size"), f"{vllm}.tensor_parallel_size"),
        pp=parse_int(get(f"{vllm}.pipeline_parallel_size"), f"{vllm}.pipeline_parallel_size"),
        ep=parse_int(get(f"{vllm}.expert_parallel_size"), f"{vllm}.expert_parallel_size"),
        max_num_seqs=seqs, memory_utilization=parse_float(
            get(f"{vllm}.gpu_memory_utilization"), f"{vllm}.gpu_memory_utilization"))


def _policy(get: Getter, job: JobSpec, gpus: int, megatron: bool, *, trained: bool) -> RolePlan:
    """The policy's layout (the reference runs in it, NeMo-RL swapping its weights in)."""
    role = "actor" if trained else "ref"
    grad, param = job.overlap_for(role)
    mbs = parse_int(get("policy.train_micro_batch_size"), "policy.train_micro_batch_size") \
        if trained else job.workload.infer_micro_batch_size
    if not megatron:
        cfg = "policy.dtensor_cfg"
        tp = parse_int(get(f"{cfg}.tensor_parallel_size"), f"{cfg}.tensor_parallel_size")
        checkpointing = parse_bool(get(f"{cfg}.activation_checkpointing"),
                                   f"{cfg}.activation_checkpointing")
        dp = gpus // tp
        par = ParallelConfig(tp=tp, pp=1, dp=dp, sharding="fsdp" if dp > 1 else "none",
                             recompute=("full" if checkpointing else "none") if trained
                             else "none", sequence_parallel=False, micro_batch_size=mbs,
                             overlap_grad_reduce=grad, overlap_param_gather=param)
        return RolePlan(parallel=par, training_backend="torch")
    cfg = "policy.megatron_cfg"
    tp = parse_int(get(f"{cfg}.tensor_model_parallel_size"), f"{cfg}.tensor_model_parallel_size")
    pp = parse_int(get(f"{cfg}.pipeline_model_parallel_size"),
                   f"{cfg}.pipeline_model_parallel_size")
    if gpus % (tp * pp):
        raise SpecError(f"tp x pp = {tp * pp} does not divide the {gpus} training GPUs",
                        key=f"{cfg}.tensor_model_parallel_size")
    dp = gpus // (tp * pp)
    cp = parse_int(get(f"{cfg}.context_parallel_size"), f"{cfg}.context_parallel_size")
    if cp < 1 or dp % cp:
        raise SpecError(f"{cp}: context-parallel ranks are data-parallel ranks; it must divide "
                        f"the {dp} data-parallel ranks", key=f"{cfg}.context_parallel_size")
    checkpointing = parse_bool(get(f"{cfg}.activation_checkpointing"),
                               f"{cfg}.activation_checkpointing")
    granularity = str(get(f"{cfg}.recompute_granularity"))
    ddp = f"{cfg}.distributed_data_parallel_config"
    distributed = parse_bool(get(f"{cfg}.optimizer.use_distributed_optimizer"),
                             f"{cfg}.optimizer.use_distributed_optimizer")
    par = ParallelConfig(
        tp=tp, pp=pp, dp=dp, sharding="optimizer" if trained and dp > 1 and distributed
        else "none",
        recompute=(granularity if checkpointing else "none") if trained  # type: ignore[arg-type]
        else "none",
        sequence_parallel=parse_bool(get(f"{cfg}.sequence_parallel"),
                                     f"{cfg}.sequence_parallel") and tp > 1,
        micro_batch_size=mbs,
        overlap_grad_reduce=parse_bool(get(f"{ddp}.overlap_grad_reduce"),
                                       f"{ddp}.overlap_grad_reduce"),
        overlap_param_gather=parse_bool(get(f"{ddp}.overlap_param_gather"),
                                        f"{ddp}.overlap_param_gather"),
        ep=parse_int(get(f"{cfg}.expert_model_parallel_size"), f"{cfg}.expert_model_parallel_size"),
        etp=parse_int(get(f"{cfg}.expert_tensor_parallel_size"),
                      f"{cfg}.expert_tensor_parallel_size"), cp=cp)
    return RolePlan(parallel=par, training_backend="megatron")
