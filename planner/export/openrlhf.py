"""Export a plan to OpenRLHF 0.11 (arguments of ``openrlhf.cli.train_ppo_ray``).

What OpenRLHF 0.11 can place by its arguments (``openrlhf/cli/train_ppo_ray.py``, ``train``):
each of actor, reference, critic and reward gets ``--ROLE.num_nodes`` x
``--ROLE.num_gpus_per_node`` GPUs of its own; ``--train.colocate_actor_ref`` and
``--train.colocate_critic_reward`` put those pairs on one placement group;
``--train.colocate_all`` puts every model on one, and, in synchronous training, the vLLM
engines too (the only way the actor generates on its own GPUs). vLLM engines not colocated
get GPUs of their own (``--vllm.num_engines`` x ``--vllm.tensor_parallel_size``), which is
the rollout set of ``--train.async_enable``. Training is DeepSpeed with one ZeRO stage and one
AutoTP size for every model (``--ds.*``), no pipeline parallelism.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from planner.export.common import (
    Layout,
    Translation,
    nodes_of,
    notes_comment,
    read_argument_lines,
    set_key,
    translation_for,
)
from planner.export.verl import model_path
from profiles.datafile import SpecError
from profiles.framework import load_framework
from simulator.costs.context_parallel import KV_HEADS_PER_GATHER
from simulator.plan import Plan
from simulator.predict import shard_budget_tokens
from simulator.specs.job import RULE, JobSpec
from simulator.specs.parallel import ParallelConfig

OPENRLHF_VERSION = "0.11.2"
"""The OpenRLHF release the arguments are written for (and tested against)."""
ARGS_FILE = "openrlhf_args.txt"
SCRIPT_FILE = "run_openrlhf.sh"
MODULE = "openrlhf.cli.train_ppo_ray"
ESTIMATOR = {"ppo": "gae", "grpo": "group_norm"}
"""Our algorithm -> ``--algo.advantage.estimator`` (OpenRLHF has no ReMax: its baselines are
group means, not a greedy response)."""
ZERO_STAGE = {"none": 0, "optimizer": 1, "fsdp": 3}
"""Our sharding -> DeepSpeed ZeRO stage of the trained models."""
PAIRS = {frozenset({"actor", "ref"}): "--train.colocate_actor_ref",
         frozenset({"critic", "reward"}): "--train.colocate_critic_reward"}


def _placement_flags(plan: Plan, job: JobSpec) -> list[str]:
    roles = set(job.gpu_roles)
    if plan.rollout is None:
        if len(plan.sets) == 1:
            return ["--train.colocate_all"]
        other = next(s for s in plan.sets if "actor" not in s.roles)
        raise SpecError("OpenRLHF 0.11 generates on the actor's GPUs only with "
                        "--train.colocate_all (every model on one set); this plan puts "
                        f"{other.label()} apart from the actor", key=set_key(plan, other.roles))
    if len(plan.sets) == 1:
        return ["--train.colocate_all"]  # async: colocates the DeepSpeed models only
    flags = []
    for s in plan.sets:
        group = frozenset(s.roles)
        if len(group) == 1:
            continue
        if group in PAIRS:
            flags.append(PAIRS[group])
            continue
        raise SpecError(f"OpenRLHF 0.11 colocates only actor+ref, critic+reward or every model; "
                        f"this set holds {s.label()}", key=set_key(plan, s.roles))
    assert roles == {r for s in plan.sets for r in s.roles}
    return flags


def _check_pipeline(plan: Plan) -> None:
    for role, rp in plan.roles.items():
        if rp.parallel.pp > 1:
            raise SpecError(f"OpenRLHF 0.11 (DeepSpeed) has no pipeline parallelism "
                            f"({role}: {rp.parallel.short()}); set pp: 1",
                            key=f"roles.{role}.parallel.pp")


def _check_one_tp(plan: Plan) -> None:
    tps = {role: rp.parallel.tp for role, rp in plan.roles.items()}
    if len(set(tps.values())) > 1:
        shown = ", ".join(f"{r} tp={t}" for r, t in tps.items())
        raise SpecError(f"OpenRLHF 0.11 uses one --ds.tensor_parallel_size for every model; the "
                        f"plan has {shown}: give every role tp={tps['actor']}", key="roles")


def _trained_sharding(plan: Plan) -> dict[str, str]:
    return {r: plan.roles[r].parallel.sharding for r in ("actor", "critic")
            if r in plan.roles and plan.roles[r].parallel.dp > 1}


def _check_one_zero_stage(plan: Plan) -> None:
    trained = _trained_sharding(plan)
    if len(set(trained.values())) > 1:
        shown = ", ".join(f"{r} {s}" for r, s in trained.items())
        raise SpecError(f"OpenRLHF 0.11 uses one --ds.zero_stage for every trained model; the "
                        f"plan has {shown}: give both sharding {trained['actor']}", key="roles")


def _ring_attention(plan: Plan, job: JobSpec, translation: Translation) -> list[str]:
    """One --ds.ring_attn_size for every model, the plan's context parallelism, exchanged as
    OpenRLHF exchanges it (``context_parallel_exchange`` all_gather, one KV head per call)."""
    cps = {role: rp.parallel.cp for role, rp in plan.roles.items()}
    cp = cps["actor"]
    if len(set(cps.values())) > 1:
        shown = ", ".join(f"{r} cp={c}" for r, c in cps.items())
        translation.differ(f"OpenRLHF 0.11 uses one --ds.ring_attn_size for every model; the "
                           f"plan has {shown}", key="roles",
                           fix=f"give every role cp: {cp}", written=f"ring_attn_size {cp}")
    if cp > 1 and job.framework_profile.training.context_parallel_exchange != "all_gather":
        translation.differ("OpenRLHF's ring attention all-gathers keys and values in every "
                           "layer; the plan priced Megatron's ring", key="roles.actor.parallel.cp",
                           fix="plan the job with framework: openrlhf",
                           written=f"--ds.ring_attn_size={cp}")
    if cp == 1:
        return []
    return [f"--ds.ring_attn_size={cp}", f"--ds.ring_attn_head_stride={KV_HEADS_PER_GATHER}"]


def _deepspeed(plan: Plan, translation: Translation) -> list[str]:
    """One ZeRO stage and one AutoTP size for every model (``_check_one_tp``,
    ``_check_one_zero_stage``); frozen models sharded exactly when training is ZeRO-3."""
    tp = plan.roles["actor"].parallel.tp
    trained = _trained_sharding(plan)
    # One data-parallel rank shards nothing at any stage: ZeRO-1 then, which (unlike stage 0)
    # has the optimizer wrapper --ds.enable_sleep offloads.
    stage = ZERO_STAGE[next(iter(trained.values()), "optimizer")] or 1
    frozen = "fsdp" if stage == 3 else "none"
    for role, rp in plan.roles.items():
        if rp.parallel.ulysses > 1:
            translation.differ("OpenRLHF's sequence parallelism is ring attention "
                               "(--ds.ring_attn_size), not Ulysses; "
                               f"{role} has ulysses={rp.parallel.ulysses}",
                               key=f"roles.{role}.parallel.ulysses", fix="set ulysses: 1",
                               written="no sequence parallelism")
        if rp.parallel.offload_params or rp.parallel.offload_optimizer:
            translation.differ("OpenRLHF 0.11 does not move a model's states to host memory "
                               "between its calls (its --ds.enable_sleep offload is priced by "
                               f"the openrlhf profile); {role} has offload_params="
                               f"{rp.parallel.offload_params}, offload_optimizer="
                               f"{rp.parallel.offload_optimizer}",
                               key=f"roles.{role}.parallel.offload_params",
                               fix="set offload_params and offload_optimizer: false",
                               written="states on the GPU")
        if rp.parallel.fsdp_size:
            translation.differ("DeepSpeed ZeRO shards over every data-parallel rank (no "
                               f"hybrid sharding); {role} has FSDP groups of "
                               f"{rp.parallel.fsdp_size}", key=f"roles.{role}.parallel.fsdp_size",
                               fix="drop fsdp_size", written="ZeRO over every rank")
        if role not in ("actor", "critic") and rp.parallel.sharding != frozen \
                and rp.parallel.dp > 1:
            translation.differ(
                f"OpenRLHF 0.11 shards frozen models exactly when training is ZeRO-3 "
                f"(--ds.zero_stage={stage}); {role} has sharding {rp.parallel.sharding}",
                key=f"roles.{role}.parallel.sharding", fix=f"set sharding: {frozen}",
                written=f"sharding {frozen}")
    return [f"--ds.zero_stage={stage}", f"--ds.tensor_parallel_size={tp}"]


def _per_gpu_budget(job: JobSpec, par: ParallelConfig, tokens: int) -> int:
    """OpenRLHF's per-GPU budget for a plan's ``tokens`` (per GPU as the job's framework
    counts them): the same tokens per data shard, over OpenRLHF's tensor-parallel ranks."""
    shard = shard_budget_tokens(tokens, par, job.framework_profile.training)
    return shard // shard_budget_tokens(1, par, load_framework("openrlhf").training)


