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

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
from planner.space import SpaceOptions, pack, placements, role_configs, set_sizes
from profiles.datafile import SpecError
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
    node_sequences,
)
from simulator.schedule import Step, makespan
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


@dataclass(frozen=True, slots=True)
class Candidate:
    """A complete mapping found by the search."""

    placement: Placement
    sizes: tuple[int, ...]
    first_gpus: tuple[int, ...]
    points: tuple[SetPoint, ...]
    iteration_seconds: float

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
        return (rounded(self.iteration_seconds), rounded(self.busy_seconds),
                rounded(sum(p.resident_bytes for p in self.points)),
                rounded(sum(p.transient_bytes for p in self.points)),
                self.placement_label, self.sizes, self.role_labels(tuple(sorted(roles))))

    def to_plan(self, job: JobSpec, strategy: str = "searched") -> Plan:
        roles: dict[str, RolePlan] = {}
        sets = []
        for group, size, first, point in zip(self.placement, self.sizes, self.first_gpus,
                                              self.points, strict=True):
            sets.append(ColocatedSet(roles=group, gpus=size, first_gpu=first))
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

    def cost_model_cache(self) -> dict[str, float]:
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

    def __init__(self, job: JobSpec, placement: Placement):
        self.job = job
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
        self.sequences = {n.name: node_sequences(job, n) for n in job.dataflow.nodes}
        self.call_seconds = job.cluster.profile().overheads.call_seconds
        self._steps: dict[tuple[int, ...], list[Step]] = {}
        self._free: list[Step] | None = None

    def steps(self, sizes: tuple[int, ...]) -> list[Step]:
        """Steps with the transfers of this allocation (cached per allocation)."""
        cached = self._steps.get(sizes)
        if cached is not None:
            return cached
        job = self.job
        steps = []
        for location, _, nodes in self.items:
            node = job.dataflow.node(nodes[0])
            inputs = []
            for dep in node.after:
                source = self.item_of[dep]
                src_location = self.items[source][0]
                seconds = edge_seconds(job, job.dataflow.node(dep), src_location, location)
                inputs.append((source, seconds))
            steps.append(Step(name="+".join(nodes), location=location,
                              inputs=tuple(dict.fromkeys(inputs))))
        self._steps[sizes] = steps
        return steps

    @property
    def steps_without_transfers(self) -> list[Step]:
        """The steps with every transfer at zero (bounds for partial allocations)."""
        if self._free is None:
            full = self.steps(tuple(self.job.cluster.total_gpus for _ in self.placement))
            self._free = [Step(name=s.name, location=s.location,
                               inputs=tuple((i, 0.0) for i, _ in s.inputs)) for s in full]
        return self._free

    def durations(self, vectors: list[tuple[float, ...]]) -> list[float]:
        return [self.fixed[i] if location < 0 else vectors[location][gi]
                for i, (location, gi, _) in enumerate(self.items)]


