"""Export a plan to verl 0.9 (Hydra overrides for ``verl.trainer.main_ppo`` and its
asynchronous trainers).

What verl 0.9 can place by configuration (``verl/trainer/ppo/v1/trainer_base.py``,
``_init_resource_pool_mgr``): actor, rollout, reference and critic on one global pool
(``trainer.nnodes`` x ``trainer.n_gpus_per_node``); the reward model on the global pool or on
a pool of its own (``reward.reward_model.enable_resource_pool``); in the asynchronous trainers
(``verl.experimental.one_step_off_policy.main_ppo``, ``verl.experimental.fully_async_policy.
fully_async_main``) a rollout-only pool (``rollout.nnodes`` x ``rollout.n_gpus_per_node``)
beside the trainer pool. Any other placement (a critic or reference on GPUs of its own) would
need a patched trainer, so it is refused in one line. One engine family serves every trained
model (``ppo_trainer``: FSDP; ``ppo_megatron_trainer``: Megatron); the reward model runs on an
inference engine (``reward.reward_model.rollout``).
"""

from __future__ import annotations

import shlex

from planner.export.common import (
    Layout,
    Translation,
    nodes_of,
    notes_comment,
    read_argument_lines,
    set_key,
    translation_for,
)
from profiles.datafile import SpecError
from profiles.framework import load_framework
from simulator.plan import Plan, RolePlan
from simulator.specs.job import RULE, JobSpec
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig, outer_stage_layers

VERL_VERSION = "0.9.1"
"""The verl release the overrides are written for (and tested against)."""
OVERRIDES_FILE = "verl_overrides.txt"
SCRIPT_FILE = "run_verl.sh"

ENTRY = {
    "sync": "verl.trainer.main_ppo",
    "one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
    "async": "verl.experimental.fully_async_policy.fully_async_main",
}
"""verl's entry point per mode."""
CONFIG = {
    ("sync", "fsdp"): "ppo_trainer",
    ("sync", "megatron"): "ppo_megatron_trainer",
    ("one_step_off", "fsdp"): "one_step_off_ppo_trainer",
    ("one_step_off", "megatron"): "one_step_off_ppo_megatron_trainer",
    ("async", "fsdp"): "fully_async_ppo_trainer",
    ("async", "megatron"): "fully_async_ppo_megatron_trainer",
}
"""verl's Hydra config per (mode, engine)."""
SEARCHPATH = "hydra.searchpath=[pkg://verl.trainer.config]"
"""The one-step-off configs and the fully-async Megatron config find verl's base config by a
path relative to a source checkout (``file://verl/trainer/config``); with verl installed from
the registry they need this (written for both asynchronous entry points)."""
ESTIMATOR = {"ppo": "gae", "grpo": "grpo", "remax": "remax"}
"""Our algorithm -> verl's ``algorithm.adv_estimator``."""


def _engine(plan: Plan, job: JobSpec) -> str:
    """fsdp or megatron: verl 0.9 runs actor, reference and critic on one engine family, so
    the layouts must agree on it (tensor or pipeline parallelism and the distributed
    optimizer need Megatron; FSDP sharding needs FSDP; otherwise the roles' backends say)."""
    roles = [r for r in SHARED_ROLES if r in plan.roles]
    megatron = [r for r in roles if plan.roles[r].parallel.tp > 1
                or plan.roles[r].parallel.pp > 1 or plan.roles[r].parallel.sharding == "optimizer"]
    fsdp = [r for r in roles if plan.roles[r].parallel.sharding == "fsdp"]
    if megatron and fsdp:
        raise SpecError(f"verl 0.9 runs actor, reference and critic on one engine: "
                        f"{plan.roles[megatron[0]].parallel.short()} of {megatron[0]} needs "
                        f"Megatron, {plan.roles[fsdp[0]].parallel.short()} of {fsdp[0]} FSDP; "
                        f"give {fsdp[0]} a Megatron layout (sharding: optimizer) or "
                        f"{megatron[0]} an FSDP one (tp 1, pp 1, sharding: fsdp)",
                        key=f"roles.{fsdp[0]}.parallel")
    if megatron or fsdp:
        return "megatron" if megatron else "fsdp"
    backends = {plan.roles[r].training_backend for r in roles}
    return "megatron" if backends == {"megatron"} else "fsdp"


def _verl_space() -> object:
    return load_framework("verl").space


