"""Export a plan to NeMo-RL 0.7.0 (Hydra-style overrides of a GRPO recipe for
``examples/run_grpo.py``), and the recipe defaults an import reads them against.

NeMo-RL 0.7.0 ("N" = NVIDIA-NeMo/RL tag v0.7.0, commit 81aa43dd) launches GRPO as
``uv run examples/run_grpo.py --config examples/configs/grpo_math_1B.yaml key=value ...``
(the Megatron base is ``grpo_math_1B_megatron.yaml``); overrides of keys the base has are plain
``key=value`` (N nemo_rl/utils/config.py:168-188), and the recipe's ``${...}`` references are
resolved after them (N examples/run_grpo.py:74-82). What the format expresses (and what the
nemo-rl profile's ``space:`` lets the search try): GRPO; the policy on DTensor (FSDP2 with
tensor parallelism) or Megatron (tp, pp with first/last stage sizes, ep, etp, sequence
parallelism, the distributed optimizer); the reference model a host copy inside the policy
(its own layout is the policy's); vLLM on the policy's GPUs, or, for async GRPO, on GPUs of its
own (``policy.generation.colocated.resources``). NeMo-RL itself needs Python 3.13 and Ray to
check a config, so the tests hold exports to the arithmetic it asserts at start-up
(``nemo_rl_checks``: N algorithms/grpo.py:605-665, models/policy/lm_policy.py:178-212,
distributed/batched_data_dict.py:395-399, generation/vllm/vllm_generation.py:110-134).
"""

from __future__ import annotations

from planner.export.common import (
    Translation,
    notes_comment,
    read_argument_lines,
    set_key,
    translation_for,
)
from planner.export.verl import model_path
from profiles.datafile import SpecError
from simulator.plan import Plan
from simulator.specs.job import RULE, JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig, outer_stage_layers

NEMO_RL_VERSION = "0.7.0"
OVERRIDES_FILE = "nemo_rl_overrides.txt"
SCRIPT_FILE = "run_nemo_rl.sh"
BASE_CONFIG = {"dtensor": "examples/configs/grpo_math_1B.yaml",
               "megatron": "examples/configs/grpo_math_1B_megatron.yaml"}
"""The recipe the overrides apply to, per policy engine (paths inside a NeMo-RL checkout)."""
KL_PENALTY = 0.01
"""NeMo-RL's default reference_policy_kl_penalty (N examples/configs/grpo_math_1B.yaml:55-87):
what a plan with a KL term keeps (0 drops the reference model and its pass, N
algorithms/grpo.py:840-851)."""


def nemo_rl_overrides(plan: Plan, job: JobSpec, translation: Translation | None = None
                      ) -> tuple[str, list[str]]:
    """(base recipe, overrides) for ``plan``; SpecError if NeMo-RL 0.7 cannot express it."""
    translation = translation or translation_for(job, "nemo-rl")
    if job.algorithm != "grpo":
        raise SpecError(f"NeMo-RL 0.7 has no {job.algorithm} trainer here (GRPO only)",
                        key="algorithm")
    if job.models.get("reward") != RULE:
        raise SpecError("NeMo-RL's reward model environment is not exported: give models.reward: "
                        "rule (NeMo-RL's math environment)", key="job.models.reward")
    _check_placement(plan, job)
    actor = plan.roles["actor"]
    par = actor.parallel
    gen = actor.generation
    assert gen is not None
    work = job.workload
    if work.ppo_epochs != 1:
        raise SpecError(f"NeMo-RL trains one pass over a step's samples; the job has "
                        f"{work.ppo_epochs} epochs", key="job.workload.ppo_epochs")
    engine = "megatron" if actor.training_backend == "megatron" or par.pp > 1 \
        or par.sharding == "optimizer" else "dtensor"
    gpn = _gpus_per_node(plan, job)
    nodes, per_node = _cluster_shape(plan, gpn)
    sequences = work.sequences_per_iteration
    out = [
        f"cluster.num_nodes={nodes}", f"cluster.gpus_per_node={per_node}",
        f"policy.model_name={model_path(job, 'actor')}",
        f"grpo.num_prompts_per_step={work.prompts_per_iteration}",
        f"grpo.num_generations_per_prompt={work.samples_per_prompt}",
        f"policy.train_global_batch_size={sequences // work.mini_batches_per_epoch}",
        f"policy.train_micro_batch_size={par.micro_batch_size}",
        f"policy.logprob_batch_size={work.infer_micro_batch_size}",
        f"policy.max_total_sequence_length={work.max_sequence_tokens}",
        f"data.max_input_seq_length={work.prompt_length}",
        f"policy.generation.max_new_tokens={work.response_length.max_tokens}",
        # Priced with sequence packing (the nemo-rl profile's sequence_packing), not dynamic
        # batches.
        f"policy.sequence_packing.enabled={_bool(job.framework_profile.training.sequence_packing)}",
        "policy.dynamic_batching.enabled=false",
        f"loss_fn.reference_policy_kl_penalty={0 if job.kl_term == 'none' else KL_PENALTY}",
        f"loss_fn.use_kl_in_reward={_bool(job.kl_term == 'reward')}",
    ]
    out += _policy(par, job, engine, translation)
    out += _generation(plan, job, gen, translation)
    return BASE_CONFIG[engine], out