def _batching(plan: Plan, job: JobSpec, translation: Translation) -> list[str]:
    """Micro-batches by sequence count or by token budget: one --train.micro_batch_size and
    --train.max_tokens_per_gpu for the trained models, one --rollout.max_tokens_per_gpu for
    every experience pass, one --train.dynamic_batch_enable for all (the openrlhf profile's
    one_batching)."""
    actor = plan.roles["actor"].parallel
    trained = {r: plan.roles[r].parallel for r in ("actor", "critic") if r in plan.roles}
    shown = {r: (p.micro_batch_size, _per_gpu_budget(job, p, p.micro_batch_tokens))
             for r, p in trained.items()}
    if len(set(shown.values())) > 1:
        listed = ", ".join(f"{r} micro_batch_size {m}, micro_batch_tokens {t}"
                           for r, (m, t) in shown.items())
        translation.differ(f"OpenRLHF 0.11 trains every model with one --train.micro_batch_size "
                           f"and one --train.max_tokens_per_gpu; the plan has {listed}",
                           key="roles.critic.parallel.micro_batch_size",
                           fix="give the critic the actor's micro-batch",
                           written="the actor's")
    mbs, train_tokens = shown["actor"]
    dynamic = bool(train_tokens)
    forward = {r: _per_gpu_budget(job, rp.parallel, rp.parallel.infer_micro_batch_tokens)
               for r, rp in plan.roles.items()}
    wanted = forward["actor"] if dynamic and forward["actor"] else (
        _per_gpu_budget(job, actor, job.workload.infer_micro_batch_size
                        * job.workload.max_sequence_tokens) if dynamic else 0)
    if any(tokens != wanted for tokens in forward.values()):
        listed = ", ".join(f"{r} {t}" for r, t in forward.items())
        translation.differ("OpenRLHF 0.11 forms every experience pass's micro-batches one way, "
                           "by --rollout.max_tokens_per_gpu exactly when training uses a token "
                           f"budget; the plan's infer_micro_batch_tokens are {listed}",
                           key="roles.actor.parallel.infer_micro_batch_tokens",
                           fix=f"give every role infer_micro_batch_tokens: {wanted}",
                           written=str(wanted))
    out = [f"--train.micro_batch_size={mbs}"]
    if dynamic:
        out += ["--train.dynamic_batch_enable", f"--train.max_tokens_per_gpu={train_tokens}",
                f"--rollout.max_tokens_per_gpu={wanted}"]
    return out