SHARED_ROLES = ("actor", "critic", "ref")
"""The roles verl 0.9 runs on one engine (one Hydra config per engine)."""


def _check_placement(plan: Plan, job: JobSpec) -> None:
    """Global pool = the actor's set; the reward model may have a set of its own; nothing
    else can be placed by configuration."""
    actor_set = plan.set_of("actor")
    for s in plan.sets:
        if s is actor_set:
            continue
        if s.roles != ("reward",):
            fix = ("plan it without --backend simulated (a study's placements are not "
                   "verl's)" if job.framework_profile.space == _verl_space() else
                   "plan the job with framework: verl")
            raise SpecError(f"verl 0.9 places actor, rollout, reference and critic on one "
                            f"global pool (only the reward model may have its own): this set "
                            f"puts {s.label()} apart from the actor; {fix}",
                            key=set_key(plan, s.roles))
    if plan.rollout is not None and "reward" in actor_set.roles:
        raise SpecError("verl 0.9's asynchronous trainers do not colocate the reward model "
                        "with the trainer (reward.reward_model.enable_resource_pool=True is "
                        "required): give the reward model a set of its own",
                        key=set_key(plan, actor_set.roles))
    if (plan.rollout is not None and plan.rollout.node_group != actor_set.node_group) or any(
            s.node_group != actor_set.node_group for s in plan.sets):
        raise SpecError("verl 0.9 assumes one kind of node (trainer.n_gpus_per_node); the plan "
                        "uses several node groups", key="sets")


def _role_layout(role: str, rp: RolePlan, engine: str, prefix: str, *, fsdp_key: str,
                 model: ModelSpec) -> list[str]:
    par = rp.parallel
    key = f"roles.{role}.parallel"
    moe = model.moe is not None
    if moe and engine == "fsdp" and (par.ep > 1 or par.etp > 1):
        raise SpecError(f"verl 0.9's FSDP engine has no expert parallelism ({role}: "
                        f"{par.short()}); train it with Megatron", key=f"{key}.ep")
    if engine == "fsdp":
        if par.tp > 1 or par.pp > 1:
            raise SpecError(f"verl 0.9's FSDP engine has no tensor or pipeline parallelism "
                            f"({role}: {par.short()}); set tp: 1 and pp: 1, or train every "
                            "model with Megatron (sharding: optimizer)", key=key)
        # fsdp_size: the sharding group (every rank, or a hybrid-sharding group of them); 1
        # keeps whole replicas (plain data parallelism).
        return [f"{prefix}.{fsdp_key}.fsdp_size={par.fsdp_shards}"]
    if par.sharding == "fsdp":
        raise SpecError(f"verl 0.9's Megatron engine shards optimizer states, not FSDP-style "
                        f"({role}: {par.short()}); set sharding: optimizer",
                        key=f"{key}.sharding")
    return [
        f"{prefix}.megatron.tensor_model_parallel_size={par.tp}",
        f"{prefix}.megatron.pipeline_model_parallel_size={par.pp}",
        f"{prefix}.megatron.virtual_pipeline_model_parallel_size="
        f"{par.vpp if par.vpp > 1 else 'null'}",
        f"{prefix}.megatron.context_parallel_size={par.cp}",
        f"{prefix}.megatron.sequence_parallel={_bool(par.sequence_parallel and par.tp > 1)}",
        f"{prefix}.megatron.use_distributed_optimizer={_bool(par.sharding == 'optimizer')}",
        # The price counts real tokens (no padding): packed THD sequences.
        f"{prefix}.megatron.use_remove_padding=true",
    ] + ([f"{prefix}.megatron.expert_model_parallel_size={par.ep}",
          # Megatron's default for an unset expert tensor size is the tp size: always say it.
          f"{prefix}.megatron.expert_tensor_parallel_size={par.etp}"] if moe else []
         ) + _uneven_stages(role, par, model, prefix)