class Search:
    """One search over a job; reusable caches live here."""

    def __init__(self, job: JobSpec, options: SearchOptions | None = None,
                 progress: Callable[[int, int, SearchStats], None] | None = None):
        if not job.cluster.is_homogeneous:
            raise SpecError("the planner handles one node group; heterogeneous clusters are "
                            "not supported yet", key="cluster.node_groups")
        self.job = job
        self.options = options or SearchOptions()
        self.progress = progress
        self.stats = SearchStats()
        self.profile = job.cluster.profile()
        self.usable = self.profile.usable_memory_bytes
        self.total_gpus = job.cluster.total_gpus
        self.gpn = job.cluster.gpus_per_node
        self.sizes = set_sizes(self.total_gpus, self.gpn)
        self._candidates: dict[tuple[str, int], list[RoleCandidate]] = {}
        self._generation_cache: dict = {}
        self._frontiers: dict[tuple[tuple[str, ...], int], list[SetPoint]] = {}
        self._ideals: dict[tuple[tuple[str, ...], int], tuple[float, ...] | None] = {}
        self._groups: dict[tuple[str, ...], tuple[Group, ...]] = {}
        self._fastest: dict[tuple, float] = {}
        self._top_k = self.options.top_k

    # ----- per set -----

    def groups(self, roles: tuple[str, ...]) -> tuple[Group, ...]:
        if roles not in self._groups:
            self._groups[roles] = set_groups(self.job, roles)
        return self._groups[roles]

    def candidates(self, role: str, gpus: int) -> list[RoleCandidate]:
        """Every config of ``role`` on ``gpus`` GPUs that fits alone, costed once."""
        key = (role, gpus)
        if self.options.cache and key in self._candidates:
            return self._candidates[key]
        plans = role_configs(self.job, role, gpus, self.options.space)
        self.stats.configs_evaluated += len(plans)
        result = evaluate_role(self.job, role, plans, self.usable)
        if self.options.cache:
            self._candidates[key] = result
        return result

    def frontier(self, roles: tuple[str, ...], gpus: int) -> list[SetPoint]:
        key = (roles, gpus)
        if self.options.cache and key in self._frontiers:
            self.stats.frontier_cache_hits += 1
            return self._frontiers[key]
        self.stats.frontiers += 1
        candidates = {r: self.candidates(r, gpus) for r in roles}
        points: list[SetPoint] = []
        # Executable plans keep a set's Megatron roles on one layout; studies need not.
        subsets = [candidates] if self.options.space.backend == "simulated" else \
            megatron_consistent(candidates)
        for subset in subsets:
            if any(not c for c in subset.values()):
                continue
            points.extend(set_frontier(self.job, roles, self.groups(roles), subset,
                                       self.usable, gpus=gpus, prune=self.options.prune,
                                       generation_cache=self._generation_cache))
        points = _unique_points(points)
        if self.options.cache:
            self._frontiers[key] = points
        return points

    def quick_ideal(self, roles: tuple[str, ...], gpus: int) -> tuple[float, ...] | None:
        """A lower bound of every group duration of the set on ``gpus`` GPUs, without building
        its frontier: each operation at its fastest config, generation with the largest running
        batch. None when some model cannot fit on these GPUs even alone."""
        key = (roles, gpus)
        if key in self._ideals:
            return self._ideals[key]
        groups = self.groups(roles)
        group_of = {name: i for i, g in enumerate(groups) for name in g.nodes}
        ideal = [0.0] * len(groups)
        result: tuple[float, ...] | None = None
        for role in roles:
            cands = self.candidates(role, gpus)
            if not cands:
                break
            for name, _ in cands[0].node_seconds:
                ideal[group_of[name]] += min(dict(c.node_seconds)[name] for c in cands)
            generates = [n for n in self.job.dataflow.nodes
                         if n.role == role and n.operation == "generate"]
            if generates:
                ideal[group_of[generates[0].name]] += min(c.transition_seconds for c in cands)
            for node in generates:
                ideal[group_of[node.name]] += min(self._fastest_generation(node.name, c)
                                                  for c in cands)
        else:
            result = tuple(ideal)
        self._ideals[key] = result
        return result

    def _fastest_generation(self, name: str, candidate: RoleCandidate) -> float:
        key = (name, candidate.plan.generation, candidate.plan.parallel.world_size)
        if key not in self._fastest:
            self._fastest[key] = fastest_generation_seconds(self.job, name, candidate.plan)
        return self._fastest[key]

    # ----- per placement -----

    def search_placement(self, placement: Placement, top: list) -> None:
        """Add this placement's best candidates to the heap ``top`` (max-heap by key)."""
        job = self.job
        layout = _Layout(job, placement)
        k = len(placement)
        sizes_for = []
        for roles in placement:
            usable_sizes = [s for s in self.sizes if self.quick_ideal(roles, s) is not None]
            sizes_for.append(sorted(usable_sizes, reverse=True))
        if any(not s for s in sizes_for):
            return
        # Best possible durations of a set given at most g GPUs (for unassigned sets).
        best_within: list[dict[int, tuple[float, ...]]] = []
        for roles, options in zip(placement, sizes_for, strict=True):
            table: dict[int, tuple[float, ...]] = {}
            for g in self.sizes:
                vectors = [self.quick_ideal(roles, s) for s in options if s <= g]
                vectors = [v for v in vectors if v is not None]
                if vectors:
                    table[g] = tuple(min(col) for col in zip(*vectors, strict=True))
            best_within.append(table)

        def threshold() -> float:
            if len(top) < self._top_k:
                return math.inf
            return -top[0][0]

        def bound_partial(chosen: list[int]) -> float:
            remaining = self.total_gpus - sum(chosen)
            vectors = []
            for i in range(k):
                if i < len(chosen):
                    vectors.append(self.quick_ideal(placement[i], chosen[i]))
                else:
                    vector = best_within[i].get(max((g for g in best_within[i]
                                                     if g <= remaining), default=0))
                    if vector is None:
                        return math.inf
                    vectors.append(vector)
            steps = (layout.steps(tuple(chosen)) if len(chosen) == k
                     else layout.steps_without_transfers)
            return makespan(steps, layout.durations(vectors))

        def visit(chosen: list[int]) -> None:
            if len(chosen) == k:
                self.evaluate_allocation(layout, tuple(chosen), top, threshold)
                return
            used = sum(chosen)
            for size in sizes_for[len(chosen)]:
                if used + size > self.total_gpus:
                    continue
                trial = [*chosen, size]
                if pack(tuple(trial), self.total_gpus, self.gpn) is None:
                    continue
                if self.options.prune and bound_partial(trial) > threshold() + EPSILON:
                    self.stats.partial_allocations_pruned += 1
                    continue
                visit(trial)

        visit([])

    def evaluate_allocation(self, layout: _Layout, sizes: tuple[int, ...], top: list,
                            threshold: Callable[[], float]) -> None:
        """Best point combination of one allocation (branch and bound over the frontiers)."""
        self.stats.allocations += 1
        placement = layout.placement
        steps = layout.steps(sizes)
        frontiers = [self.frontier(roles, size) for roles, size in zip(placement, sizes,
                                                                         strict=True)]
        if any(not f for f in frontiers):
            return
        ideals = [tuple(min(col) for col in zip(*(p.durations for p in f), strict=True))
                  for f in frontiers]
        if self.options.prune and makespan(steps, layout.durations(ideals)) > \
                threshold() + EPSILON:
            self.stats.allocations_pruned += 1
            return
        first_gpus = tuple(pack(sizes, self.total_gpus, self.gpn) or ())
        best: list[Candidate] = []
        chosen: list[SetPoint] = []

        def bound_limit() -> float:
            limit = threshold()
            if best:
                limit = min(limit, best[0].iteration_seconds)
            return limit

        def visit(i: int) -> None:
            if i == len(frontiers):
                seconds = makespan(steps, layout.durations([p.durations for p in chosen]))
                self.stats.candidates_evaluated += 1
                candidate = Candidate(placement=placement, sizes=sizes, first_gpus=first_gpus,
                                      points=tuple(chosen), iteration_seconds=seconds)
                if not best or candidate.sort_key() < best[0].sort_key():
                    best[:] = [candidate]
                return
            for point in frontiers[i]:
                chosen.append(point)
                if self.options.prune and i + 1 < len(frontiers):
                    vectors = [p.durations for p in chosen] + ideals[i + 1:]
                    if makespan(steps, layout.durations(vectors)) > bound_limit() + EPSILON:
                        chosen.pop()
                        continue
                visit(i + 1)
                chosen.pop()

        visit(0)
        if best:
            _push(top, best[0], self._top_k)

    # ----- whole search -----

    def run(self, placements_to_try: tuple[Placement, ...] | None = None,
            top_k: int | None = None) -> SearchResult:
        """Search ``placements_to_try`` (default: the options', else all) keeping the
        ``top_k`` best; caches carry over between runs on one Search."""
        start = time.perf_counter()
        chosen = allowed_placements(self.job, placements_to_try or self.options.placements)
        self._top_k = top_k or self.options.top_k
        top: list = []
        for index, placement in enumerate(chosen):
            self.stats.placements += 1
            self.search_placement(placement, top)
            if self.progress is not None:
                self.progress(index + 1, len(chosen), self.stats)
        ranking = tuple(sorted((c for _, _, c in top), key=Candidate.sort_key))
        self.stats.seconds += time.perf_counter() - start
        return SearchResult(best=ranking[0] if ranking else None, ranking=ranking,
                            stats=self.stats)