def _priced_settings(plan: Plan, job: JobSpec, translation: Translation) -> list[str]:
    """What the price assumed beyond the layouts: recompute, unpadded (packed) sequences,
    the rollout engine's graphs and running-batch cap, gradient overlap, the KL term and
    dynamic sampling."""
    out = ["--ds.packing_samples"]  # priced at the real tokens, no padding
    recomputes = {plan.roles[r].parallel.recompute for r in ("actor", "critic")
                  if r in plan.roles}
    if "selective" in recomputes or len(recomputes) > 1:
        translation.differ("OpenRLHF 0.11 checkpoints every layer or none, for every trained "
                           f"model (--actor.gradient_checkpointing_enable); the plan has "
                           f"recompute {', '.join(sorted(recomputes))}",
                           key="roles.actor.parallel.recompute",
                           fix="give the trained models recompute full or none",
                           written="full")
        recomputes = {"full"}
    if recomputes != {"none"}:
        out.append("--actor.gradient_checkpointing_enable")
    actor = plan.roles["actor"]
    gen = actor.generation
    assert gen is not None
    if job.rollout_engine not in (None, "vllm"):
        translation.differ(f"OpenRLHF 0.11 generates with vLLM; the job's engine is "
                           f"{job.rollout_engine}", key="job.rollout_engine",
                           fix="drop rollout_engine", written="vLLM")
    if not job.rollout.cuda_graphs:
        out.append("--vllm.enforce_eager")
    default_seqs = load_framework("openrlhf").rollout.max_num_seqs
    if gen.max_num_seqs != default_seqs:
        translation.differ(f"OpenRLHF 0.11 has no max_num_seqs argument: its vLLM engines run "
                           f"{default_seqs} sequences at most; the plan has {gen.max_num_seqs}",
                           key="roles.actor.generation.max_num_seqs",
                           fix=f"set max_num_seqs: {default_seqs}", written=str(default_seqs))
    if actor.parallel.overlap_grad_reduce and actor.parallel.sharding != "fsdp":
        out.append("--ds.overlap_comm")
    term = job.kl_term
    if term == "none":
        out.append("--algo.kl.init_coef=0")  # no reference model (train_ppo_ray.py train())
    elif term == "loss":
        out += ["--algo.kl.use_loss", "--algo.kl.estimator=k3"]
    if job.workload.generates_more_than_it_trains:
        out.append("--algo.dynamic_filtering_enable")
    return out