def _training_settings(role: str, rp: RolePlan, engine: str, prefix: str, model_prefix: str,
                       job: JobSpec, translation: Translation) -> list[str]:
    """What a trained model's price assumed beyond its layout: recompute, unpadded
    micro-batches of whole sequences (no token budget, no Ulysses), the framework's offload
    and, with Megatron, the gradient overlap."""
    par = rp.parallel
    offload = job.framework_profile.offload
    key = f"roles.{role}.parallel.recompute"
    if engine == "fsdp":
        recompute = par.recompute
        if recompute == "selective":
            translation.differ("verl's FSDP engine recomputes every layer or none "
                               "(enable_gradient_checkpointing), not the attention core alone",
                               key=key, fix="set recompute: full or none", written="full")
            recompute = "full"
        fsdp = f"{prefix}.fsdp_config" if role == "actor" else f"{prefix}.fsdp"
        sequence = f"{prefix}.ulysses_sequence_parallel_size={par.ulysses}"
        # The price gathers the actor's weights for the rollout in fp32, its master dtype
        # (the verl profile's transition_fsdp_gather: dtensor_fp32).
        dtype = [f"{fsdp}.model_dtype=fp32"] if role == "actor" else []
        return [f"{model_prefix}.enable_gradient_checkpointing={_bool(recompute != 'none')}",
                f"{model_prefix}.use_remove_padding=true",
                *_token_budgets(role, par, prefix), sequence,
                f"{fsdp}.param_offload={_bool(par.offload_params or offload.params)}",
                f"{fsdp}.optimizer_offload={_bool(par.offload_optimizer or offload.optimizer)}",
                *dtype]
    override = f"{prefix}.megatron.override_transformer_config"
    recompute = {
        "none": [f"{override}.recompute_granularity=null"],
        "selective": [f"{override}.recompute_granularity=selective",
                      f"{override}.recompute_modules=[core_attn]"],
        "full": [f"{override}.recompute_granularity=full",
                 f"{override}.recompute_method=uniform", f"{override}.recompute_num_layers=1"],
    }[par.recompute]
    ddp = f"+{prefix}.megatron.override_ddp_config"
    if par.ulysses > 1:
        raise SpecError(f"verl's Megatron engine has no Ulysses sequence parallelism ({role}: "
                        f"{par.short()}); set ulysses: 1", key=f"roles.{role}.parallel.ulysses")
    return [
        *recompute,
        *_token_budgets(role, par, prefix),
        f"{prefix}.megatron.param_offload={_bool(par.offload_params or offload.params)}",
        f"{prefix}.megatron.optimizer_offload="
        f"{_bool(par.offload_optimizer or offload.optimizer)}",
        f"{ddp}.overlap_grad_reduce={_bool(par.overlap_grad_reduce)}",
        f"{ddp}.overlap_param_gather={_bool(par.overlap_param_gather)}",
    ]


def _token_budgets(role: str, par: ParallelConfig, prefix: str) -> list[str]:
    """Micro-batches by a token budget (use_dynamic_bsz) or by sequence count, for the
    training passes and the forward-only ones (the actor's old log-probs run on the rollout
    worker's settings, the critic's values on forward_max_token_len_per_gpu)."""
    dynamic = bool(par.micro_batch_tokens)
    forward = bool(par.infer_micro_batch_tokens)
    if dynamic != forward:
        raise SpecError(f"verl switches token budgets on for the training and forward passes "
                        f"of {role} together (use_dynamic_bsz): the plan has "
                        f"micro_batch_tokens {par.micro_batch_tokens} and "
                        f"infer_micro_batch_tokens {par.infer_micro_batch_tokens}",
                        key=f"roles.{role}.parallel.micro_batch_tokens")
    out = [f"{prefix}.use_dynamic_bsz={_bool(dynamic)}"]
    if dynamic:
        out.append(f"{prefix}.ppo_max_token_len_per_gpu={par.micro_batch_tokens}")
    if role == "actor":
        rollout = "actor_rollout_ref.rollout"
        out.append(f"{rollout}.log_prob_use_dynamic_bsz={_bool(forward)}")
        if forward:
            out.append(f"{rollout}.log_prob_max_token_len_per_gpu="
                       f"{par.infer_micro_batch_tokens}")
    elif forward:
        out.append(f"{prefix}.forward_max_token_len_per_gpu={par.infer_micro_batch_tokens}")
    return out


def _uneven_stages(role: str, par: ParallelConfig, model: ModelSpec, prefix: str) -> list[str]:
    """Megatron's first/last stage layer counts when pp does not divide the layers (verl
    passes override_transformer_config to Megatron's TransformerConfig; its reference worker
    takes the actor's, so only the actor and the critic write them)."""
    split = outer_stage_layers(model.layers, par.pp)
    if split is None and par.pp > 1 and model.layers % par.pp:
        raise SpecError(f"pp={par.pp} leaves Megatron's first or last stage of the "
                        f"{model.layers} layers of {model.name} empty ({role}: {par.short()})",
                        key=f"roles.{role}.parallel.pp")
    if split is None or role == "ref":
        return []
    first, last = split
    override = f"+{prefix}.megatron.override_transformer_config"
    return [f"{override}.num_layers_in_first_pipeline_stage={first}",
            f"{override}.num_layers_in_last_pipeline_stage={last}"]