def allowed_placements(job: JobSpec, given: tuple[Placement, ...] | None = None
                       ) -> tuple[Placement, ...]:
    """The placements to search: ``given`` (each checked against what the job's framework can
    run) or every set partition of the GPU roles that the framework can run."""
    if not given:
        return tuple(p for p in placements(job.gpu_roles) if job.placement_allowed(p))
    for placement in given:
        if not job.placement_allowed(placement):
            raise SpecError(f"framework {job.framework!r} keeps the reference model's weights "
                            "in host memory and swaps them into the actor's model: 'ref' must "
                            f"share the actor's set (placement {placement_label(placement)})",
                            key="placement")
    return given


def fastest_generation_seconds(job: JobSpec, name: str, plan: RolePlan) -> float:
    """Generation seconds with the largest running batch the engine allows (a lower bound for
    any memory budget, since a larger running batch never slows generation)."""
    gen = plan.generation
    assert gen is not None
    node = job.dataflow.node(name)
    work = job.workload
    model = job.model(node.role)
    lengths = generation_lengths(job, node, gen.replicas(plan.parallel))
    cap = running_cap(gen, sequences=len(lengths), kv_capacity_tokens=math.inf,
                      prompt_len=work.prompt_length, mean_response=sum(lengths) / len(lengths))
    profile = job.cluster.profile()
    seconds, _, _ = decode(model, profile, gen, lengths=lengths, prompt_len=work.prompt_length,
                           cap=cap, dtype=work.dtype, gpus_per_node=job.cluster.gpus_per_node,
                           cuda_graphs=job.framework_profile.rollout.cuda_graphs,
                           host_seconds_per_sequence=job.framework_profile.rollout
                           .decode_host_seconds_per_sequence)
    return seconds + prefill_seconds(model, profile, gen, sequences=len(lengths),
                                     prompt_len=work.prompt_length, dtype=work.dtype,
                                     gpus_per_node=job.cluster.gpus_per_node) \
        + generation_fixed_seconds(job, model, gen)