def _gpus_per_node(plan: Plan, job: JobSpec) -> int:
    """The node size of the node group the plan runs on (NeMo-RL's cluster.gpus_per_node is
    one number: every set and the rollout share one node group)."""
    groups = {s.node_group for s in plan.located_sets()}
    if len(groups) > 1:
        raise SpecError("NeMo-RL sizes its cluster in nodes of one kind (cluster.gpus_per_node); "
                        "the plan uses several node groups", key="sets")
    return job.cluster.pool_of(groups.pop()).group.gpus_per_node


def _cluster_shape(plan: Plan, gpus_per_node: int) -> tuple[int, int]:
    """(cluster.num_nodes, cluster.gpus_per_node): NeMo-RL trains on every GPU of the cluster
    that generation does not take (N algorithms/grpo.py:605-665), so the cluster written is
    the plan's sets and nothing more: parts of one node, or whole nodes."""
    trainer = plan.set_of("actor").gpus
    rollout = plan.rollout.gpus if plan.rollout is not None else 0
    if trainer + rollout <= gpus_per_node:
        return 1, trainer + rollout
    if trainer % gpus_per_node or rollout % gpus_per_node:
        raise SpecError(f"NeMo-RL splits a multi-node cluster into whole training and "
                        f"generation nodes; the plan trains on {trainer} and generates on "
                        f"{rollout} GPUs", key="rollout.gpus")
    return (trainer + rollout) // gpus_per_node, gpus_per_node


def _check_placement(plan: Plan, job: JobSpec) -> None:
    if len(plan.sets) > 1:
        raise SpecError("NeMo-RL runs the policy and its reference copy on one set of GPUs "
                        f"(generation too, or on GPUs of its own); this plan has "
                        f"{len(plan.sets)} sets", key=set_key(plan, plan.sets[1].roles))
    if any(s.node_group for s in plan.located_sets()):
        raise SpecError("NeMo-RL sizes the cluster in nodes of one shape; the plan uses "
                        "several node groups", key="sets")


