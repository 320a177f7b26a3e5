"""``hybridflow plan``: search the best mapping, evaluate the standard strategies, simulate the
finalists, and explain an infeasible job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.background import Background
from planner.confidence import PlanConfidence
from planner.objective import Ranking, plan_dollars_per_second, priced
from planner.search import (
    Candidate,
    Placement,
    Search,
    SearchOptions,
    SearchStats,
    placement_refusal,
)
from planner.space import SpaceOptions, set_sizes
from profiles.datafile import SpecError
from simulator.costs.memory import GIB, MemoryBreakdown
from simulator.engine import SimulationResult, simulate_estimated
from simulator.plan import Plan, job_as_planned
from simulator.predict import PlanEstimate, estimate_plan, role_state
from simulator.specs.asynchrony import comparison_modes
from simulator.specs.job import JobSpec
from simulator.specs.parallel import ParallelConfig

STRATEGIES = ("colocate", "standalone", "split")
"""The standard placements every plan is compared with."""


def standard_placement(job: JobSpec, name: str) -> Placement | None:
    """colocate: all models on all GPUs; standalone: each model its own GPUs (a reference the
    framework swaps into the actor's model rides with the actor); split: actor+ref |
    critic+reward (the cost model joins the critic). None if not applicable."""
    roles = job.gpu_roles
    if name == "colocate":
        return (roles,)
    if name == "standalone":
        if job.reference_on_host:
            return tuple(("actor", "ref") if r == "actor" else (r,) for r in roles
                         if r != "ref")
        return tuple((r,) for r in roles)
    first = tuple(r for r in roles if r in ("actor", "ref"))
    second = tuple(r for r in roles if r not in first)
    if not second:
        return None
    return (first, second)


@dataclass(frozen=True, slots=True)
class Evaluated:
    """A plan with its prediction and event simulation."""

    candidate: Candidate | None
    """The search candidate it came from (None for a plan read from a file)."""
    plan: Plan
    estimate: PlanEstimate
    simulation: SimulationResult
    dollars_per_iteration: float | None = None
    """What one iteration costs on the cluster's prices (None when it has none)."""

    @property
    def iteration_seconds(self) -> float:
        return self.simulation.iteration_seconds

    @property
    def tokens_per_dollar(self) -> float | None:
        if not self.dollars_per_iteration:
            return None
        return self.estimate.tokens_per_iteration / self.dollars_per_iteration

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.simulation.throughput_tokens_per_s


@dataclass(frozen=True, slots=True)
class StrategyOutcome:
    name: str
    placement: str
    result: Evaluated | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.result is not None


@dataclass(frozen=True, slots=True)
class ModeOutcome:
    """The best plan of one mode (sync-colocate, sync, one_step_off, async), side by side."""

    name: str
    """sync-colocate, sync, one_step_off or async."""
    staleness: int
    allowed: bool
    """Whether the job lets the planner choose this mode."""
    result: Evaluated | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlanningResult:
    job: JobSpec
    best: Evaluated | None
    ranking: tuple[Evaluated, ...]
    strategies: tuple[StrategyOutcome, ...]
    stats: SearchStats
    search_seconds: float
    infeasible_reason: str = ""
    modes: tuple[ModeOutcome, ...] = ()
    """The best plan per mode (empty on a mixed cluster or for a given plan)."""
    confidence: PlanConfidence | None = None
    """How sure the planner is of its winner under the model's validated error (None when
    there is no other plan to compare it with)."""


def evaluate(job: JobSpec, candidate: Candidate | None, strategy: str, iterations: int = 1,
             plan: Plan | None = None, ranking: Ranking | None = None) -> Evaluated:
    """Turn a search candidate (or a given ``plan``) into a plan with its event simulation
    and, on a priced cluster, its dollars per iteration (paying as ``ranking`` says)."""
    if plan is None:
        assert candidate is not None
        plan = candidate.to_plan(job, strategy=strategy)
    else:
        plan = replace(plan, strategy=strategy)
    plan.validate(job)
    job = job_as_planned(job, plan)
    estimate = estimate_plan(job, plan)
    simulation = simulate_estimated(job, plan, estimate, iterations=iterations)
    predicted = {
        "iteration_seconds": simulation.iteration_seconds,
        "throughput_tokens_per_s": simulation.throughput_tokens_per_s,
        "peak_memory_bytes_per_gpu": simulation.peak_memory_bytes_per_gpu,
    }
    dollars = None
    if priced(job):
        pay_for = (ranking or Ranking()).pay_for
        rate = plan_dollars_per_second(job, [(s.node_group, s.gpus)
                                             for s in plan.located_sets()], pay_for)
        dollars = simulation.iteration_seconds * rate
        predicted["dollars_per_iteration"] = dollars
        predicted["paying_for"] = pay_for
        if dollars > 0:
            predicted["tokens_per_dollar"] = estimate.tokens_per_iteration / dollars
    plan = replace(plan, predicted=predicted, job=job.to_value())
    return Evaluated(candidate=candidate, plan=plan, estimate=estimate, simulation=simulation,
                     dollars_per_iteration=dollars)


def plan_job(job: JobSpec, options: SearchOptions | None = None, *,
             pinned: Placement | None = None, given: Plan | None = None,
             progress: Callable[[int, int, SearchStats], None] | None = None) -> PlanningResult:
    """The whole planning run: search (or a pinned placement, or a ``given`` plan to
    evaluate), the standard strategies, the finalists simulated, why not if none fits, and
    how sure the planner is of its winner."""
    options = options or SearchOptions()
    return with_confidence(search_plans(job, options, pinned=pinned, given=given,
                                        progress=progress), options.ranking)


def search_plans(job: JobSpec, options: SearchOptions, *, pinned: Placement | None = None,
                 given: Plan | None = None,
                 progress: Callable[[int, int, SearchStats], None] | None = None
                 ) -> PlanningResult:
    """``plan_job`` without the confidence (``with_confidence`` adds it)."""
    compared = given is None and job.cluster.is_homogeneous
    # The asynchronous modes' searches share nothing with the synchronous one: they run
    # beside it where a second core is free (inline, after it, where not).
    with Background(asynchronous_modes, job, options, fork=None if compared else False) \
            as asynchronous:
        return _plan(job, options, pinned, given, progress,
                     asynchronous if compared else None)


def with_confidence(result: PlanningResult, objective: Ranking) -> PlanningResult:
    """``result`` with how sure the planner is of its winner (``plan_confidence``)."""
    return replace(result, confidence=plan_confidence(result.job, result.ranking,
                                                      result.modes, objective))


def _plan(job: JobSpec, options: SearchOptions, pinned: Placement | None, given: Plan | None,
          progress: Callable[[int, int, SearchStats], None] | None,
          asynchronous: Background[list[ModeOutcome]] | None) -> PlanningResult:
    search = Search(job, options, progress)
    objective = options.ranking
    if given is not None:
        ranking: tuple[Evaluated, ...] = (evaluate(job, None, "given", plan=given,
                                                   ranking=objective),)
        if not ranking[0].simulation.feasible:
            ranking = ()
    else:
        result = search.run(placements_to_try=(pinned,) if pinned else None)
        strategy_name = "pinned" if pinned else "searched"
        ranking = tuple(evaluate(job, c, strategy_name, ranking=objective)
                        for c in result.ranking)
    strategies = []
    for name in STRATEGIES:
        placement = standard_placement(job, name)
        if placement is None:
            strategies.append(StrategyOutcome(name=name, placement="", result=None,
                                              reason="not applicable: no second set"))
            continue
        label = "|".join(",".join(g) for g in placement)
        refusal = placement_refusal(job, placement, study=search.study)
        if refusal is not None:
            strategies.append(StrategyOutcome(
                name=name, placement=label, result=None,
                reason=f"not in {job.framework_profile.name}'s space: its configuration "
                       "cannot place it"))
            continue
        if len(placement) > job.cluster.total_gpus:
            strategies.append(StrategyOutcome(
                name=name, placement=label, result=None,
                reason=f"needs at least {len(placement)} GPUs (one per set)"))
            continue
        found = search.run(placements_to_try=(placement,), top_k=1)
        if found.best is None:
            why = f"does not fit on {job.cluster.total_gpus} GPUs in any allocation"
            if objective.objective == "cost-at-deadline":
                why = (f"no allocation fits and meets the deadline of "
                       f"{objective.deadline_seconds_per_iteration:g} s per iteration")
            strategies.append(StrategyOutcome(name=name, placement=label, result=None,
                                              reason=why))
        else:
            strategies.append(StrategyOutcome(
                name=name, placement=label,
                result=evaluate(job, found.best, name, ranking=objective)))
    modes: tuple[ModeOutcome, ...] = ()
    if asynchronous is not None:
        colocate = next((o for o in strategies if o.name == "colocate"), None)
        modes = compare_modes(job, ranking[0] if ranking else None,
                              colocate.result if colocate else None, asynchronous.result())
        ranking = choose_ranking(job, ranking, modes, objective)
    best = ranking[0] if ranking else None
    if best is None and given is not None:
        estimate = estimate_plan(job_as_planned(job, given), given)
        reason = "the given plan does not fit: " + "; ".join(estimate.reasons)
    elif best is None and objective.objective == "cost-at-deadline":
        reason = missed_deadline(job, options)
    else:
        reason = "" if best else (_other_modes_fit(job, modes) or explain_infeasible(job, search))
    return PlanningResult(job=job, best=best, ranking=ranking, strategies=tuple(strategies),
                          stats=search.stats, search_seconds=search.stats.seconds,
                          infeasible_reason=reason, modes=modes)


def _other_modes_fit(job: JobSpec, modes: tuple[ModeOutcome, ...]) -> str:
    """When no plan of the modes the job allows fits but another mode's does, say so (the
    models fit the cluster: their memory is not the reason)."""
    fitting = [m for m in modes if m.result is not None and not m.allowed]
    if not fitting:
        return ""
    refused = "; ".join(f"{m.name}: {m.reason}" for m in modes if m.allowed and m.result is None)
    best = min(fitting, key=lambda m: m.result.iteration_seconds)  # type: ignore[union-attr]
    return (f"no plan of the mode the job allows fits ({refused or job.mode}); "
            f"{best.name} fits at {best.result.iteration_seconds:.2f} s per iteration: "  # type: ignore[union-attr]
            "set mode: auto to let the planner choose it")


def plan_confidence(job: JobSpec, ranking: tuple[Evaluated, ...],
                    modes: tuple[ModeOutcome, ...], objective: Ranking) -> PlanConfidence | None:
    """The winner re-ranked against the other finalists (the ranking, then each mode's best
    plan; one entry per distinct plan) under the model's validated error."""
    from planner.confidence import (
        Finalist,
        confidence,
        critical_path_shares,
        validated_error_model,
    )

    if not ranking:
        return None
    by_cost = objective.objective != "throughput" and ranking[0].dollars_per_iteration is not None
    finalists: dict[str, Finalist] = {}
    entries = [(e, True) for e in ranking] + \
        [(m.result, m.allowed) for m in modes if m.result is not None]
    for evaluated, allowed in entries:
        # The layout alone (describe() ends with the mode: "(one_step_off)", "(async
        # (staleness 1))").
        label = evaluated.plan.describe(job)
        if evaluated.plan.mode != "sync":
            label = label.rsplit(f" ({evaluated.plan.mode}", 1)[0]
        value = evaluated.dollars_per_iteration if by_cost else evaluated.iteration_seconds
        same = finalists.get(label)
        if same is not None and evaluated.plan.mode in same.mode.split("/"):
            continue  # the same plan again (sync-colocate is the searched sync plan)
        if same is not None and same.value == value:
            # One layout in two modes at the same price (one_step_off and async at
            # staleness 1): one finalist, both modes.
            finalists[label] = replace(same, mode=f"{same.mode}/{evaluated.plan.mode}",
                                       allowed=same.allowed or allowed)
            continue
        if same is not None:
            label = f"{evaluated.plan.mode}: {label}"
        finalists[label] = Finalist(
            label=label, mode=evaluated.plan.mode, value=value or 0.0, allowed=allowed,
            shares=critical_path_shares(evaluated.simulation.timeline))
    try:
        model = validated_error_model()
    except SpecError:
        # A profile on HYBRIDFLOW_PROFILE_PATH that breaks a validation case: the plan
        # stands, without its confidence (`hybridflow validate` names the problem).
        return None
    return confidence(list(finalists.values()), model, unit="$" if by_cost else "s")


def compare_modes(job: JobSpec, best_sync: Evaluated | None, colocate: Evaluated | None,
                  asynchronous: list[ModeOutcome]) -> tuple[ModeOutcome, ...]:
    """The best plan of each mode side by side: sync-colocate (all models on all GPUs), the
    searched sync plan, then the ``asynchronous`` modes' (``asynchronous_modes``)."""
    allowed = {mode for mode, _ in job.allowed_modes}
    return (ModeOutcome(name="sync-colocate", staleness=0, allowed="sync" in allowed,
                        result=colocate, reason="" if colocate else "does not fit"),
            ModeOutcome(name="sync", staleness=0, allowed="sync" in allowed, result=best_sync,
                        reason="" if best_sync else "no synchronous plan fits"),
            *asynchronous)


def asynchronous_modes(job: JobSpec, options: SearchOptions) -> list[ModeOutcome]:
    """one_step_off and async (the job's staleness bound, or 1): each mode's best plan on the
    best split into trainer and rollout GPUs (none when the actor is not trained)."""
    from planner.asynchronous import search_async, trainer_sides

    allowed = {mode for mode, _ in job.allowed_modes}
    out = []
    trainers = None  # the trainer's searches, shared by one_step_off and async
    for mode, staleness in comparison_modes(job.mode, job.max_staleness):
        if mode == "sync":
            continue
        if "actor" not in job.dataflow.trained_roles:
            continue
        if trainers is None:
            trainers = trainer_sides(job, options)
        found = search_async(job, mode, staleness, options, top_k=1, trainers=trainers)
        result = evaluate(job, None, mode, plan=found[0].plan, ranking=options.ranking) \
            if found else None
        out.append(ModeOutcome(
            name=mode, staleness=staleness, allowed=mode in allowed, result=result,
            reason="" if result else "no split into trainer and rollout GPUs fits"))
    return out


def choose_ranking(job: JobSpec, ranking: tuple[Evaluated, ...], modes: tuple[ModeOutcome, ...],
                   objective: Ranking) -> tuple[Evaluated, ...]:
    """The ranking among the modes the job allows: the synchronous search's plans, and the best
    plan of each allowed asynchronous mode, by the objective's value per iteration."""
    allowed = {mode for mode, _ in job.allowed_modes}
    entries = list(ranking) if "sync" in allowed else []
    entries += [m.result for m in modes
                if m.name in ("one_step_off", "async") and m.allowed and m.result is not None]

    def value(e: Evaluated) -> float:
        if objective.objective != "throughput" and e.dollars_per_iteration is not None:
            return e.dollars_per_iteration
        return e.iteration_seconds

    return tuple(sorted(entries, key=value))


def cheapest_meeting_deadline(results: list[PlanningResult],
                              deadline_seconds: float) -> PlanningResult | None:
    """Among planning results (one per cluster size), the one whose best plan meets the
    deadline at the fewest dollars per iteration (ties: fewer GPUs)."""
    meeting = [r for r in results if r.best is not None
               and r.best.dollars_per_iteration is not None
               and r.best.iteration_seconds <= deadline_seconds * (1 + 1e-12)]
    return min(meeting, key=lambda r: (r.best.dollars_per_iteration,  # type: ignore[union-attr]
                                       r.job.cluster.total_gpus), default=None)


def missed_deadline(job: JobSpec, options: SearchOptions) -> str:
    """Why cost-at-deadline found nothing: the fastest plan's time, or that nothing fits."""
    fastest = Search(job, replace(options, ranking=Ranking(), top_k=1)).run().best
    deadline = options.ranking.deadline_seconds_per_iteration
    if fastest is None:
        return explain_infeasible(job)
    return (f"no plan meets the deadline of {deadline:g} s per iteration: the fastest plan "
            f"({fastest.placement_label} on {'+'.join(map(str, fastest.sizes))} GPUs) takes "
            f"{fastest.iteration_seconds:.2f} s")


def minimum_states(job: JobSpec, role: str, gpus: int, space: SpaceOptions | None = None
                   ) -> tuple[MemoryBreakdown, MemoryBreakdown] | None:
    """The smallest per-GPU state of ``role`` over its configs on ``gpus`` GPUs: (while it
    runs, between its calls). What a layout keeps in host memory between calls is on the GPU
    during them, so the two differ only where the framework offloads."""
    from planner.space import role_configs

    configs = [p.parallel for p in role_configs(job, role, gpus, space or SpaceOptions())]
    if not configs:
        return None
    running = [_while_running(job, role, par) for par in configs]
    resting = [role_state(job, role, par)[0] for par in configs]
    return min(running, key=lambda m: m.total), min(resting, key=lambda m: m.total)


def pin_conflict(job: JobSpec, role: str, gpus: int, space: SpaceOptions) -> str:
    """Why the job's pins of ``role`` leave it no layout on ``gpus`` GPUs: which pin (or
    which pins together) the framework's space, or the --backend asked for, cannot run; ''
    when the role has no layout even without its pins."""
    from planner.space import role_configs

    pin = job.parallel.get(role)
    pinned = pin.set_fields() if pin else {}
    if not pinned:
        return ""

    def runs(without: tuple[str, ...]) -> bool:
        loose = replace(pin, **dict.fromkeys(without))  # type: ignore[arg-type]
        return bool(role_configs(replace(job, parallel={**job.parallel, role: loose}), role,
                                 gpus, space))

    if not runs(tuple(pinned)):
        return ""
    where = f"{job.framework_profile.name}'s space" + (
        f" with --backend {space.backend}" if space.backend not in ("any", "simulated") else "")
    shown = {name: f"parallel.{role}.{name}: {value}" for name, value in pinned.items()}
    alone = [name for name in pinned if runs((name,))]
    if len(alone) == 1:
        others = ", ".join(v for n, v in shown.items() if n != alone[0])
        return (f"no layout in {where} runs {role} with {shown[alone[0]]}"
                + (f" (beside its other pins: {others})" if others else "")
                + ": remove or change that pin")
    return (f"no layout in {where} runs {role} with these pins together: "
            f"{', '.join(shown.values())}; leaving out any one of "
            f"{', '.join(shown[n] for n in alone) or 'them'} leaves layouts")


def _while_running(job: JobSpec, role: str, par: ParallelConfig) -> MemoryBreakdown:
    """The role's state on the GPU during its call: what is offloaded comes back, and the
    gradients FSDP frees after the optimizer step exist."""
    state, training_grads = role_state(job, role, replace(par, offload_params=False,
                                                          offload_optimizer=False))
    return replace(state, grads=state.grads + training_grads)


def explain_infeasible(job: JobSpec, search: Search | None = None,
                       max_nodes: int = 1024) -> str:
    """'does not fit: ... per GPU the models' states need at least ... while ROLE runs; the
    smallest cluster that fits is N GPUs'."""
    if not job.cluster.is_homogeneous:
        # Every set lives in one pool: the largest pool is where the models fit best.
        pool = max(job.cluster.pools(), key=lambda p: (p.gpus, -p.index))
        return (f"no allocation of the mixed cluster ({job.cluster.describe()}) fits; on its "
                f"largest group alone: " + explain_infeasible(job.on_pool(pool), None,
                                                              max_nodes))
    cluster = job.cluster
    gpus = cluster.total_gpus
    usable = cluster.profile().usable_memory_bytes
    parts = []
    states: dict[str, tuple[MemoryBreakdown, MemoryBreakdown]] = {}
    space = search.options.space if search is not None else SpaceOptions()
    for role in job.gpu_roles:
        found = minimum_states(job, role, gpus, space)
        if found is None:
            conflict = pin_conflict(job, role, gpus, space)
            if conflict:
                return conflict
            parts.append(f"{role}: no valid layout on {gpus} GPUs")
            continue
        states[role] = found
        running, resting = found
        rest = "" if resting.total == running.total else \
            f", {resting.total / GIB:.1f} between its calls"
        parts.append(f"{role} {running.total / GIB:.1f} GiB while it runs "
                     f"({running.describe()}){rest}")
    # A lower bound on the peak: one role running while every other holds its state between
    # calls (the smallest each can hold), before activations and the KV cache.
    need, busiest = 0.0, ""
    for role, (running, _) in states.items():
        peak = running.total + sum(resting.total for other, (_, resting) in states.items()
                                   if other != role)
        if peak > need:
            need, busiest = peak, role
    message = (f"the job does not fit on {gpus} x {cluster.profile().name} "
               f"({usable / GIB:.1f} GiB usable per GPU): even fully sharded over all "
               f"{gpus} GPUs" + (" and offloaded between calls where the framework can"
                                 if any(r.total < w.total for w, r in states.values()) else "")
               + f", the models' weights and optimizer states need {need / GIB:.1f} GiB per "
               f"GPU while {busiest or 'a model'} runs, before activations and KV cache: "
               + "; ".join(parts))
    smallest = smallest_cluster(job, max_nodes=max_nodes)
    if smallest is not None:
        message += f". The smallest cluster that fits: {smallest} GPUs"
    else:
        message += f". It does not fit on up to {max_nodes} nodes either"
    return message


def smallest_cluster(job: JobSpec, max_nodes: int = 1024) -> int | None:
    """The fewest GPUs (same device and node size) on which the colocate placement fits, by
    the search's own check (its colocate frontier is not empty, so ``plan`` returns a plan),
    doubling then bisecting (more GPUs never need more memory per GPU)."""
    cluster = job.cluster
    gpn = cluster.gpus_per_node
    sizes = [g for g in set_sizes(max_nodes * gpn, gpn) if g > cluster.total_gpus]

    def fits(gpus: int) -> bool:
        bigger = job.with_cluster(cluster.with_total_gpus(gpus))
        return bool(Search(bigger, SearchOptions(top_k=1)).frontier(bigger.gpu_roles, gpus))

    # Doubling over powers of two of nodes (a framework's batch checks hold at powers of two
    # that they may not hold between), then bisecting below the first that fits.
    probes = [i for i, g in enumerate(sizes) if g % gpn or (g // gpn) & (g // gpn - 1) == 0]
    low, high = -1, len(sizes)
    for index in probes:
        if fits(sizes[index]):
            high = index
            break
        low = index
    if high >= len(sizes):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if fits(sizes[middle]):
            high = middle
        else:
            low = middle
    return sizes[high]