def _push(top: list, candidate: Candidate, k: int) -> None:
    """Keep the k best candidates in a max-heap keyed by sort order."""
    entry = (-candidate.iteration_seconds, _Reverse(candidate.sort_key()), candidate)
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
                placements_to_try: tuple[Placement, ...] | None = None) -> Candidate | None:
    """Reference for tests: every placement x every allocation x every combination of configs,
    each costed from scratch with ``estimate_plan`` and the node-level schedule. No frontiers,
    no groups, no bounds, no search caches. Exponential: small cases only."""
    import itertools

    from simulator.engine import iteration_seconds
    from simulator.predict import estimate_plan

    space = space or SpaceOptions()
    total, gpn = job.cluster.total_gpus, job.cluster.gpus_per_node
    sizes = set_sizes(total, gpn)
    best: Candidate | None = None
    for placement in allowed_placements(job, placements_to_try):
        for allocation in itertools.product(sizes, repeat=len(placement)):
            first = pack(allocation, total, gpn)
            if first is None:
                continue
            per_role = {role: role_configs(job, role, size, space)
                        for group, size in zip(placement, allocation, strict=True)
                        for role in group}
            roles = list(per_role)
            for combo in itertools.product(*(per_role[r] for r in roles)):
                chosen = dict(zip(roles, combo, strict=True))
                plan = Plan(algorithm=job.algorithm, roles=chosen, sets=tuple(
                    ColocatedSet(roles=g, gpus=s, first_gpu=f)
                    for g, s, f in zip(placement, allocation, first, strict=True)))
                if space.backend != "simulated":
                    try:
                        plan.check_backends()
                    except SpecError:
                        continue  # Megatron roles of a set on different layouts
                estimate = estimate_plan(job, plan)
                if not estimate.feasible:
                    continue
                transition_seconds = (estimate.transition.seconds
                                      if estimate.transition is not None else 0.0)
                points = tuple(SetPoint(
                    durations=(sum(n.seconds for n in estimate.nodes.values()
                                   if n.location == i)
                               + (transition_seconds if "actor" in g else 0.0),),
                    plans=tuple((r, chosen[r]) for r in g), peak=estimate.memory[i].peak,
                    resident_bytes=estimate.memory[i].resident.total,
                    transient_bytes=estimate.memory[i].peak.total
                    - estimate.memory[i].resident.total)
                    for i, g in enumerate(placement))
                candidate = Candidate(placement=placement, sizes=allocation,
                                      first_gpus=tuple(first), points=points,
                                      iteration_seconds=iteration_seconds(job, estimate))
                if best is None or candidate.sort_key() < best.sort_key():
                    best = candidate
    return best