def _policy(par: ParallelConfig, job: JobSpec, engine: str,
            translation: Translation) -> list[str]:
    recompute = par.recompute
    if par.fsdp_size:
        translation.differ("NeMo-RL's DTensor policy shards over every data-parallel rank (no "
                           f"hybrid sharding); the plan has FSDP groups of {par.fsdp_size}",
                           key="roles.actor.parallel.fsdp_size", fix="drop fsdp_size",
                           written="FSDP over every rank")
    if engine == "dtensor":
        if par.cp > 1:
            translation.differ("NeMo-RL's DTensor policy is priced without context "
                               f"parallelism; the plan has cp={par.cp} (Megatron's ring)",
                               key="roles.actor.parallel.cp", fix="set cp: 1, or train with "
                               "Megatron (sharding: optimizer)", written="cp 1")
        if recompute == "selective":
            translation.differ("NeMo-RL's DTensor policy checkpoints every layer or none",
                               key="roles.actor.parallel.recompute",
                               fix="set recompute: full or none", written="full")
            recompute = "full"
        return ["policy.dtensor_cfg.enabled=true", "policy.megatron_cfg.enabled=false",
                f"policy.dtensor_cfg.tensor_parallel_size={par.tp}",
                "policy.dtensor_cfg.context_parallel_size=1",
                "policy.dtensor_cfg.sequence_parallel=false",
                f"policy.dtensor_cfg.activation_checkpointing={_bool(recompute != 'none')}",
                "policy.dtensor_cfg.cpu_offload=false"]
    cfg = "policy.megatron_cfg"
    split = outer_stage_layers(job.model("actor").layers, par.pp)
    first, last = split if split is not None else ("null", "null")
    return [
        "policy.dtensor_cfg.enabled=false", f"{cfg}.enabled=true",
        f"{cfg}.tensor_model_parallel_size={par.tp}",
        f"{cfg}.pipeline_model_parallel_size={par.pp}",
        f"{cfg}.num_layers_in_first_pipeline_stage={first}",
        f"{cfg}.num_layers_in_last_pipeline_stage={last}",
        f"{cfg}.context_parallel_size={par.cp}",
        *_context_parallel_padding(par, job, translation),
        f"{cfg}.expert_model_parallel_size={par.ep}",
        f"{cfg}.expert_tensor_parallel_size={par.etp}",
        f"{cfg}.sequence_parallel={_bool(par.sequence_parallel and par.tp > 1)}",
        f"{cfg}.activation_checkpointing={_bool(recompute != 'none')}",
        f"{cfg}.recompute_granularity={'selective' if recompute == 'selective' else 'full'}",
        f"{cfg}.optimizer.use_distributed_optimizer={_bool(par.sharding == 'optimizer')}",
        f"{cfg}.distributed_data_parallel_config.overlap_grad_reduce="
        f"{_bool(par.overlap_grad_reduce)}",
        f"{cfg}.distributed_data_parallel_config.overlap_param_gather="
        f"{_bool(par.overlap_param_gather)}",
    ]


