"""Auto-mapping: HybridFlow's Algorithm 1 (placements x GPU allocations x parallel configs),
exact under the cost model, with caching and bound-based pruning.

For every placement (a set partition of the job's GPU roles) the search walks the allocations
of GPUs to its colocated sets depth first. A partial allocation is abandoned when a lower bound
of its iteration time -- the schedule evaluated with each set's best possible group durations
-- cannot beat the K-th best plan found so far; a complete one picks one point of each set's
Pareto frontier (``planner.frontier``) by the same branch and bound. Iteration time is a
max-plus function of the durations (``simulator.schedule``), so the bounds are valid and the
result is the exhaustive optimum: ``brute_force`` checks it on small cases.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.frontier import (
    Group,
    RoleCandidate,
    SetPoint,
    evaluate_role,
    plan_label,
    rounded,
    set_frontier,
    set_groups,
)
from planner.objective import (
    SECONDS_PER_HOUR,
    Ranking,
    check_prices,
    cluster_dollars_per_second,
    plan_dollars_per_second,
    pool_price_per_gpu_hour,
    priced,
)
from planner.space import (
    SpaceOptions,
    batching_variants,
    context_parallel_variants,
    pack,
    placements,
    powers_of_two,
    role_configs,
    search_space,
    set_sizes,
)
from profiles.datafile import SpecError
from profiles.framework_space import project
from simulator.costs.generation import decode, prefill_seconds, running_cap
from simulator.costs.inference import forward_pass
from simulator.costs.training import train_step
from simulator.costs.transformer import layer_cost
from simulator.plan import ColocatedSet, Plan, RolePlan, placement_string
from simulator.predict import (
    CONTROLLER_LOCATION,
    controller_node,
    edge_seconds,
    generation_fixed_seconds,
    generation_lengths,
)
from simulator.schedule import Step, makespan
from simulator.specs.cluster import Pool
from simulator.specs.dataflow import CONTROLLER
from simulator.specs.job import JobSpec

Placement = tuple[tuple[str, ...], ...]
EPSILON = 1e-9


def megatron_consistent(candidates: dict[str, list[RoleCandidate]],
                        ) -> list[dict[str, list[RoleCandidate]]]:
    """The set's candidates split so that every combination drawn from one part has its
    Megatron roles on one (tp, pp, vpp) layout (Megatron's parallel state is one per
    process): one part per layout when two or more roles have Megatron candidates."""
    layouts = {r: {c.plan.megatron_layout() for c in cands} - {None}
               for r, cands in candidates.items()}
    if sum(1 for found in layouts.values() if found) < 2:
        return [candidates]
    parts = []
    for layout in sorted(set().union(*layouts.values())):
        parts.append({r: [c for c in cands if c.plan.megatron_layout() in (None, layout)]
                      for r, cands in candidates.items()})
    return parts


def same_layout_parts(candidates: dict[str, list[RoleCandidate]], roles: tuple[str, ...]
                      ) -> list[dict[str, list[RoleCandidate]]]:
    """The set's candidates split so that the ``roles`` that run in one model's layout draw
    the same (tp, pp, ep, etp, cp) from every part."""
    tied = [r for r in roles if r in candidates]
    if len(tied) < 2:
        return [candidates]

    def shape(c: RoleCandidate) -> tuple[int, int, int, int, int]:
        par = c.plan.parallel
        return par.tp, par.pp, par.ep, par.etp, par.cp

    shapes = set.intersection(*({shape(c) for c in candidates[r]} for r in tied))
    return [{r: [c for c in cands if r not in tied or shape(c) == key]
             for r, cands in candidates.items()} for key in sorted(shapes)]


def _unique_points(points: list[SetPoint]) -> list[SetPoint]:
    """``points`` without repeats (combinations of torch-only roles appear in every part)."""
    seen: set[tuple] = set()
    out = []
    for point in points:
        key = tuple((role, plan_label(plan), plan.training_backend)
                    for role, plan in point.plans)
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class SearchOptions:
    """Knobs of the search (defaults are what ``hybridflow plan`` uses)."""

    top_k: int = 5
    """Best plans (distinct placement + allocation) to keep and rank."""
    space: SpaceOptions = field(default_factory=SpaceOptions)
    placements: tuple[Placement, ...] | None = None
    """Restrict to these placements (default: all set partitions of the GPU roles)."""
    prune: bool = True
    """Bound-based pruning of allocations and Pareto pruning of configs."""
    cache: bool = True
    """Reuse per-(set, GPUs) frontiers and per-(role, GPUs) config evaluations."""
    ranking: Ranking = field(default_factory=Ranking)
    """What plans are ranked by: iteration time (default) or dollars per iteration."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A complete mapping found by the search."""

    placement: Placement
    sizes: tuple[int, ...]
    first_gpus: tuple[int, ...]
    """Each set's first GPU in its node group."""
    points: tuple[SetPoint, ...]
    iteration_seconds: float
    node_groups: tuple[int, ...] = ()
    """Each set's node group (index in the job's ``cluster.node_groups``); empty: all 0."""
    dollars_per_iteration: float | None = None
    """What one iteration costs (None when the cluster has no prices)."""
    score: float | None = None
    """What the search minimised: dollars per iteration when ranking by cost, else None
    (iteration seconds)."""

    @property
    def objective_value(self) -> float:
        return self.iteration_seconds if self.score is None else self.score

    def set_node_groups(self) -> tuple[int, ...]:
        return self.node_groups or (0,) * len(self.placement)

    @property
    def placement_label(self) -> str:
        return "|".join(",".join(g) for g in self.placement)

    def role_labels(self, roles: tuple[str, ...]) -> tuple[str, ...]:
        """Each role's config label, in ``roles`` order."""
        plans = {role: plan for point in self.points for role, plan in point.plans}
        return tuple(plan_label(plans[r]) for r in roles)

    def configs_label(self) -> str:
        plans = {role: plan for point in self.points for role, plan in point.plans}
        return " ".join(f"{r}:{plan_label(p)}" for r, p in plans.items())

    @property
    def busy_seconds(self) -> float:
        """Seconds the GPUs of all sets are busy (sum of every set's operations)."""
        return sum(sum(p.durations) for p in self.points)

    def sort_key(self) -> tuple:
        """A total order: iteration time, then busy time, resident and transient memory (less
        is better), then placement, GPUs per set and configs (deterministic ties)."""
        roles = tuple(r for group in self.placement for r in group)
        return (rounded(self.objective_value), rounded(self.iteration_seconds),
                rounded(self.busy_seconds),
                rounded(sum(p.resident_bytes for p in self.points)),
                rounded(sum(p.transient_bytes for p in self.points)),
                self.placement_label, self.sizes, self.set_node_groups(),
                self.role_labels(tuple(sorted(roles))))

    def to_plan(self, job: JobSpec, strategy: str = "searched") -> Plan:
        roles: dict[str, RolePlan] = {}
        sets = []
        for group, size, first, point, node_group in zip(
                self.placement, self.sizes, self.first_gpus, self.points,
                self.set_node_groups(), strict=True):
            sets.append(ColocatedSet(roles=group, gpus=size, first_gpu=first,
                                     node_group=node_group))
            roles.update(dict(point.plans))
        return Plan(algorithm=job.algorithm, sets=tuple(sets), roles=roles, strategy=strategy)


