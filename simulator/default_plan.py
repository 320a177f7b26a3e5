"""Standard plans built without a search: the default colocate plan of ``simulate``.

The planner searches parallel configs properly; this module gives the simulator a sensible
plan when none is given: every model on every GPU with one tensor-parallel size for all (data
parallelism over the rest, optimizer states sharded across data-parallel ranks) and the actor
generating with a tensor-parallel size that divides its training one; of those few candidates,
the fastest that fits.
"""

from __future__ import annotations

from profiles.datafile import SpecError
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import JobSpec
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.workload import DEFAULT_TRAIN_MICRO_BATCH_SIZE


def _powers_of_two_up_to(limit: int) -> list[int]:
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out


def default_ep(model: ModelSpec, stage_ranks: int, gpus_per_node: int) -> int:
    """The default expert parallel size of an MoE model: the largest power of two that divides
    the experts and the stage's tp * dp ranks, within one node (its all-to-all stays on
    NVLink); 1 for a dense model."""
    if model.moe is None:
        return 1
    ep = 1
    while (ep * 2 <= gpus_per_node and model.moe.experts % (ep * 2) == 0
           and stage_ranks % (ep * 2) == 0):
        ep *= 2
    return ep


def _role_plan(job: JobSpec, role: str, gpus: int, tp: int, gen_tp: int) -> RolePlan:
    trained = role in job.dataflow.trained_roles
    pin = job.parallel.get(role)
    pinned = pin.set_fields() if pin else {}
    tp = pinned.get("tp", tp)
    # Virtual stages need a pipeline: with only vpp pinned, try the shortest one.
    pp = pinned.get("pp", 2 if pinned.get("vpp", 1) > 1 else 1)
    overlap_grad, overlap_param = job.overlap_for(role)
    dp = max(1, gpus // (tp * pp))
    sharding = pinned.get("sharding", "fsdp" if pinned.get("fsdp_size") else
                          "optimizer" if trained and gpus > tp * pp else "none")
    # Pinned FSDP groups and Ulysses sizes where this GPU count divides into them.
    group = pinned.get("fsdp_size", 0)
    group = group if sharding == "fsdp" and 1 < group < dp and dp % group == 0 else 0
    ulysses = pinned.get("ulysses", 1)
    ulysses = ulysses if pp == 1 and dp % ulysses == 0 else 1
    par = ParallelConfig(
        ep=pinned.get("ep", 1 if pinned.get("sharding") == "fsdp" else
                      default_ep(job.model(role), tp * dp // pinned.get("etp", 1),
                                 job.cluster.gpus_per_node)),
        etp=pinned.get("etp", 1), moe_dispatcher=pinned.get("moe_dispatcher", "alltoall"),
        overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param,
        tp=tp, pp=pp, dp=max(1, gpus // (tp * pp)), vpp=pinned.get("vpp", 1),
        sharding=sharding, fsdp_size=group, ulysses=ulysses,
        recompute=pinned.get("recompute", "selective"),
        sequence_parallel=pinned.get("sequence_parallel", True),
        micro_batch_size=pinned.get("micro_batch_size", (
            job.workload.train_micro_batch_size or DEFAULT_TRAIN_MICRO_BATCH_SIZE)
            if trained else job.workload.infer_micro_batch_size))
    generation = None
    if "generate" in job.dataflow.operations_of(role):
        max_num_seqs, utilization = job.rollout_defaults()
        generation = GenerationConfig(tp=pinned.get("generation_tp", min(gen_tp, tp)),
                                      pp=pinned.get("generation_pp", 1),
                                      max_num_seqs=max_num_seqs,
                                      memory_utilization=utilization,
                                      ep=pinned.get("generation_ep", 1),
                                      free_cache=pinned.get("free_cache"))
    return RolePlan(parallel=par, generation=generation)


def colocate_plan(job: JobSpec) -> Plan:
    """All models on all GPUs (on a mixed cluster: on the pool with the most GPUs); among tp /
    generation-tp choices (powers of two within a node), the one with the shortest simulated
    iteration (the first candidate if none fits)."""
    from simulator.engine import simulate

    pool = max(job.cluster.pools(), key=lambda p: (p.gpus, -p.index))
    gpus = pool.gpus
    gpus_per_node = pool.group.gpus_per_node
    view = job.on_pool(pool)
    roles = job.gpu_roles
    tps = [t for t in _powers_of_two_up_to(min(gpus_per_node, gpus)) if gpus % t == 0]
    best: tuple[float, Plan] | None = None
    first: Plan | None = None
    rejection: SpecError | None = None
    for tp in tps:
        if any(job.model(r).heads % tp for r in roles):
            continue
        for gen_tp in [t for t in tps if t <= tp]:
            try:
                plan = Plan(algorithm=job.algorithm, strategy="colocate",
                            sets=(ColocatedSet(roles=roles, gpus=gpus, first_gpu=0,
                                               node_group=pool.index),),
                            roles={r: _role_plan(view, r, gpus, tp, gen_tp) for r in roles})
                plan.validate(job)
                result = simulate(job, plan)
            except SpecError as exc:
                rejection = rejection or exc
                continue  # a pinned setting rules this candidate out
            first = first or plan
            if result.feasible and (best is None or result.iteration_seconds < best[0]):
                best = (result.iteration_seconds, plan)
    if best is not None:
        return best[1]
    if first is not None:
        return first
    why = f": {rejection.key}: {rejection.problem}" if rejection and rejection.key else (
        f": {rejection.problem}" if rejection else "")
    raise SpecError(f"no plan colocating every model on all {gpus} GPUs satisfies the job's "
                    f"settings{why}", key="parallel" if job.parallel else "models")