def _bool(value: bool) -> str:
    return "true" if value else "false"


def model_path(job: JobSpec, role: str) -> str:
    """The checkpoint the job names for ``role``, else a placeholder to replace
    (``models/NAME``), which an extra override after the script's own replaces."""
    if role in job.model_paths:
        return job.model_paths[role]
    return f"models/{job.model(role).name}"


def verl_overrides(plan: Plan, job: JobSpec, translation: Translation | None = None
                   ) -> tuple[str, str, list[str]]:
    """(entry module, config name, overrides) for ``plan``; SpecError if verl 0.9 cannot
    express it. Every setting the price assumed is written (none is left to verl's
    defaults); a plan made for another framework is translated (``translation`` collects
    the differences)."""
    translation = translation or translation_for(job, "verl")
    if job.algorithm not in ESTIMATOR:
        raise SpecError(f"verl 0.9 has no {job.algorithm} trainer (estimators: gae, grpo, "
                        "remax; no cost model)", key="algorithm")
    _check_placement(plan, job)
    engine = _engine(plan, job)
    if engine == "fsdp":
        _note_context_parallelism(plan, translation)
    mode = plan.mode
    gpn = job.cluster.pool_of(plan.set_of("actor").node_group).group.gpus_per_node
    out: list[str] = []
    if mode != "sync":
        out.append(SEARCHPATH)
    nodes, per_node = nodes_of(plan.set_of("actor").gpus, gpn)
    out += [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={per_node}",
            # The price spreads a batch's tokens evenly over the data-parallel ranks.
            "trainer.balance_batch=true"]
    out += _actor(plan, job, engine, translation)
    out += _kl(plan, job)
    if "ref" in plan.roles:
        out += _reference(plan, job, engine)
    gen = plan.roles["actor"].generation
    assert gen is not None
    out += _rollout(plan, job, gen)
    if "critic" in plan.roles:
        out += _critic(plan, job, engine, translation)
    out += _reward(plan, job, gpn)
    if plan.rollout is not None:
        r_nodes, r_per_node = nodes_of(plan.rollout.gpus, gpn)
        out += [f"rollout.nnodes={r_nodes}", f"rollout.n_gpus_per_node={r_per_node}"]
    if mode == "async":
        out += _async_training(plan, job)
    return ENTRY[mode], CONFIG[(mode, engine)], out


def _note_context_parallelism(plan: Plan, translation: Translation) -> None:
    """verl's FSDP engine has no context parallelism: a plan's cp is translated away."""
    for role, rp in plan.roles.items():
        if rp.parallel.cp > 1 and role != "reward":
            translation.differ("verl's FSDP engine splits sequences with Ulysses only; "
                               f"{role} has context parallelism cp={rp.parallel.cp}",
                               key=f"roles.{role}.parallel.cp",
                               fix="set cp: 1, or train with Megatron",
                               written="no sequence split")


def _actor(plan: Plan, job: JobSpec, engine: str, translation: Translation) -> list[str]:
    """The batch (verl counts train_batch_size and ppo_mini_batch_size in prompts, times
    rollout.n responses each; the plan splits prompts x samples into mini_batches_per_epoch)
    and the actor's layout and training settings."""
    work = job.workload
    prompts, mini = work.prompts_per_iteration, work.mini_batches_per_epoch
    if prompts % mini:
        raise SpecError(f"{prompts} prompts do not split into {mini} mini-batches of whole "
                        "prompts (verl's ppo_mini_batch_size counts prompts)",
                        key="job.workload.mini_batches_per_epoch")
    actor = plan.roles["actor"]
    out = [
        f"algorithm.adv_estimator={ESTIMATOR[job.algorithm]}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={work.prompt_length}",
        f"data.max_response_length={work.response_length.max_tokens}",
        f"actor_rollout_ref.model.path={model_path(job, 'actor')}",
        f"actor_rollout_ref.actor.strategy={engine}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={actor.parallel.micro_batch_size}",
        f"actor_rollout_ref.actor.ppo_epochs={work.ppo_epochs}",
    ]
    out += _role_layout("actor", actor, engine, "actor_rollout_ref.actor", fsdp_key="fsdp_config",
                        model=job.model("actor"))
    out += _training_settings("actor", actor, engine, "actor_rollout_ref.actor",
                              "actor_rollout_ref.model", job, translation)
    return out