@dataclass
class SearchStats:
    placements: int = 0
    allocations: int = 0
    """Complete allocations reached."""
    partial_allocations_pruned: int = 0
    allocations_pruned: int = 0
    candidates_evaluated: int = 0
    """Complete (placement, allocation, configs) combinations whose iteration time was computed."""
    configs_evaluated: int = 0
    """Model configs costed (all operations of one model under one layout)."""
    frontiers: int = 0
    frontier_cache_hits: int = 0
    seconds: float = 0.0
    cost_model_cache: dict[str, float] = field(default_factory=dict)
    """This process's cost-model caches when the last run ended (``cost_model_cache``)."""


def cost_model_cache() -> dict[str, float]:
    """Hits, misses and hit rate of this process's cost-model caches so far."""
    hits = misses = 0
    for fn in (train_step, forward_pass, decode, prefill_seconds, layer_cost):
        info = fn.cache_info()
        hits += info.hits
        misses += info.misses
    total = hits + misses
    return {"hits": hits, "misses": misses, "hit_rate": hits / total if total else 0.0}


@dataclass(frozen=True, slots=True)
class SearchResult:
    best: Candidate | None
    ranking: tuple[Candidate, ...]
    stats: SearchStats


class _Layout:
    """The schedule template of one placement: group steps per set, controller steps."""

    def __init__(self, job: JobSpec, placement: Placement, pools: tuple[Pool, ...]):
        self.job = job
        self.pools = pools
        self.placement = placement
        self.groups = [set_groups(job, roles) for roles in placement]
        location_of_role = {r: i for i, roles in enumerate(placement) for r in roles}
        names: list[str] = []
        items: list[tuple[int, int, tuple[str, ...]]] = []  # (location, group index, nodes)
        item_of: dict[str, int] = {}
        for node in job.dataflow.nodes:
            if node.name in item_of:
                continue
            if node.role == CONTROLLER or node.role in job.rule_roles:
                item_of[node.name] = len(items)
                items.append((CONTROLLER_LOCATION, -1, (node.name,)))
                continue
            location = location_of_role[node.role]
            for gi, group in enumerate(self.groups[location]):
                if node.name in group.nodes:
                    for member in group.nodes:
                        item_of[member] = len(items)
                    items.append((location, gi, group.nodes))
                    break
            names.append(node.name)
        self.items = items
        self.item_of = item_of
        self.fixed = [sum(controller_node(job, job.dataflow.node(n)).seconds for n in nodes)
                      if location == CONTROLLER_LOCATION else 0.0
                      for location, _, nodes in items]
        self._steps: dict[tuple[int, ...], list[Step]] = {}
        self._free: list[Step] | None = None
        self._compiled: dict[tuple, Callable[[list], float]] = {}

    def steps(self, set_pools: tuple[int, ...]) -> list[Step]:
        """Steps with the transfers when the sets sit on these pools (positions in
        ``pools``; the transfers do not depend on the sets' sizes). Cached."""
        cached = self._steps.get(set_pools)
        if cached is not None:
            return cached
        job = self.job
        on = tuple(self.pools[i] for i in set_pools)
        steps = []
        for location, _, nodes in self.items:
            node = job.dataflow.node(nodes[0])
            inputs = []
            for dep in node.after:
                source = self.item_of[dep]
                src_location = self.items[source][0]
                seconds = edge_seconds(job, job.dataflow.node(dep), src_location, location, on)
                inputs.append((source, seconds))
            steps.append(Step(name="+".join(nodes), location=location,
                              inputs=tuple(dict.fromkeys(inputs))))
        self._steps[set_pools] = steps
        return steps

    @property
    def steps_without_transfers(self) -> list[Step]:
        """The steps with every transfer at zero (bounds for partial allocations)."""
        if self._free is None:
            full = self.steps(tuple(0 for _ in self.placement))
            self._free = [Step(name=s.name, location=s.location,
                               inputs=tuple((i, 0.0) for i, _ in s.inputs)) for s in full]
        return self._free

    def durations(self, vectors: list[tuple[float, ...]]) -> list[float]:
        return [self.fixed[i] if location < 0 else vectors[location][gi]
                for i, (location, gi, _) in enumerate(self.items)]

    def iteration(self, set_pools: tuple[int, ...] | None) -> Callable[[list], float]:
        """The iteration time as a function of the sets' duration vectors: with the
        transfers of sets on ``set_pools``, or none (None). Cached per key."""
        key = ("free",) if set_pools is None else set_pools
        function = self._compiled.get(key)
        if function is None:
            steps = self.steps_without_transfers if set_pools is None else \
                self.steps(set_pools)

            def function(vectors: list, steps: list[Step] = steps) -> float:
                return makespan(steps, self.durations(vectors))

            self._compiled[key] = function
        return function


