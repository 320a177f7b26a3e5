"""Planning asynchronous modes: split the cluster into a trainer and a rollout set and pick
the split, the trainer's placement and the rollout's generation layout.

The two sides meet only through the steady-state step, max(G + S, T_s)
(``simulator.asynchronous.steady_step_seconds``): the rollout's generation per batch G, the
weight sync S and the trainer's makespan T_s. So for each rollout size the trainer side is the
ordinary search (Algorithm 1) on the remaining GPUs with the actor's generation priced
elsewhere (``JobSpec.generation_elsewhere``), the rollout side a sweep over its generation
tensor-parallel sizes, and the candidates are ranked by the simulated steady-state step.

Rollout sizes: whole nodes on a multi-node cluster (the trainer keeps whole nodes, so its
sets keep the node rules of a synchronous plan), powers of two below the node size on one
node. A mixed cluster is not split here (one line says so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.search import Candidate, Search, SearchOptions, placement_refusal
from planner.space import powers_of_two
from profiles.datafile import SpecError
from simulator.asynchronous import steady_step_seconds
from simulator.plan import Plan, RolePlan, RolloutSet, job_as_planned
from simulator.predict import estimate_plan
from simulator.specs.asynchrony import Mode
from simulator.specs.job import JobSpec
from simulator.specs.parallel import GenerationConfig

MAX_ROLLOUT_SIZES = 8
"""Up to this many node counts, every rollout size is tried; beyond, the power-of-two splits
(``rollout_sizes``: at most eight)."""
TRAINER_FINALISTS = 3
"""Trainer plans per rollout size carried to the combined ranking (the search's best few:
their sync costs differ with the actor's layout)."""


@dataclass(frozen=True, slots=True)
class AsyncCandidate:
    """One asynchronous plan with its closed-form steady-state step."""

    plan: Plan
    step_seconds: float
    rollout_gpus: int


def rollout_sizes(total_gpus: int, gpus_per_node: int) -> list[int]:
    """GPU counts the rollout set may take (leaving the trainer at least one GPU): on one node
    the powers of two below it; on several, whole nodes: every count on a small cluster, and
    on a large one the splits in which the rollout set or the trainer has a power of two of
    nodes, from 1/16 of them up. Pipeline and expert-parallel layouts of a large model need
    such trainer sizes (NeMo-RL's one-step-off Qwen3-235B run splits 256 H100s 128 + 128;
    the geometric spread of node counts used before never tried a 16-node trainer on 32
    nodes)."""
    if total_gpus <= gpus_per_node:
        return [r for r in powers_of_two(total_gpus - 1) if total_gpus - r >= 1]
    nodes = total_gpus // gpus_per_node
    counts = set(range(1, nodes))
    if len(counts) > MAX_ROLLOUT_SIZES:
        # Shares from 1/16 of the nodes up, either side a power of two: at most eight sizes
        # (every node count up to 2,000 checked).
        sides = [p for p in powers_of_two(nodes) if p * 16 >= nodes and p < nodes]
        counts = set(sides) | {nodes - p for p in sides}
    return [c * gpus_per_node for c in sorted(c for c in counts if 1 <= c < nodes)]


DEDICATED_ROLLOUT_UTILIZATION = 0.9
"""gpu_memory_utilization also tried on a rollout set of its own: its engine shares the GPUs
with no training state, so vLLM's own default applies (EngineArgs gpu_memory_utilization
0.9, vLLM docs "Engine Arguments"); the framework defaults (verl 0.5, NeMo-RL 0.6) are set for
colocated engines. A 235B model at TP 8 needs 59 GB of an 80 GB H100 for its weights alone,
more than 0.6 of it."""


def rollout_layouts(job: JobSpec, gpus: int,
                    options: SearchOptions | None = None) -> list[GenerationConfig]:
    """Generation layouts of the rollout set: tensor-parallel sizes within a node that divide
    the heads and the set, at the job's engine settings (the memory share pinned, else the
    framework's default, a dedicated engine's and the options')."""
    model = job.model("actor")
    gpn = job.cluster.gpus_per_node
    pin = job.parallel.get("actor")
    seqs, utilization = job.rollout_defaults()
    utilizations = (utilization,) if pin and pin.gpu_memory_utilization else tuple(sorted(
        {utilization, DEDICATED_ROLLOUT_UTILIZATION,
         *(options.space.memory_utilization if options else ())}))
    out = []
    for tp in powers_of_two(min(gpn, gpus)):
        if model.heads % tp or gpus % tp or (pin and pin.generation_tp not in (None, tp)):
            continue
        out += [GenerationConfig(tp=tp, pp=1, max_num_seqs=seqs, memory_utilization=share)
                for share in utilizations]
    return out


@dataclass(frozen=True, slots=True)
class TrainerSide:
    """The trainer's best placements beside a rollout set of ``rollout_gpus``."""

    rollout_gpus: int
    job: JobSpec
    """The job on the trainer's GPUs (generation elsewhere)."""
    ranking: tuple[Candidate, ...]


def trainer_sides(job: JobSpec, options: SearchOptions | None = None) -> list[TrainerSide]:
    """For each rollout size, the trainer's search on the GPUs left. It does not depend on the
    asynchronous mode (only the plan built around it does), so ``asynchronous_modes`` runs it once
    for one_step_off and async."""
    if not job.cluster.is_homogeneous:
        raise SpecError("asynchronous modes are planned on one node group; plan the mixed "
                        "cluster with mode: sync", key="mode")
    options = options or SearchOptions()
    total = job.cluster.total_gpus
    out = []
    shared: Search | None = None
    for rollout_gpus in rollout_sizes(total, job.cluster.gpus_per_node):
        trainer_cluster = job.cluster.with_total_gpus(total - rollout_gpus)
        trainer_job = replace(job, cluster=trainer_cluster, generation_elsewhere=True)
        trainer_options = options
        if options.placements:
            # Placements given for the synchronous search that the framework cannot set up
            # beside a rollout set are left out here.
            study = options.space.backend == "simulated"
            kept = tuple(p for p in options.placements
                         if placement_refusal(trainer_job, p, study=study) is None)
            if not kept:
                continue
            trainer_options = replace(options, placements=kept)
        # The trainer searches differ only in the cluster's size: each model or set on g GPUs
        # is costed once for all of them.
        search = Search(trainer_job, trainer_options, caches_from=shared)
        shared = shared or search
        result = search.run(top_k=TRAINER_FINALISTS)
        out.append(TrainerSide(rollout_gpus=rollout_gpus, job=trainer_job,
                               ranking=tuple(result.ranking)))
    return out


def search_async(job: JobSpec, mode: Mode, staleness: int,
                 options: SearchOptions | None = None,
                 top_k: int = 5, trainers: list[TrainerSide] | None = None
                 ) -> list[AsyncCandidate]:
    """The best ``mode`` plans (staleness ``staleness``) by steady-state step, best first
    (``trainers``: ``trainer_sides`` already searched for this job and options)."""
    if trainers is None:
        trainers = trainer_sides(job, options)
    partial_rollout = job.partial_rollout and mode == "async"
    total = job.cluster.total_gpus
    gpn = job.cluster.gpus_per_node
    found: list[AsyncCandidate] = []
    for side in trainers:
        rollout_gpus, trainer_job = side.rollout_gpus, side.job
        layouts = rollout_layouts(job, rollout_gpus, options)
        whole_nodes = job.framework_profile.space.whole_node_split and total > gpn
        for candidate in side.ranking:
            trainer_plan = candidate.to_plan(trainer_job)
            if whole_nodes and trainer_plan.total_gpus % gpn:
                continue
            for gen in layouts:
                roles = dict(trainer_plan.roles)
                actor = roles["actor"]
                roles["actor"] = RolePlan(parallel=actor.parallel, generation=gen,
                                          training_backend=actor.training_backend)
                plan = Plan(algorithm=job.algorithm, sets=trainer_plan.sets, roles=roles,
                            strategy=mode, mode=mode, max_staleness=staleness,
                            partial_rollout=partial_rollout,
                            rollout=RolloutSet(gpus=rollout_gpus,
                                               first_gpu=total - rollout_gpus))
                try:
                    plan.validate(job)
                except SpecError:
                    continue
                planned = job_as_planned(job, plan)
                estimate = estimate_plan(planned, plan)
                if not estimate.feasible:
                    continue
                found.append(AsyncCandidate(plan=plan,
                                            step_seconds=steady_step_seconds(planned, estimate),
                                            rollout_gpus=rollout_gpus))
    found.sort(key=lambda c: (c.step_seconds, c.rollout_gpus, c.plan.describe()))
    return found[:top_k]