def _check_trainer(plan: Plan, job: JobSpec) -> None:
    if job.algorithm not in ESTIMATOR:
        raise SpecError(f"OpenRLHF 0.11 has no {job.algorithm} trainer (estimators: gae and "
                        "group baselines; no ReMax greedy baseline, no cost model)",
                        key="algorithm")


def _check_experts(plan: Plan, job: JobSpec) -> None:
    experts = [role for role in job.gpu_roles if plan.roles[role].parallel.ep > 1]
    if experts:
        # DeepSpeed trains a mixture of experts as it trains a dense model (ZeRO shards every
        # expert; profiles/frameworks/openrlhf.yaml), with no expert-parallel groups.
        raise SpecError(f"OpenRLHF 0.11 (DeepSpeed) has no expert parallelism: set "
                        f"ep: 1 for {experts[0]}, or export the plan to verl",
                        key=f"roles.{experts[0]}.parallel.ep")


def _node_size(plan: Plan, job: JobSpec) -> int:
    groups = {s.node_group for s in plan.located_sets()}
    if len(groups) > 1:
        raise SpecError("OpenRLHF 0.11 sizes every group in nodes of one kind; the plan uses "
                        "several node groups", key="sets")
    return job.cluster.pool_of(groups.pop()).group.gpus_per_node


def _check_rollout(plan: Plan, job: JobSpec) -> None:
    gen = plan.roles["actor"].generation
    assert gen is not None
    if gen.pp > 1:
        raise SpecError(f"OpenRLHF 0.11's vLLM engines have no pipeline parallelism "
                        f"(generation pp={gen.pp})", key="roles.actor.generation.pp")


def _check_batches(plan: Plan, job: JobSpec) -> None:
    work = job.workload
    if work.sequences_per_iteration % work.mini_batches_per_epoch:
        raise SpecError(f"{work.sequences_per_iteration} sequences do not split into "
                        f"{work.mini_batches_per_epoch} equal mini-batches (--train.batch_size)",
                        key="job.workload.mini_batches_per_epoch")