class _AllocationWalk:
    """The depth-first walk over one placement's allocations (a pool and a size per set, in
    the placement's order), pruning a partial allocation whose best possible completion
    cannot beat the heap's worst kept candidate."""

    def __init__(self, search: Search, placement: Placement, top: list):
        self.search = search
        self.placement = placement
        self.top = top
        self.layout = _Layout(search.job, placement, search.pools)
        self.k = len(placement)
        # A framework that sizes its pools in nodes of one shape keeps every set on one group.
        self.one_group = search.space.one_node_group and not search.study
        self.pools = range(len(search.pools))
        self.options_for = self._set_options()
        if self.options_for is None:
            return
        # The least a set can cost per second (pay-for-used cost ranking bounds).
        self.cheapest = [min(size * search.pool_price[p] for p, size in options)
                         / SECONDS_PER_HOUR for options in self.options_for]
        self.best_within = [self._best_within(roles, options) for roles, options
                            in zip(placement, self.options_for, strict=True)]
        # Each table's sizes in ascending order, for "the largest size within the GPUs left".
        self.within_keys = [[list(table) for table in per_pool]
                            for per_pool in self.best_within]

    def _set_options(self) -> list[list[tuple[int, int]]] | None:
        """Each set's (pool, size) options, pool by pool, largest first; None when a set
        has none."""
        search = self.search
        options_for = [[(p, size) for p in self.pools
                        for size in sorted(search.pool_sizes[p], reverse=True)
                        if search.quick_ideal(roles, size, p) is not None]
                       for roles in self.placement]
        return None if any(not o for o in options_for) else options_for

    def _best_within(self, roles: tuple[str, ...], options: list[tuple[int, int]],
                     ) -> list[dict[int, tuple[float, ...]]]:
        """Per pool: the best possible durations of the set given at most g GPUs there, for
        every usable g (a running minimum over the pool's sizes, which ascend)."""
        search = self.search
        per_pool = []
        for p in self.pools:
            table: dict[int, tuple[float, ...]] = {}
            usable = {s for q, s in options if q == p}
            running: tuple[float, ...] | None = None
            for g in search.pool_sizes[p]:
                if g in usable:
                    vector = search.quick_ideal(roles, g, p)
                    assert vector is not None
                    running = vector if running is None else tuple(
                        min(a, b) for a, b in zip(running, vector, strict=True))
                if running is not None:
                    table[g] = running
            per_pool.append(table)
        return per_pool

    def factor_at_least(self, chosen: list[tuple[int, int]]) -> float:
        search = self.search
        if not search.ranking.by_cost:
            return 1.0
        if search.ranking.pay_for == "cluster":
            return search.cluster_rate
        return search.dollars_per_second(tuple(chosen)) + sum(self.cheapest[len(chosen):])

    def threshold(self) -> float:
        if len(self.top) < self.search._top_k:
            return math.inf
        return -self.top[0][0]

    def bound_partial(self, chosen: list[tuple[int, int]], left: list[int]) -> float:
        """The best iteration ``chosen`` can still reach; ``left``: GPUs of each pool that
        ``chosen`` leaves."""
        vectors = []
        for i in range(self.k):
            if i < len(chosen):
                vectors.append(self.search.quick_ideal(self.placement[i], chosen[i][1],
                                                       chosen[i][0]))
                continue
            # The best the set could do on any pool with the GPUs left there.
            found = []
            for p in self.pools:
                keys = self.within_keys[i][p]
                at = bisect.bisect_right(keys, left[p]) - 1
                if at >= 0:
                    found.append(self.best_within[i][p][keys[at]])
            if not found:
                return math.inf
            vectors.append(found[0] if len(found) == 1 else
                           tuple(min(col) for col in zip(*found, strict=True)))
        return self.layout.iteration(tuple(p for p, _ in chosen) if len(chosen) == self.k
                                     else None)(vectors)

    def fits(self, chosen: list[tuple[int, int]], p: int) -> bool:
        search = self.search
        sizes = tuple(size for q, size in chosen if q == p)
        return pack(sizes, search.pool_gpus[p], search.pool_gpn[p]) is not None

    def visit(self, chosen: list[tuple[int, int]]) -> None:
        search = self.search
        if len(chosen) == self.k:
            search.evaluate_allocation(self.layout, tuple(chosen), self.top, self.threshold)
            return
        left = [search.pool_gpus[p] - sum(size for q, size in chosen if q == p)
                for p in self.pools]
        for p, size in self.options_for[len(chosen)]:
            if size > left[p] or (self.one_group and chosen and p != chosen[0][0]):
                continue
            trial = [*chosen, (p, size)]
            if not self.fits(trial, p):
                continue
            if search.options.prune:
                trial_left = left.copy()
                trial_left[p] -= size
                bound = self.bound_partial(trial, trial_left)
                if search.too_slow(bound) or \
                        bound * self.factor_at_least(trial) > self.threshold() + EPSILON:
                    search.stats.partial_allocations_pruned += 1
                    continue
            self.visit(trial)