def _reference(plan: Plan, job: JobSpec, engine: str) -> list[str]:
    """The reference's micro-batches, layout and offload (it must cut the layers into
    pipeline stages as the actor does: verl gives it the actor's stage sizes)."""
    ref, actor = plan.roles["ref"], plan.roles["actor"]
    out = ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="
           f"{ref.parallel.micro_batch_size}"]
    budget = ref.parallel.infer_micro_batch_tokens
    out.append(f"actor_rollout_ref.ref.log_prob_use_dynamic_bsz={_bool(bool(budget))}")
    if budget:
        out.append(f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}")
    if outer_stage_layers(job.model("ref").layers, ref.parallel.pp) != outer_stage_layers(
            job.model("actor").layers, actor.parallel.pp):
        raise SpecError("verl's reference takes the actor's first/last pipeline stage "
                        f"sizes: ref {ref.parallel.short()} and actor "
                        f"{actor.parallel.short()} cut the layers differently",
                        key="roles.ref.parallel.pp")
    out += _role_layout("ref", ref, engine, "actor_rollout_ref.ref", fsdp_key="fsdp_config",
                        model=job.model("ref"))
    out.append(f"actor_rollout_ref.ref.{'fsdp_config' if engine == 'fsdp' else 'megatron'}"
               f".param_offload={_bool(ref.parallel.offload_params)}")
    if engine == "fsdp":
        out.append("actor_rollout_ref.ref.ulysses_sequence_parallel_size="
                   f"{ref.parallel.ulysses}")
    return out


def _critic(plan: Plan, job: JobSpec, engine: str, translation: Translation) -> list[str]:
    """The critic's engine, model, micro-batches, layout and training settings."""
    critic = plan.roles["critic"]
    out = [f"critic.strategy={engine}", f"critic.model.path={model_path(job, 'critic')}",
           f"critic.ppo_micro_batch_size_per_gpu={critic.parallel.micro_batch_size}"]
    if engine == "fsdp":
        out.append(f"critic.forward_micro_batch_size_per_gpu="
                   f"{job.workload.infer_micro_batch_size}")
    out += _role_layout("critic", critic, engine, "critic", fsdp_key="fsdp",
                        model=job.model("critic"))
    out += _training_settings("critic", critic, engine, "critic", "critic.model", job,
                              translation)
    return out


def _async_training(plan: Plan, job: JobSpec) -> list[str]:
    """verl's fully async trainer: one trainer step consumes one iteration's batch (all its
    mini-batches) and then syncs weights; the rollouter may run max_staleness batches ahead
    of the sync (verl's bound is (1 + staleness_threshold) x the samples of one sync)."""
    return [
        f"async_training.require_batches={job.workload.mini_batches_per_epoch}",
        "async_training.trigger_parameter_sync_step=1",
        f"async_training.staleness_threshold={plan.max_staleness - 1}",
        f"async_training.partial_rollout={_bool(plan.partial_rollout)}",
    ]


def _kl(plan: Plan, job: JobSpec) -> list[str]:
    """Both KL switches, always: verl builds a reference worker when either is on
    (need_reference_policy), which is what the plan's reference pass prices."""
    term = job.kl_term
    if term != "none" and "ref" not in plan.roles:
        raise SpecError(f"kl: {term} needs a reference model, which the plan does not place",
                        key="roles.ref")
    return [f"actor_rollout_ref.actor.use_kl_loss={_bool(term == 'loss')}",
            f"algorithm.use_kl_in_reward={_bool(term == 'reward')}"]