def _check_reward(plan: Plan, job: JobSpec) -> None:
    if job.models.get("reward") == RULE and job.reward_function is None:
        raise SpecError("OpenRLHF 0.11 scores with a reward model, a remote URL or a Python "
                        "reward file; this job's rule reward names no file (set the job's "
                        "reward_function: FILE.py)", key="job.models.reward")


def all_problems(job: JobSpec, checks: list[Callable[[], Any]]) -> list[Any]:
    """Run every check (a refusal does not stop the others) and return their results; raise
    one SpecError, in one line, naming every problem with its key, when any refused. A plan
    made under another framework is fixed at once by planning it under OpenRLHF's space."""
    problems: list[SpecError] = []
    results = []
    for check in checks:
        try:
            results.append(check())
        except SpecError as exc:
            problems.append(exc)
            results.append(None)
    if not problems:
        return results
    layout = any(not p.key.startswith("job.") and p.key != "algorithm" for p in problems)
    replan = "" if job.framework_profile.name == "openrlhf" or not layout else \
        " (or plan the job with framework: openrlhf, whose search leaves these out)"
    if len(problems) == 1:
        raise SpecError(f"{problems[0].problem}{replan}", key=problems[0].key)
    listed = "; ".join(f"({i}) {p.key}: {p.problem}" for i, p in enumerate(problems, 1))
    raise SpecError(f"{len(problems)} problems: {listed}{replan}", key=problems[0].key)


def openrlhf_args(plan: Plan, job: JobSpec, translation: Translation | None = None
                  ) -> list[str]:
    """The arguments of ``train_ppo_ray`` for ``plan``; SpecError naming every part of the
    plan or job that OpenRLHF 0.11 cannot express (a plan made for another framework is
    translated: ``translation`` collects the differences)."""
    translation = translation or translation_for(job, "openrlhf")
    _, _, flags, gpn, *_ = all_problems(job, [
        lambda: _check_trainer(plan, job), lambda: _check_experts(plan, job),
        lambda: _placement_flags(plan, job), lambda: _node_size(plan, job),
        lambda: _check_rollout(plan, job), lambda: _check_pipeline(plan),
        lambda: _check_one_tp(plan), lambda: _check_one_zero_stage(plan),
        lambda: _check_batches(plan, job), lambda: _check_reward(plan, job)])
    deepspeed = _deepspeed(plan, translation)
    work = job.workload
    actor = plan.roles["actor"]
    gen = actor.generation
    assert gen is not None
    out: list[str] = []
    for role in job.gpu_roles:
        nodes, per_node = nodes_of(plan.set_of(role).gpus, gpn)
        out += [f"--{role}.num_nodes={nodes}", f"--{role}.num_gpus_per_node={per_node}"]
    out += flags
    out += deepspeed
    out += _ring_attention(plan, job, translation)
    sequences = work.sequences_per_iteration
    generating_gpus = plan.rollout.gpus if plan.rollout is not None else plan.set_of("actor").gpus
    out += [
        f"--algo.advantage.estimator={ESTIMATOR[job.algorithm]}",
        f"--actor.model_name_or_path={model_path(job, 'actor')}",
        f"--rollout.batch_size={work.prompts_per_iteration}",
        f"--rollout.n_samples_per_prompt={work.samples_per_prompt}",
        f"--train.batch_size={sequences // work.mini_batches_per_epoch}",
        f"--train.max_epochs={work.ppo_epochs}",
        f"--rollout.micro_batch_size={work.infer_micro_batch_size}",
        f"--data.max_len={work.max_sequence_tokens}",
        f"--rollout.max_new_tokens={work.response_length.max_tokens}",
        f"--vllm.num_engines={generating_gpus // gen.tp}",
        f"--vllm.tensor_parallel_size={gen.tp}",
        f"--vllm.gpu_memory_utilization={gen.memory_utilization:g}",
    ]
    out += _batching(plan, job, translation)
    out += _priced_settings(plan, job, translation)
    if "critic" in plan.roles:
        out.append(f"--critic.model_name_or_path={model_path(job, 'critic')}")
    if job.models.get("reward") == RULE:
        assert job.reward_function is not None
        out.append(f"--reward.remote_url={job.reward_function.path}")
    else:
        out.append(f"--reward.model_name_or_path={model_path(job, 'reward')}")
    if plan.rollout is None:
        if gen.free_cache is False:
            translation.differ("OpenRLHF's colocated engines sleep after every generation "
                               "(--vllm.enable_sleep); the plan keeps the engine's KV cache",
                               key="roles.actor.generation.free_cache",
                               fix="drop free_cache: false", written="--vllm.enable_sleep")
        out += ["--vllm.enable_sleep", "--ds.enable_sleep"]
    else:
        out += ["--train.async_enable", f"--train.async_queue_size={plan.max_staleness}"]
        if plan.partial_rollout:
            out.append("--train.partial_rollout_enable")
    return out