class Search:
    """One search over a job; reusable caches live here.

    On a mixed cluster every colocated set lives in one pool (``ClusterSpec.pools``: a node
    group, or identical groups joined) and the search explores which pool hosts which set as
    part of the allocation: each set's cost models see its pool's device and network."""

    def __init__(self, job: JobSpec, options: SearchOptions | None = None,
                 progress: Callable[[int, int, SearchStats], None] | None = None, *,
                 caches_from: Search | None = None):
        """``caches_from``: a search of the same job on another number of GPUs (the trainer
        sides of asynchronous plans), whose per-set caches this one shares when its nodes are
        the same kind (a model or set on g GPUs costs the same whatever the cluster's size);
        on other nodes it is ignored."""
        self.job = job
        self.options = options or SearchOptions()
        if self.options.space.backend != "simulated":
            check_executable_models(job)
            check_framework_algorithm(job)
        self.progress = progress
        self.stats = SearchStats()
        self.pools = job.cluster.pools()
        self.views = tuple(job.on_pool(p) for p in self.pools)
        self.usable = tuple(v.cluster.profile().usable_memory_bytes for v in self.views)
        self.pool_gpus = tuple(p.gpus for p in self.pools)
        self.pool_gpn = tuple(p.group.gpus_per_node for p in self.pools)
        self.pool_sizes = tuple(set_sizes(g, n) for g, n in zip(self.pool_gpus, self.pool_gpn,
                                                                 strict=True))
        self.space = search_space(job, self.options.space)
        self.study = self.options.space.backend == "simulated"
        self.variants = self.space.variants(job.gpu_roles, tuple(
            powers_of_two(max(p.group.gpus_per_node for p in self.pools))),
            batchings=batching_variants(job, self.options.space),
            context_parallel_sizes=context_parallel_variants(job))
        self.variant = 0
        """Index in ``variants`` of the job-wide settings being searched (the caches below
        are keyed by it)."""
        self._candidates: dict[tuple[int, str, int, int], list[RoleCandidate]] = {}
        self._generation_cache: tuple[dict, ...] = tuple({} for _ in self.pools)
        self._frontiers: dict[tuple[int, tuple[str, ...], int, int], list[SetPoint]] = {}
        self._ideals: dict[tuple[int, tuple[str, ...], int, int], tuple[float, ...] | None] = {}
        self._role_ideals: dict[tuple[int, str, int, int],
                                tuple[tuple[str, float], ...] | None] = {}
        self._groups: dict[tuple[str, ...], tuple[Group, ...]] = {}
        self._fastest: dict[tuple, float] = {}
        if caches_from is not None and self._costs_alike(caches_from):
            self._share_caches(caches_from)
        self._top_k = self.options.top_k
        self.ranking = self.options.ranking
        if self.ranking.by_cost:
            check_prices(job)
        self.priced = priced(job)
        self.pool_price = tuple(pool_price_per_gpu_hour(job.cluster, p) or 0.0
                                for p in self.pools)
        self.cluster_rate = cluster_dollars_per_second(job.cluster) if self.priced else 0.0

    def _costs_alike(self, other: Search) -> bool:
        """Whether ``other`` costs every model and set as this search does: the same job,
        options and kind of node, on one pool each (only the number of GPUs differs)."""
        return len(self.pools) == len(other.pools) == 1 and \
            self.views[0].cluster.only_group().pool_key() == \
            other.views[0].cluster.only_group().pool_key() and \
            self.variants == other.variants and self.options.space == other.options.space \
            and self.options.prune == other.options.prune \
            and self.options.cache == other.options.cache \
            and replace(self.job, cluster=other.job.cluster) == other.job

    def _share_caches(self, other: Search) -> None:
        self._candidates = other._candidates
        self._generation_cache = other._generation_cache
        self._frontiers = other._frontiers
        self._ideals = other._ideals
        self._role_ideals = other._role_ideals
        self._groups = other._groups
        self._fastest = other._fastest

    # ----- the objective -----

    def dollars_per_second(self, allocation: tuple[tuple[int, int], ...]) -> float:
        """Dollars per second of an allocation ((pool, GPUs) per set) for the ranking's
        ``pay_for``."""
        if self.ranking.pay_for == "cluster":
            return self.cluster_rate
        return sum(size * self.pool_price[p] for p, size in allocation) / SECONDS_PER_HOUR

    def score_factor(self, allocation: tuple[tuple[int, int], ...]) -> float:
        """Objective value per iteration second: 1 when ranking by time, the allocation's
        dollars per second when ranking by cost."""
        return self.dollars_per_second(allocation) if self.ranking.by_cost else 1.0

    def too_slow(self, seconds: float) -> bool:
        """Whether even ``seconds`` (a lower bound) misses the deadline."""
        return not self.ranking.meets_deadline(seconds)

    # ----- per set -----

    def groups(self, roles: tuple[str, ...]) -> tuple[Group, ...]:
        if roles not in self._groups:
            self._groups[roles] = set_groups(self.job, roles)
        return self._groups[roles]

    def candidates(self, role: str, gpus: int, pool: int = 0) -> list[RoleCandidate]:
        """Every config of ``role`` on ``gpus`` GPUs of pool ``pool`` (a position in
        ``self.pools``) that fits alone, costed once."""
        key = (pool, role, gpus, self.variant)
        if self.options.cache and key in self._candidates:
            return self._candidates[key]
        view = self.views[pool]
        plans = role_configs(view, role, gpus, self.options.space, self.variants[self.variant])
        self.stats.configs_evaluated += len(plans)
        result = evaluate_role(view, role, plans, self.usable[pool])
        if self.options.cache:
            self._candidates[key] = result
        return result

    def frontier(self, roles: tuple[str, ...], gpus: int, pool: int = 0) -> list[SetPoint]:
        key = (pool, roles, gpus, self.variant)
        if self.options.cache and key in self._frontiers:
            self.stats.frontier_cache_hits += 1
            return self._frontiers[key]
        self.stats.frontiers += 1
        candidates = {r: self.candidates(r, gpus, pool) for r in roles}
        points: list[SetPoint] = []
        # Executable plans keep a set's Megatron roles on one layout; studies need not.
        subsets = megatron_consistent(candidates) if self.space.one_megatron_layout_per_set \
            else [candidates]
        if self.space.same_layout and not self.study:
            subsets = [part for subset in subsets
                       for part in same_layout_parts(subset, self.space.same_layout)]
        for subset in subsets:
            if any(not c for c in subset.values()):
                continue
            points.extend(set_frontier(self.views[pool], roles, self.groups(roles), subset,
                                       self.usable[pool], gpus=gpus, prune=self.options.prune,
                                       generation_cache=self._generation_cache[pool]))
        points = _unique_points(points)
        if self.options.cache:
            self._frontiers[key] = points
        return points

    def quick_ideal(self, roles: tuple[str, ...], gpus: int,
                    pool: int = 0) -> tuple[float, ...] | None:
        """A lower bound of every group duration of the set on ``gpus`` GPUs, without building
        its frontier: each operation at its fastest config, generation with the largest running
        batch. None when some model cannot fit on these GPUs even alone."""
        key = (pool, roles, gpus, self.variant)
        if key in self._ideals:
            return self._ideals[key]
        groups = self.groups(roles)
        group_of = {name: i for i, g in enumerate(groups) for name in g.nodes}
        ideal = [0.0] * len(groups)
        result: tuple[float, ...] | None = None
        for role in roles:
            terms = self._role_ideal(role, gpus, pool)
            if terms is None:
                break
            for name, seconds in terms:
                ideal[group_of[name]] += seconds
        else:
            result = tuple(ideal)
        self._ideals[key] = result
        return result

    def _role_ideal(self, role: str, gpus: int,
                    pool: int) -> tuple[tuple[str, float], ...] | None:
        """What ``quick_ideal`` adds for one model, in order: (operation, least seconds);
        None when no config of the model fits. Cached per (pool, role, GPUs)."""
        key = (pool, role, gpus, self.variant)
        if key in self._role_ideals:
            return self._role_ideals[key]
        cands = self.candidates(role, gpus, pool)
        terms: tuple[tuple[str, float], ...] | None = None
        if cands:
            out = [(name, min(c.node_seconds[index][1] for c in cands))
                   for index, (name, _) in enumerate(cands[0].node_seconds)]
            generates = [n for n in self.job.dataflow.nodes
                         if n.role == role and n.operation == "generate"
                         and not self.job.generation_elsewhere]
            if generates:
                out.append((generates[0].name, min(c.transition_seconds for c in cands)))
            # The fastest generation reads a config's generation layout and GPU count only:
            # one candidate of each stands for the others.
            first_of: dict[tuple, RoleCandidate] = {}
            for c in cands:
                first_of.setdefault((c.plan.generation, c.plan.parallel.world_size), c)
            for node in generates:
                out.append((node.name, min(self._fastest_generation(node.name, c, pool)
                                           for c in first_of.values())))
            terms = tuple(out)
        self._role_ideals[key] = terms
        return terms

    def _fastest_generation(self, name: str, candidate: RoleCandidate, pool: int) -> float:
        key = (pool, name, candidate.plan.generation, candidate.plan.parallel.world_size)
        if key not in self._fastest:
            self._fastest[key] = fastest_generation_seconds(self.views[pool], name,
                                                            candidate.plan)
        return self._fastest[key]

    # ----- per placement -----

    def search_placement(self, placement: Placement, top: list) -> None:
        """Add this placement's best candidates to the heap ``top`` (max-heap by key).

        An allocation gives each set a pool and a number of GPUs there; the sets of one pool
        must pack into it (``_AllocationWalk``)."""
        walk = _AllocationWalk(self, placement, top)
        if walk.options_for is not None:
            walk.visit([])

    def evaluate_allocation(self, layout: _Layout, allocation: tuple[tuple[int, int], ...],
                            top: list, threshold: Callable[[], float]) -> None:
        """Best point combination of one allocation ((pool, GPUs) per set; branch and bound
        over the frontiers)."""
        self.stats.allocations += 1
        placement = layout.placement
        set_pools = tuple(p for p, _ in allocation)
        sizes = tuple(size for _, size in allocation)
        iteration = layout.iteration(set_pools)
        frontiers = [self.frontier(roles, size, p)
                     for roles, (p, size) in zip(placement, allocation, strict=True)]
        if any(not f for f in frontiers):
            return
        ideals = [tuple(min(col) for col in zip(*(p.durations for p in f), strict=True))
                  for f in frontiers]
        factor = self.score_factor(allocation)
        rate = self.dollars_per_second(allocation) if self.priced else None
        if self.options.prune:
            bound = iteration(ideals)
            if self.too_slow(bound) or bound * factor > threshold() + EPSILON:
                self.stats.allocations_pruned += 1
                return
        first_gpus = self.first_gpus(allocation)
        node_groups = tuple(self.pools[p].index for p in set_pools)
        best: list[Candidate] = []
        best_key: list[tuple] = []
        chosen: list[SetPoint] = []

        def bound_limit() -> float:
            limit = threshold()
            if best:
                limit = min(limit, best[0].objective_value)
            return limit

        def visit(i: int) -> None:
            if i == len(frontiers):
                seconds = iteration([p.durations for p in chosen])
                self.stats.candidates_evaluated += 1
                if self.too_slow(seconds):
                    return
                candidate = Candidate(
                    placement=placement, sizes=sizes, first_gpus=first_gpus,
                    points=tuple(chosen), iteration_seconds=seconds, node_groups=node_groups,
                    dollars_per_iteration=None if rate is None else seconds * rate,
                    score=seconds * factor if self.ranking.by_cost else None)
                if best and rounded(candidate.objective_value) > best_key[0][0]:
                    return  # a key's first field is the rounded objective value
                key = candidate.sort_key()
                if not best or key < best_key[0]:
                    best[:] = [candidate]
                    best_key[:] = [key]
                return
            for point in frontiers[i]:
                chosen.append(point)
                if self.options.prune and i + 1 < len(frontiers):
                    vectors = [p.durations for p in chosen] + ideals[i + 1:]
                    bound = iteration(vectors)
                    if self.too_slow(bound) or bound * factor > bound_limit() + EPSILON:
                        chosen.pop()
                        continue
                visit(i + 1)
                chosen.pop()

        visit(0)
        if best:
            _push(top, best[0], self._top_k)

    def first_gpus(self, allocation: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
        """Each set's first GPU in its pool (the sets of a pool packed together)."""
        first = [0] * len(allocation)
        for p in {p for p, _ in allocation}:
            members = [i for i, (q, _) in enumerate(allocation) if q == p]
            packed = pack(tuple(allocation[i][1] for i in members), self.pool_gpus[p],
                          self.pool_gpn[p]) or ()
            for i, gpu in zip(members, packed, strict=True):
                first[i] = gpu
        return tuple(first)

    # ----- whole search -----

    def run(self, placements_to_try: tuple[Placement, ...] | None = None,
            top_k: int | None = None) -> SearchResult:
        """Search ``placements_to_try`` (default: the options', else all) keeping the
        ``top_k`` best; caches carry over between runs on one Search."""
        start = time.perf_counter()
        chosen = allowed_placements(self.job, placements_to_try or self.options.placements,
                                    study=self.study)
        self._top_k = top_k or self.options.top_k
        top: list = []
        steps = len(chosen) * len(self.variants)
        for variant in range(len(self.variants)):
            # One search per choice of the framework's job-wide settings (one engine for the
            # shared roles, one tensor-parallel size, ...), into one ranking.
            self.variant = variant
            for index, placement in enumerate(chosen):
                self.stats.placements += 1
                self.search_placement(placement, top)
                if self.progress is not None:
                    self.progress(variant * len(chosen) + index + 1, steps, self.stats)
        ranking = tuple(sorted((c for _, _, c in top), key=Candidate.sort_key))
        self.stats.seconds += time.perf_counter() - start
        self.stats.cost_model_cache = cost_model_cache()
        return SearchResult(best=ranking[0] if ranking else None, ranking=ranking,
                            stats=self.stats)


def allowed_placements(job: JobSpec, given: tuple[Placement, ...] | None = None, *,
                       study: bool = False) -> tuple[Placement, ...]:
    """The placements to search: ``given`` (each checked against what the job's framework can
    run) or every set partition of the GPU roles that the framework can run (a ``study``, the
    simulated backend, tries every placement the simulator prices)."""
    if not given:
        return tuple(p for p in placements(job.gpu_roles)
                     if placement_refusal(job, p, study=study) is None)
    for placement in given:
        reason = placement_refusal(job, placement, study=study)
        if reason is not None:
            raise SpecError(reason, key="placement")
    return given


def placement_refusal(job: JobSpec, placement: Placement, *, study: bool = False) -> str | None:
    """Why ``job``'s framework cannot run ``placement`` (None: it can). A ``study`` (the
    simulated backend) is held only to what the simulator prices."""
    label = placement_label(placement)
    if not job.placement_allowed(placement):
        return (f"framework {job.framework!r} keeps the reference model's weights in host "
                "memory and swaps them into the actor's model: 'ref' must share the actor's "
                f"set (placement {label})")
    rules = job.framework_profile.space.placements
    if study or rules.allows(placement, job.gpu_roles, trainer=job.generation_elsewhere):
        return None
    patterns = (rules.trainer or rules.sync) if job.generation_elsewhere else rules.sync
    shown = sorted({placement_label(tuple(tuple(sorted(g)) for g in project(p, job.gpu_roles)))
                    for p in patterns})
    where = "beside a rollout set" if job.generation_elsewhere else "in synchronous mode"
    return (f"framework {job.framework!r} cannot place {label} {where} (its configuration "
            f"places: {'; '.join(shown)}); plan it with --backend simulated for a study")


def fastest_generation_seconds(job: JobSpec, name: str, plan: RolePlan) -> float:
    """Generation seconds with the largest running batch the engine allows (a lower bound for
    any memory budget, since a larger running batch never slows generation)."""
    gen = plan.generation
    assert gen is not None
    node = job.dataflow.node(name)
    work = job.workload
    model = job.model(node.role)
    lengths = generation_lengths(job, node, gen.replicas(plan.parallel))
    cap = running_cap(gen, sequences=lengths.sequences, kv_capacity_tokens=math.inf,
                      prompt_len=work.prompt_length, mean_response=lengths.mean_tokens)
    profile = job.cluster.profile()
    seconds, _, _ = decode(model, profile, gen, lengths=lengths, prompt_len=work.prompt_length,
                           cap=cap, dtype=work.dtype, gpus_per_node=job.cluster.gpus_per_node,
                           cuda_graphs=job.rollout.cuda_graphs,
                           host_seconds_per_sequence=job.rollout.decode_host_seconds_per_sequence)
    return seconds + prefill_seconds(model, profile, gen, sequences=lengths.sequences,
                                     prompt_len=work.prompt_length, dtype=work.dtype,
                                     gpus_per_node=job.cluster.gpus_per_node) \
        + generation_fixed_seconds(job, model, gen)


def _push(top: list, candidate: Candidate, k: int) -> None:
    """Keep the k best candidates in a max-heap keyed by sort order (a candidate found again,
    under another variant of the framework's job-wide settings, is kept once)."""
    key = candidate.sort_key()
    if any(entry[1].key == key for entry in top):
        return
    entry = (-candidate.objective_value, _Reverse(key), candidate)
    if len(top) < k:
        heapq.heappush(top, entry)
    elif candidate.sort_key() < top[0][2].sort_key():
        heapq.heapreplace(top, entry)


@dataclass(frozen=True, slots=True)
class _Reverse:
    key: tuple

    def __lt__(self, other: _Reverse) -> bool:
        return self.key > other.key


def search(job: JobSpec, options: SearchOptions | None = None,
           progress: Callable[[int, int, SearchStats], None] | None = None) -> SearchResult:
    """Run the auto-mapping search on ``job``."""
    return Search(job, options, progress).run()


def placement_label(placement: Placement) -> str:
    return placement_string([ColocatedSet(roles=g, gpus=1) for g in placement])


def brute_force(job: JobSpec, space: SpaceOptions | None = None,
                placements_to_try: tuple[Placement, ...] | None = None,
                ranking: Ranking | None = None) -> Candidate | None:
    """Reference for tests: every placement x every allocation x every combination of configs,
    each costed from scratch with ``estimate_plan`` and the node-level schedule. No frontiers,
    no groups, no bounds, no search caches. Exponential: small cases only."""
    import itertools

    space = space or SpaceOptions()
    ranking = ranking or Ranking()
    pools = job.cluster.pools()
    framework = search_space(job, space)
    study = space.backend == "simulated"
    variants = framework.variants(job.gpu_roles, tuple(
        powers_of_two(max(p.group.gpus_per_node for p in pools))),
        batchings=batching_variants(job, space),
        context_parallel_sizes=context_parallel_variants(job))
    best: Candidate | None = None
    for placement in allowed_placements(job, placements_to_try, study=study):
        for on in itertools.product(range(len(pools)), repeat=len(placement)):
            if framework.one_node_group and not study and len(set(on)) > 1:
                continue
            views = [job.on_pool(pools[p]) for p in on]
            size_options = [set_sizes(pools[p].gpus, pools[p].group.gpus_per_node) for p in on]
            for allocation in itertools.product(*size_options):
                first = _packed_in_pools(allocation, on, pools)
                if first is None:
                    continue
                for variant in variants:
                    per_role = {role: role_configs(view, role, size, space, variant)
                                for group, size, view in zip(placement, allocation, views,
                                                             strict=True)
                                for role in group}
                    best = _best_combination(job, placement, allocation, first, on, pools,
                                             per_role, space, ranking, best)
    return best


def _packed_in_pools(allocation: tuple[int, ...], on: tuple[int, ...],
                     pools: tuple[Pool, ...]) -> list[int] | None:
    """Each set's first GPU in its pool, or None when some pool's sets do not fit it."""
    first = [0] * len(allocation)
    for p in set(on):
        members = [i for i, q in enumerate(on) if q == p]
        packed = pack(tuple(allocation[i] for i in members), pools[p].gpus,
                      pools[p].group.gpus_per_node)
        if packed is None:
            return None
        for i, gpu in zip(members, packed, strict=True):
            first[i] = gpu
    return first


def _best_combination(job: JobSpec, placement: Placement, allocation: tuple[int, ...],
                      first: list[int], on: tuple[int, ...], pools: tuple[Pool, ...],
                      per_role: dict, space: SpaceOptions, ranking: Ranking,
                      best: Candidate | None) -> Candidate | None:
    """``best`` or a better candidate among every config combination of one allocation."""
    import itertools

    from simulator.engine import iteration_seconds
    from simulator.predict import estimate_plan

    roles = list(per_role)
    node_groups = tuple(pools[p].index for p in on)
    rate = plan_dollars_per_second(job, tuple(zip(node_groups, allocation, strict=True)),
                                   ranking.pay_for) if priced(job) else None
    for combo in itertools.product(*(per_role[r] for r in roles)):
        chosen = dict(zip(roles, combo, strict=True))
        plan = Plan(algorithm=job.algorithm, roles=chosen, sets=tuple(
            ColocatedSet(roles=g, gpus=s, first_gpu=f, node_group=n)
            for g, s, f, n in zip(placement, allocation, first, node_groups, strict=True)))
        framework = search_space(job, space)
        if framework.one_megatron_layout_per_set:
            try:
                plan.check_backends()
            except SpecError:
                continue  # Megatron roles of a set on different layouts
        tied = [chosen[r].parallel for r in framework.same_layout if r in chosen]
        if len({(p.tp, p.pp, p.ep, p.etp, p.cp) for p in tied}) > 1:
            continue  # roles that run in one model's layout
        estimate = estimate_plan(job, plan)
        if not estimate.feasible:
            continue
        transition_seconds = (estimate.transition.seconds
                              if estimate.transition is not None else 0.0)
        points = tuple(SetPoint(
            durations=(sum(n.seconds for n in estimate.nodes.values() if n.location == i)
                       + (transition_seconds if "actor" in g else 0.0),),
            plans=tuple((r, chosen[r]) for r in g), peak=estimate.memory[i].peak,
            resident_bytes=estimate.memory[i].resident.total,
            transient_bytes=estimate.memory[i].peak.total - estimate.memory[i].resident.total)
            for i, g in enumerate(placement))
        seconds = iteration_seconds(job, estimate)
        if not ranking.meets_deadline(seconds):
            continue
        dollars = None if rate is None else seconds * rate
        candidate = Candidate(placement=placement, sizes=allocation, first_gpus=tuple(first),
                              points=points, iteration_seconds=seconds, node_groups=node_groups,
                              dollars_per_iteration=dollars,
                              score=dollars if ranking.by_cost else None)
        if best is None or candidate.sort_key() < best.sort_key():
            best = candidate
    return best


def check_executable_models(job: JobSpec) -> None:
    """Raise SpecError naming the model if no executor backend runs it, so a search meant
    for execution (any backend but ``simulated``) says so instead of planning it."""
    for role in job.gpu_roles:
        model = job.model(role)
        if model.mla is not None:
            raise SpecError(f"{model.name} attends with multi-head latent attention, which no "
                            "executor backend here runs: plan it as a study with --backend "
                            "simulated", key=f"models.{role}")


def check_framework_algorithm(job: JobSpec) -> None:
    """Raise SpecError naming the key if the job's framework has no trainer for its
    algorithm, or no engine for one of its models (a plan for it would be one the framework
    cannot run)."""
    space = job.framework_profile.space
    if space.algorithms and job.algorithm not in space.algorithms:
        raise SpecError(f"framework {job.framework!r} has no {job.algorithm} trainer (it runs "
                        f"{', '.join(space.algorithms)}): set framework: hybridflow, or plan a "
                        "study with --backend simulated", key="algorithm")
    for role in job.gpu_roles:
        if space.constrained and not space.engines_for(role):
            hint = " (use reward: rule)" if role in ("reward", "cost") else ""
            raise SpecError(f"framework {job.framework!r} runs no {role} model on GPUs"
                            f"{hint}", key=f"models.{role}")