def _rollout(plan: Plan, job: JobSpec, gen: GenerationConfig) -> list[str]:
    """The rollout engine as priced (vLLM or SGLang): its layout and limits, CUDA graphs,
    sleeping between iterations, the old-log-prob recompute and dynamic sampling's filter."""
    work = job.workload
    profile = job.framework_profile
    rollout = job.rollout
    engine = job.rollout_engine or profile.rollout_engine
    engines = load_framework("verl").rollout_engine_names
    if engine not in engines:
        raise SpecError(f"verl 0.9 rolls out with {' or '.join(engines)}; the job's engine is "
                        f"{engine}", key="job.rollout_engine")
    if not load_framework("verl").rollout_for(engine).pipeline_parallel and gen.pp > 1:
        raise SpecError(f"verl starts {engine} with no pipeline-parallel size; the plan "
                        f"generates with pp={gen.pp}: set generation pp 1",
                        key="roles.actor.generation.pp")
    recompute_old = profile.passes.old_log_prob_in(plan.mode)
    out = [
        f"actor_rollout_ref.rollout.name={engine}",
        f"actor_rollout_ref.rollout.n={work.samples_per_prompt}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={gen.tp}",
        f"actor_rollout_ref.rollout.pipeline_model_parallel_size={gen.pp}",
        *([f"actor_rollout_ref.rollout.expert_parallel_size={gen.ep}",
           f"actor_rollout_ref.rollout.data_parallel_size={gen.ep // gen.tp}"]
          if gen.ep > 1 else []),
        f"actor_rollout_ref.rollout.gpu_memory_utilization={gen.memory_utilization:g}",
        f"actor_rollout_ref.rollout.max_num_seqs={gen.max_num_seqs}",
        f"actor_rollout_ref.rollout.enforce_eager={_bool(not rollout.cuda_graphs)}",
        f"actor_rollout_ref.rollout.free_cache_engine="
        f"{_bool(rollout.free_kv_cache if gen.free_cache is None else gen.free_cache)}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="
        f"{work.infer_micro_batch_size}",
    ]
    if plan.mode != "async":
        # The old log-probs: recomputed by the actor's engine (priced as a pass of its own) or
        # taken from the rollout (the fully-async trainer always takes the rollout's).
        out.append(f"algorithm.rollout_correction.bypass_mode={_bool(not recompute_old)}")
    if work.generates_more_than_it_trains:
        # Groups whose rewards do not differ are dropped and replaced by more generations
        # (priced as one generation of generated_prompts_per_iteration prompts).
        out.append("algorithm.filter_groups.enable=true")
    return out


def _reward(plan: Plan, job: JobSpec, gpn: int) -> list[str]:
    if job.models.get("reward") == RULE:
        out = ["reward.reward_model.enable=false"]
        if job.reward_function is not None:
            out += [f"reward.custom_reward_function.path={job.reward_function.path}",
                    f"reward.custom_reward_function.name={job.reward_function.name}"]
        return out
    rp = plan.roles["reward"]
    par = rp.parallel
    own = plan.set_of("reward") is not plan.set_of("actor")
    # verl 0.9 serves the reward model on an inference engine: one replica per tp*pp GPUs.
    out = ["reward.reward_model.enable=true",
           f"reward.reward_model.model_path={model_path(job, 'reward')}",
           "reward.reward_model.rollout.name=vllm",
           f"reward.reward_model.rollout.tensor_model_parallel_size={par.tp}",
           f"reward.reward_model.rollout.pipeline_model_parallel_size={par.pp}",
           f"reward.reward_model.enable_resource_pool={_bool(own)}"]
    if own:
        nodes, per_node = nodes_of(plan.set_of("reward").gpus, gpn)
        out += [f"reward.reward_model.nnodes={nodes}",
                f"reward.reward_model.n_gpus_per_node={per_node}"]
    return out


def verl_files(plan: Plan, job: JobSpec, *, plan_name: str = "plan.json",
               translation: Translation | None = None) -> dict[str, str]:
    translation = translation or translation_for(job, "verl")
    module, config, overrides = verl_overrides(plan, job, translation)
    notes = notes_comment(job, translation)
    script = f"""#!/usr/bin/env bash
# Runs {plan_name} ({plan.strategy or 'plan'}: {plan.describe()}, mode {plan.mode_label()})
# with verl {VERL_VERSION}. Written by `hybridflow export --to verl`.
{notes}# Extra Hydra overrides after the script's name come last and win, e.g.
#   bash {SCRIPT_FILE} actor_rollout_ref.model.path=/ckpt/actor data.train_files=/data/train.parquet
# Start Ray on the nodes first (`ray start`); verl's Ray places the pools on them.
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
mapfile -t overrides < <(grep -v '^[[:space:]]*$' "$here/{OVERRIDES_FILE}")
exec python3 -m {module} --config-name {config} "${{overrides[@]}}" "$@"
"""
    return {OVERRIDES_FILE: "\n".join(overrides) + "\n", SCRIPT_FILE: script}