def openrlhf_files(plan: Plan, job: JobSpec, *, plan_name: str = "plan.json",
                   translation: Translation | None = None) -> dict[str, str]:
    translation = translation or translation_for(job, "openrlhf")
    args = openrlhf_args(plan, job, translation)
    notes = notes_comment(job, translation)
    script = f"""#!/usr/bin/env bash
# Runs {plan_name} ({plan.strategy or 'plan'}: {plan.describe()}, mode {plan.mode_label()})
# with OpenRLHF {OPENRLHF_VERSION}. Written by `hybridflow export --to openrlhf`.
{notes}# Extra arguments after the script's name come last and win, e.g.
#   bash {SCRIPT_FILE} --actor.model_name_or_path=/ckpt/actor --data.prompt_dataset=/data/prompts
# Start Ray on the nodes first (`ray start`); OpenRLHF's placement groups land on them.
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
mapfile -t args < <(grep -v '^[[:space:]]*$' "$here/{ARGS_FILE}")
exec python3 -m {MODULE} "${{args[@]}}" "$@"
"""
    return {ARGS_FILE: "\n".join(args) + "\n", SCRIPT_FILE: script}


# ----- reading an export back -----


def parse_openrlhf_args(text: str) -> dict[str, str | bool]:
    """'--key=value' -> {key: value}; a bare flag -> {key: True}."""
    values: dict[str, str | bool] = {}
    for line in read_argument_lines(text):
        words = shlex.split(line)
        if len(words) != 1 or not words[0].startswith("--"):
            raise SpecError(f"not one argument: {line!r}", source=ARGS_FILE)
        key, sep, value = words[0][2:].partition("=")
        values[key] = value if sep else True
    return values


def openrlhf_layout(text: str, roles: tuple[str, ...]) -> Layout:
    """The placement and parallel sizes an exported OpenRLHF launch runs (``roles``: the
    GPU roles of the job), read only from the exported arguments."""
    v = parse_openrlhf_args(text)

    def gpus(role: str) -> int:
        return int(v[f"{role}.num_nodes"]) * int(v[f"{role}.num_gpus_per_node"])

    is_async = bool(v.get("train.async_enable"))
    if v.get("train.colocate_all"):
        groups = [frozenset(roles)]
    else:
        groups = []
        placed: set[str] = set()
        for pair, flag in PAIRS.items():
            if v.get(flag[2:]) and pair <= set(roles):
                groups.append(pair)
                placed |= pair
        groups += [frozenset({r}) for r in roles if r not in placed]
    sets = frozenset((g, gpus(next(iter(sorted(g))))) for g in groups)
    tp = int(v["ds.tensor_parallel_size"])
    parallel = tuple(sorted((r, (tp, 1, gpus(r) // tp)) for r in roles))
    gen_tp = int(v["vllm.tensor_parallel_size"])
    return Layout(
        sets=sets, parallel=parallel, generation=(gen_tp, 1),
        rollout_gpus=int(v["vllm.num_engines"]) * gen_tp if is_async else 0,
        mode=("one_step_off" if int(v["train.async_queue_size"]) == 1
              and not v.get("train.partial_rollout_enable") else "async") if is_async else "sync",
        max_staleness=int(v["train.async_queue_size"]) if is_async else 0,
        partial_rollout=bool(v.get("train.partial_rollout_enable")))