def pad_factor(tp: int, cp: int, sequence_parallel: bool) -> int:
    """The multiple NeMo-RL's Megatron policy pads each packed sequence to: 2 x cp chunks
    under context parallelism, times tp under sequence parallelism (N nemo_rl/models/
    megatron/data.py:1127-1138 at v0.7.0, asserted of make_sequence_length_divisible_by)."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel and tp > 1 else 1)


def _context_parallel_padding(par: ParallelConfig, job: JobSpec,
                              translation: Translation) -> list[str]:
    """Context parallelism's settings beyond the size: sequence packing (NeMo-RL asserts it,
    N nemo_rl/models/megatron/setup.py:629-637 at v0.7.0) and a per-sequence padding multiple
    that splits into 2 x cp chunks (the recipe's default, tp, does not). The padding, under
    2 x cp x tp tokens a sequence, is not priced."""
    if par.cp == 1:
        return []
    if not job.framework_profile.training.sequence_packing:
        translation.differ("NeMo-RL's Megatron policy runs context parallelism only on packed "
                           "sequences; the plan was priced without packing",
                           key="roles.actor.parallel.cp", fix="set cp: 1",
                           written="sequence packing on")
    factor = pad_factor(par.tp, par.cp, par.sequence_parallel)
    return [f"policy.make_sequence_length_divisible_by={factor}"]


def _generation(plan: Plan, job: JobSpec, gen: GenerationConfig,
                translation: Translation) -> list[str]:
    vllm = "policy.generation.vllm_cfg"
    rollout = job.rollout
    if job.rollout_engine not in (None, "vllm"):
        translation.differ(f"the export writes NeMo-RL's vLLM generation backend; the job's "
                           f"engine is {job.rollout_engine}", key="job.rollout_engine",
                           fix="drop rollout_engine", written="vLLM")
    out = [f"{vllm}.tensor_parallel_size={gen.tp}", f"{vllm}.pipeline_parallel_size={gen.pp}",
           f"{vllm}.expert_parallel_size={gen.ep}",
           f"{vllm}.gpu_memory_utilization={gen.memory_utilization:g}",
           f"{vllm}.enforce_eager={_bool(not rollout.cuda_graphs)}"]
    if gen.free_cache is False:
        translation.differ("NeMo-RL's colocated vLLM always sleeps after generating (sleep "
                           "mode is hard-coded on); the plan keeps the engine's KV cache",
                           key="roles.actor.generation.free_cache",
                           fix="drop free_cache: false", written="its sleep")
    default_seqs = job.framework_profile.rollout.max_num_seqs
    if gen.max_num_seqs != default_seqs:
        translation.differ(f"NeMo-RL's recipe does not set vLLM's max_num_seqs (its engines "
                           f"run {default_seqs}); the plan has {gen.max_num_seqs}",
                           key="roles.actor.generation.max_num_seqs",
                           fix=f"set max_num_seqs: {default_seqs}", written=str(default_seqs))
    if plan.rollout is None:
        return [*out, "policy.generation.colocated.enabled=true",
                f"{vllm}.async_engine={_bool(gen.pp > 1)}", "grpo.async_grpo.enabled=false"]
    cluster_nodes, cluster_gpn = _cluster_shape(plan, _gpus_per_node(plan, job))
    nodes, per_node = (1, plan.rollout.gpus) if cluster_nodes == 1 else \
        (plan.rollout.gpus // cluster_gpn, cluster_gpn)
    return [*out, "policy.generation.colocated.enabled=false",
            f"policy.generation.colocated.resources.num_nodes={nodes}",
            f"policy.generation.colocated.resources.gpus_per_node={per_node}",
            # Async GRPO needs an async engine and the importance-sampling correction
            # (N algorithms/grpo.py:3364-3421).
            f"{vllm}.async_engine=true", "grpo.async_grpo.enabled=true",
            f"grpo.async_grpo.max_trajectory_age_steps={plan.max_staleness}",
            f"grpo.async_grpo.in_flight_weight_updates={_bool(plan.partial_rollout)}",
            "loss_fn.use_importance_sampling_correction=true"]


def _bool(value: bool) -> str:
    return "true" if value else "false"


def nemo_rl_files(plan: Plan, job: JobSpec, *, plan_name: str = "plan.json",
                  translation: Translation | None = None) -> dict[str, str]:
    translation = translation or translation_for(job, "nemo-rl")
    base, overrides = nemo_rl_overrides(plan, job, translation)
    notes = notes_comment(job, translation)
    script = f"""#!/usr/bin/env bash
# Runs {plan_name} ({plan.strategy or 'plan'}: {plan.describe()}, mode {plan.mode_label()})
# with NeMo-RL {NEMO_RL_VERSION} from a NeMo-RL checkout (NEMO_RL_DIR, default: the current
# directory). Written by `hybridflow export --to nemo-rl`.
{notes}# Extra overrides after the script's name come last and win, e.g.
#   bash {SCRIPT_FILE} policy.model_name=/ckpt/actor
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
mapfile -t overrides < <(grep -v -e '^[[:space:]]*$' -e '^[[:space:]]*#' "$here/{OVERRIDES_FILE}")
cd "${{NEMO_RL_DIR:-.}}"
exec uv run examples/run_grpo.py --config {base} "${{overrides[@]}}" "$@"
"""
    return {OVERRIDES_FILE: "\n".join(overrides) + "\n", SCRIPT_FILE: script}


def nemo_rl_checks(values: dict[str, str]) -> list[str]:
    """The arithmetic NeMo-RL 0.7 asserts at start-up, on exported overrides: what would stop
    the run (empty: nothing)."""
    def number(key: str) -> int:
        return int(float(values[key]))

    problems = []
    gpn, nodes = number("cluster.gpus_per_node"), number("cluster.num_nodes")
    world = gpn * nodes
    if values.get("policy.generation.colocated.enabled") == "false":
        gen_nodes = number("policy.generation.colocated.resources.num_nodes")
        gen_gpn = number("policy.generation.colocated.resources.gpus_per_node")
        if nodes == 1:
            if gen_nodes != 1:
                problems.append("one node: resources.num_nodes must be 1 (grpo.py:605-665)")
            world -= gen_gpn
            inference = gen_gpn
        else:
            if gen_gpn != gpn:
                problems.append("several nodes: resources.gpus_per_node must be the cluster's")
            world -= gen_nodes * gpn
            inference = gen_nodes * gen_gpn
    else:
        inference = world
    megatron = values.get("policy.megatron_cfg.enabled") == "true"
    if megatron:
        tp = number("policy.megatron_cfg.tensor_model_parallel_size")
        pp = number("policy.megatron_cfg.pipeline_model_parallel_size")
    else:
        tp, pp = number("policy.dtensor_cfg.tensor_parallel_size"), 1
    if world % (tp * pp):
        problems.append(f"world {world} not divisible by tp x pp (lm_policy.py:197-212)")
        return problems
    dp = world // (tp * pp)
    cp = number("policy.megatron_cfg.context_parallel_size") if megatron else 1
    if cp > 1:
        if values.get("policy.sequence_packing.enabled") != "true":
            problems.append("context parallelism needs sequence packing (setup.py:629-637)")
        factor = pad_factor(tp, cp, values.get("policy.megatron_cfg.sequence_parallel") == "true")
        divisible = number("policy.make_sequence_length_divisible_by") \
            if "policy.make_sequence_length_divisible_by" in values else tp
        if divisible % factor:
            problems.append(f"make_sequence_length_divisible_by {divisible} is not a multiple "
                            f"of {factor} (data.py:1127-1138)")
    sequences = number("grpo.num_prompts_per_step") * number("grpo.num_generations_per_prompt")
    gbs = number("policy.train_global_batch_size")
    if sequences % gbs:
        problems.append("rollout batch not divisible by train_global_batch_size "
                        "(batched_data_dict.py:395)")
    if gbs % dp:
        problems.append(f"train_global_batch_size {gbs} not divisible by dp {dp} "
                        "(batched_data_dict.py:399)")
    if tp >= 4 and number("policy.train_micro_batch_size") != number("policy.logprob_batch_size"):
        problems.append("tp >= 4 needs train_micro_batch_size == logprob_batch_size "
                        "(lm_policy.py:178-195)")
    vllm = "policy.generation.vllm_cfg"
    gen_tp = number(f"{vllm}.tensor_parallel_size")
    gen_pp = number(f"{vllm}.pipeline_parallel_size")
    if inference % (gen_tp * gen_pp):
        problems.append("inference GPUs not divisible by vLLM tp x pp (vllm_generation.py:110)")
    if gen_pp > 1 and values.get(f"{vllm}.async_engine") != "true":
        problems.append("vLLM pp > 1 needs async_engine (vllm_generation.py:117-121)")
    ep = number(f"{vllm}.expert_parallel_size")
    if ep > 1 and ep % gen_tp:
        problems.append("vLLM ep must be a multiple of tp (vllm_generation.py:123-134)")
    return problems


def parse_nemo_rl_overrides(text: str) -> dict[str, str]:
    """key -> value of an exported overrides file."""
    values = {}
    for line in read_argument_lines(text):
        key, sep, value = line.partition("=")
        if not sep:
            raise SpecError(f"not an override: {line!r}", source=OVERRIDES_FILE)
        values[key.lstrip("+~")] = value
    return values