# ----- reading an export back -----


def parse_verl_files(overrides_text: str, script_text: str) -> tuple[str, str, dict[str, str]]:
    """(entry module, config name, key -> value) of an exported verl launch."""
    values: dict[str, str] = {}
    for line in read_argument_lines(overrides_text):
        key, sep, value = line.partition("=")
        if not sep:
            raise SpecError(f"not a Hydra override: {line!r}", source=OVERRIDES_FILE)
        values[key.lstrip("+")] = value
    module = config = ""
    for line in script_text.splitlines():
        words = shlex.split(line, comments=True) if line.strip().startswith("exec ") else []
        if "-m" in words:
            module = words[words.index("-m") + 1]
        if "--config-name" in words:
            config = words[words.index("--config-name") + 1]
    if not module or not config:
        raise SpecError("no `python3 -m MODULE --config-name NAME` line", source=SCRIPT_FILE)
    return module, config, values


def verl_layout(overrides_text: str, script_text: str, roles: tuple[str, ...]) -> Layout:
    """The placement and parallel sizes an exported verl launch runs (``roles``: the GPU
    roles of the job), read only from the exported files."""
    module, config, v = parse_verl_files(overrides_text, script_text)
    mode = next(m for m, entry in ENTRY.items() if entry == module)
    pool = int(v["trainer.nnodes"]) * int(v["trainer.n_gpus_per_node"])
    megatron = "megatron" in config
    own_reward = v.get("reward.reward_model.enable_resource_pool") == "true"
    reward_gpus = (int(v["reward.reward_model.nnodes"])
                   * int(v["reward.reward_model.n_gpus_per_node"])) if own_reward else 0
    global_roles = frozenset(r for r in roles if not (r == "reward" and own_reward))
    sets = {(global_roles, pool)}
    if own_reward:
        sets.add((frozenset({"reward"}), reward_gpus))

    def sizes(role: str, prefix: str, fsdp_key: str, gpus: int) -> tuple[int, int, int]:
        if megatron:
            tp = int(v[f"{prefix}.megatron.tensor_model_parallel_size"])
            pp = int(v[f"{prefix}.megatron.pipeline_model_parallel_size"])
        else:
            tp = pp = 1
        return tp, pp, gpus // (tp * pp)

    experts = {}
    for role, prefix in (("actor", "actor_rollout_ref.actor"), ("ref", "actor_rollout_ref.ref"),
                         ("critic", "critic")):
        ep = int(v.get(f"{prefix}.megatron.expert_model_parallel_size", 1))
        etp = int(v.get(f"{prefix}.megatron.expert_tensor_parallel_size", 1))
        if role in roles and (ep, etp) != (1, 1):
            experts[role] = (ep, etp)
    parallel = {"actor": sizes("actor", "actor_rollout_ref.actor", "fsdp_config", pool)}
    if "ref" in roles:
        parallel["ref"] = sizes("ref", "actor_rollout_ref.ref", "fsdp_config", pool)
    if "critic" in roles:
        parallel["critic"] = sizes("critic", "critic", "fsdp", pool)
    if "reward" in roles:
        tp = int(v["reward.reward_model.rollout.tensor_model_parallel_size"])
        pp = int(v["reward.reward_model.rollout.pipeline_model_parallel_size"])
        parallel["reward"] = (tp, pp, (reward_gpus or pool) // (tp * pp))
    rollout = 0
    if mode != "sync":
        rollout = int(v["rollout.nnodes"]) * int(v["rollout.n_gpus_per_node"])
    staleness = {"sync": 0, "one_step_off": 1}.get(mode)
    if staleness is None:
        staleness = int(float(v["async_training.staleness_threshold"])) + 1
    return Layout(
        sets=frozenset(sets), parallel=tuple(sorted(parallel.items())),
        generation=(int(v["actor_rollout_ref.rollout.tensor_model_parallel_size"]),
                    int(v["actor_rollout_ref.rollout.pipeline_model_parallel_size"])),
        rollout_gpus=rollout, mode=mode, max_staleness=staleness,
        partial_rollout=v.get("async_training.partial_rollout") == "true",
        experts=tuple(sorted(experts.items())),
        generation_ep=int(v.get("actor_rollout_ref.rollout.expert_parallel_size", 1)))
