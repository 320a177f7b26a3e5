"""Per colocated set: the Pareto frontier of its models' parallel configs.

Within one set the models run back to back, so what a set contributes to the iteration is the
vector of its operation groups' durations (``set_groups``). Every combination of the models'
configs that fits in memory gives such a vector; only non-dominated vectors can be part of an
optimal plan, because iteration time never decreases when a duration grows
(``simulator.schedule``).

The models of a set interact only through memory: their resident states decide whether the set
fits and how much KV cache the actor's generation gets. Combinations are built model by model
with numpy, dropping a partial combination when another is no slower in any group and needs no
more resident or transient memory; the actor comes last, where the memory left decides its
running batch (``running_cap``) and hence its generation time.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from profiles.device import DeviceProfile
from simulator.costs.generation import (
    ReplicaBatch,
    decode,
    decode_step_model,
    generation_weight_bytes,
    prefill_seconds,
    workspace_bytes,
)
from simulator.costs.memory import MemoryBreakdown
from simulator.costs.transition import transition
from simulator.plan import RolePlan
from simulator.predict import (
    extra_generation_weights,
    frees_cache,
    generation_fixed_seconds,
    generation_lengths,
    host_slowdown,
    model_node,
    node_sequences,
    offload_state,
    role_state,
    transition_scheme_of,
)
from simulator.specs.dataflow import Node
from simulator.specs.job import JobSpec
from simulator.specs.parallel import GenerationConfig

EPSILON = 1e-12
SWEEP_ROWS = 256
"""Rows above which ``pareto_mask`` drops what the least-sum row dominates before sorting."""
SWEEP_BLOCK = 64
"""Live rows ``_sweep`` settles together before dropping what they dominate."""
BLOCK_CELLS = 4_000_000
"""Most comparisons ``_sweep`` makes in one array operation."""
MATRIX_LIMIT = 1_000_000
"""Largest rows x rows x columns for which ``pareto_mask(all_pairs=True)`` compares all
pairs at once."""


@dataclass(frozen=True, slots=True)
class Group:
    """Consecutive operations of one set that start together, run back to back and feed the
    same consumers with the same transfer, so only their total duration matters."""

    nodes: tuple[str, ...]


def set_groups(job: JobSpec, roles: Sequence[str]) -> tuple[Group, ...]:
    """The groups of the operations of ``roles`` in calling order."""
    nodes = [n for n in job.dataflow.nodes if n.role in roles]
    consumers = {n.name: frozenset(c.name for c in job.dataflow.nodes if n.name in c.after)
                 for n in job.dataflow.nodes}

    def signature(node: Node) -> tuple:
        return (node.after, consumers[node.name], node.operation, node_sequences(job, node))

    groups: list[list[str]] = []
    last = None
    for node in nodes:
        sig = signature(node)
        if groups and sig == last:
            groups[-1].append(node.name)
        else:
            groups.append([node.name])
        last = sig
    return tuple(Group(nodes=tuple(g)) for g in groups)


@dataclass(frozen=True, slots=True)
class RoleCandidate:
    """One config of one model on some GPUs: the seconds of its non-generating operations and
    the memory it needs."""

    role: str
    plan: RolePlan
    node_seconds: tuple[tuple[str, float], ...]
    """Seconds of each non-generating operation of the model."""
    transition_seconds: float
    """Actor only: train -> generate resharding (3D-HybridEngine micro-DP scheme)."""
    resident: MemoryBreakdown
    transient_bytes: float
    """Largest per-GPU transient need of the model's non-generating operations."""
    extra_generation_bytes: float = 0.0
    """Actor only: generation weights beyond its resident training shard."""
    offload_bytes: float = 0.0
    """Per-GPU state the framework moves to host memory while the set generates."""
    offload_seconds: float = 0.0
    """Seconds of moving that state out and back, charged to the set's first generation."""


def evaluate_role(job: JobSpec, role: str, plans: Sequence[RolePlan],
                  usable_bytes: float) -> list[RoleCandidate]:
    """Cost every config in ``plans`` for ``role`` (dropping those that cannot fit alone)."""
    role_nodes = [n for n in job.dataflow.nodes if n.role == role]
    profile = job.cluster.profile()
    gpn = job.cluster.gpus_per_node
    dtype = job.workload.dtype
    model = job.model(role)
    out: list[RoleCandidate] = []
    # The non-generating operations and the resident state depend on the training layout
    # only: plans that differ in their generation config share them (None: cannot fit).
    by_layout: dict = {}
    offloads: dict = {}
    switches: dict = {}
    training = job.framework_profile.training
    forwards: dict = {}
    engine_bytes: dict[GenerationConfig, float] = {}
    for plan in plans:
        # The training backend too: the loss's logits memory depends on it.
        layout = (plan.parallel, plan.training_backend)
        if layout in by_layout:
            shared = by_layout[layout]
        else:
            shared = by_layout[layout] = _layout_costs(job, role, plan, role_nodes,
                                                       usable_bytes, forwards)
        if shared is None:
            continue
        resident, node_seconds, transient = shared
        switch = extra = 0.0
        gen = plan.generation
        if gen is not None:
            if gen not in engine_bytes:
                engine_bytes[gen] = generation_weight_bytes(model, gen, dtype)
            extra = extra_generation_weights(job, engine_bytes[gen], resident.params)
        if resident.total + max(transient, extra) > usable_bytes:
            continue
        if gen is not None:
            # The transition reads the training layout's shape and sharding only, not its
            # micro-batch or recompute mode.
            par = plan.parallel
            scheme = transition_scheme_of(job, plan)
            key = (par.tp, par.pp, par.dp, par.ep, par.etp, par.sharding, par.fsdp_size,
                   gen, scheme)
            if key not in switches:
                switches[key] = transition(
                    model, profile, par, gen, dtype=dtype, gpus_per_node=gpn, scheme=scheme,
                    fsdp_gather=training.transition_fsdp_gather,
                    megatron_gather=training.transition_megatron_gather).seconds
            switch = switches[key]
        if plan.parallel not in offloads:
            offloads[plan.parallel] = offload_state(job, role, plan.parallel)
        offloaded, offload_seconds = offloads[plan.parallel]
        out.append(RoleCandidate(role=role, plan=plan, node_seconds=node_seconds,
                                 transition_seconds=switch, resident=resident,
                                 transient_bytes=transient, extra_generation_bytes=extra,
                                 offload_bytes=offloaded.total,
                                 offload_seconds=offload_seconds))
    return out


def _layout_costs(job: JobSpec, role: str, plan: RolePlan, role_nodes: Sequence[Node],
                  usable_bytes: float,
                  forwards: dict) -> tuple[MemoryBreakdown, tuple, float] | None:
    """Resident state, seconds of the non-generating operations and their largest transient
    need under ``plan``'s training layout; None as soon as the model cannot fit alone (the
    resident state plus any operation's transient need exceeds the usable memory)."""
    resident, freed = role_state(job, role, plan.parallel)
    if resident.total > usable_bytes:
        return None
    seconds = []
    transient = 0.0
    for node in role_nodes:
        if node.operation == "generate":
            continue
        par = plan.parallel
        # A forward pass reads the layout's shape, sharding and sequence parallelism, not
        # the training micro-batch or recompute mode: those layouts share it.
        key = (node.name, par.tp, par.pp, par.dp, par.sharding, par.sequence_parallel,
               par.ep, par.etp, par.moe_dispatcher, par.offload_params,
               par.infer_micro_batch_tokens, par.ulysses, par.fsdp_size, par.cp,
               plan.training_backend) \
            if node.operation == "infer" else None
        cost = forwards.get(key) if key is not None else None
        if cost is None:
            estimate = model_node(job, node, plan, location=0, resident=resident,
                                  freed_grads=freed)
            cost = (estimate.seconds, estimate.transient.total)
            if key is not None:
                forwards[key] = cost
        seconds.append((node.name, cost[0]))
        transient = max(transient, cost[1])
        if resident.total + transient > usable_bytes:
            return None
    return resident, tuple(seconds), transient


def plan_label(plan: RolePlan) -> str:
    """A role's config as one comparable string (also the tie-break between equal plans)."""
    par = plan.parallel
    batch = f"tok{par.micro_batch_tokens}" if par.micro_batch_tokens else \
        f"mb{par.micro_batch_size}"
    text = f"{par.short()}-{batch}-{par.recompute}"
    if plan.generation is not None:
        text += f"/{plan.generation.short()}"
    return text


def rounded(value: float) -> float:
    """``value`` to 11 significant digits: sums taken in a different order compare equal."""
    return float(f"{value:.11g}")


@dataclass(frozen=True, slots=True)
class SetPoint:
    """A non-dominated combination of configs for one set."""

    durations: tuple[float, ...]
    """Seconds of each group (``set_groups``), generation and transition included."""
    plans: tuple[tuple[str, RolePlan], ...]
    peak: MemoryBreakdown
    """Per-GPU memory at the set's peak."""
    resident_bytes: float = 0.0
    """Per-GPU resident model state of the set."""
    transient_bytes: float = 0.0
    """Largest per-GPU transient need of the set's operations."""


def pareto_mask(values: np.ndarray, ranks: np.ndarray | None = None,
                key_of: Callable[[np.ndarray], list] | None = None,
                all_pairs: bool = False) -> np.ndarray:
    """Rows of ``values`` (to minimise) that no other row dominates; of equal rows the one
    with the lowest ``rank`` (default: the first). ``key_of`` (rows -> sort keys) may stand in
    for ``ranks``: it is called only for rows still undominated that share their sum with
    another such row, which gives the same result as ranking every row by those keys.
    ``all_pairs`` compares every pair of rows at once (same result; faster when many rows
    survive, slower when few do)."""
    n = len(values)
    if n <= 1:
        return np.ones(n, dtype=bool)
    sums = values.sum(axis=1)
    if key_of is not None and not all_pairs and n > SWEEP_ROWS and not np.isnan(sums).any():
        # The sweep's first steps without sorting: while one row has the least sum it comes
        # first and survives, and everything it dominates goes.
        mask = np.zeros(n, dtype=bool)
        rest = np.arange(n)
        while len(rest) > SWEEP_ROWS:
            rest_sums = sums[rest]
            at = int(np.argmin(rest_sums))
            if np.count_nonzero(rest_sums == rest_sums[at]) > 1:
                break
            pivot = rest[at]
            mask[pivot] = True
            rest = rest[~(values[pivot] <= values[rest] + EPSILON).all(axis=1)]
        if len(rest):
            mask[rest[_sweep(values[rest], None, lambda rows: key_of(rest[rows]), False)]] = True
        return mask
    return _sweep(values, ranks, key_of, all_pairs)


def _sweep(values: np.ndarray, ranks: np.ndarray | None,
           key_of: Callable[[np.ndarray], list] | None, all_pairs: bool) -> np.ndarray:
    """``pareto_mask`` by one sweep in (sum, rank) order."""
    n = len(values)
    if n <= 1:
        return np.ones(n, dtype=bool)
    sums = values.sum(axis=1)
    if key_of is None:
        ranks = np.arange(n) if ranks is None else ranks
        order = np.lexsort((ranks, sums))
        if all_pairs and n * n * values.shape[1] <= MATRIX_LIMIT:
            ordered = values[order]
            return _pareto_by_matrix(ordered, ordered + EPSILON, order)
    else:
        order = np.argsort(sums, kind="stable")
    ordered = values[order]
    limits = ordered + EPSILON  # row i dominates row j when ordered[i] <= limits[j]
    alive = np.ones(n, dtype=bool)
    group_end = None
    if key_of is not None:
        ordered_sums = sums[order]
        same = ordered_sums[1:] == ordered_sums[:-1]
        same |= np.isnan(ordered_sums[1:]) & np.isnan(ordered_sums[:-1])
        if all_pairs and not same.any() and n * n * values.shape[1] <= MATRIX_LIMIT:
            return _pareto_by_matrix(ordered, limits, order)
        starts = np.flatnonzero(~same) + 1
        # End (exclusive) of the run of equal sums that each position belongs to.
        group_end = np.append(starts, n)[np.searchsorted(starts, np.arange(n), side="right")]
    settled = 0  # positions before this have their final order
    i = 0
    while i < n:
        # The next live rows, a block at a time: which of them survive is settled among
        # themselves in order, then the survivors drop every later row they dominate at once.
        block = i + np.flatnonzero(alive[i:])[:SWEEP_BLOCK]
        if not len(block):
            break
        if group_end is not None:
            for position in block:
                if position >= settled:
                    end = int(group_end[position])
                    if end - position > 1:
                        _rank_equal_sums(position + np.flatnonzero(alive[position:end]),
                                         order, ordered, limits, key_of)
                    settled = end
        rows = ordered[block]
        dominates = (rows[:, None, :] <= limits[block][None, :, :]).all(axis=2)
        kept = np.ones(len(block), dtype=bool)
        for a in range(len(block)):
            if kept[a]:
                kept[a + 1:] &= ~dominates[a, a + 1:]
        alive[block] = kept
        after = int(block[-1]) + 1
        if after >= n:
            break
        live = after + np.flatnonzero(alive[after:])
        if not len(live):
            break
        survivors = rows[kept]
        columns = limits[live].T.copy()  # one contiguous row per column of the values
        step = max(1, BLOCK_CELLS // max(1, len(live)))
        for start in range(0, len(survivors), step):
            chunk = survivors[start:start + step]
            dominated = chunk[:, :1] <= columns[0]
            for column in range(1, columns.shape[0]):
                dominated &= chunk[:, column:column + 1] <= columns[column]
            alive[live[dominated.any(axis=0)]] = False
        i = after
    mask = np.zeros(n, dtype=bool)
    mask[order[alive]] = True
    return mask


def _rank_equal_sums(members: np.ndarray, order: np.ndarray, ordered: np.ndarray,
                     limits: np.ndarray, key_of: Callable[[np.ndarray], list]) -> None:
    """Put the live ``members`` of a run of equal sums in (key, row) order, in place. The
    order is total, so ranking a run before some of its members are dropped keeps the
    survivors' order."""
    if len(members) <= 1:
        return
    rows = order[members]
    by_rank = np.lexsort((rows, _ranks(key_of(rows))))
    order[members] = rows[by_rank]
    ordered[members] = ordered[members][by_rank]
    limits[members] = limits[members][by_rank]


def _pareto_by_matrix(ordered: np.ndarray, limits: np.ndarray,
                      order: np.ndarray) -> np.ndarray:
    """``pareto_mask``'s sweep for rows already in their final order, from the matrix of
    which row dominates which: a row survives when no surviving row before it dominates it.
    That rule determines the survivors position by position, so iterating it from "nothing
    dominated" reaches them (positions before t are right after t rounds) and stops at them."""
    n = len(ordered)
    beats = ordered[:, None, 0] <= limits[None, :, 0]
    for column in range(1, ordered.shape[1]):
        beats &= ordered[:, None, column] <= limits[None, :, column]
    beats = np.triu(beats, 1)
    alive = np.ones(n, dtype=bool)
    for _ in range(n + 1):
        update = ~(beats & alive[:, None]).any(axis=0)
        if np.array_equal(update, alive):
            break
        alive = update
    mask = np.zeros(n, dtype=bool)
    mask[order[alive]] = True
    return mask


class _Leaders:
    """Rows met so far with the least sums, kept to drop the rows they dominate before
    ``pareto_mask`` sees them. A row that a leader dominates (leader <= row + EPSILON in every
    column) and whose sum is strictly larger comes after that leader in pareto_mask's sweep,
    so the sweep drops it: the survivors are the same, from far fewer rows (a 128-GPU set
    meets millions of combinations, of which a few dozen survive)."""

    KEEP = 4
    """Leaders kept: the rows of least sum met so far."""

    def __init__(self, width: int) -> None:
        self.rows = np.empty((0, width))
        self.sums = np.empty(0)

    def undominated(self, columns: list[np.ndarray]) -> np.ndarray:
        """Mask of the rows (given as ``columns``) no leader dominates; the least of them may
        join the leaders."""
        sums = columns[0].copy()
        for column in columns[1:]:
            sums += column  # the order of values.sum(axis=1)
        limits = [column + EPSILON for column in columns]
        beaten = np.zeros(len(sums), dtype=bool)
        for leader, leader_sum in zip(self.rows, self.sums, strict=True):
            beaten |= self._dominates(leader, leader_sum, limits, sums)
        candidates = np.where(beaten, np.inf, sums)
        for _ in range(self.KEEP):
            at = int(np.argmin(candidates))
            if not np.isfinite(candidates[at]) or (len(self.sums) == self.KEEP
                                                   and sums[at] >= self.sums.max()):
                break
            leader = np.array([column[at] for column in columns])
            self._admit(leader, sums[at])
            now_beaten = self._dominates(leader, sums[at], limits, sums)
            beaten |= now_beaten
            candidates[now_beaten] = np.inf
            candidates[at] = np.inf  # a leader already
        return ~beaten

    @staticmethod
    def _dominates(leader: np.ndarray, leader_sum: float, limits: list[np.ndarray],
                   sums: np.ndarray) -> np.ndarray:
        beats = leader_sum < sums
        for value, limit in zip(leader, limits, strict=True):
            beats &= value <= limit
        return beats

    def _admit(self, row: np.ndarray, row_sum: float) -> None:
        if len(self.sums) == self.KEEP:
            worst = int(np.argmax(self.sums))
            self.rows = np.delete(self.rows, worst, axis=0)
            self.sums = np.delete(self.sums, worst)
        self.rows = np.vstack([self.rows, row])
        self.sums = np.append(self.sums, row_sum)


@dataclass
class _Combos:
    """Partial combinations of configs, as parallel arrays."""

    contributions: np.ndarray  # (m, groups) seconds
    resident: np.ndarray  # (m,) bytes
    transient: np.ndarray  # (m,) bytes
    picks: np.ndarray  # (m, roles so far) candidate indices
    offload: np.ndarray  # (m,) bytes moved to host while the set generates

    def take(self, mask: np.ndarray) -> _Combos:
        return _Combos(self.contributions[mask], self.resident[mask], self.transient[mask],
                       self.picks[mask], self.offload[mask])


def _contribution_matrix(candidates: Sequence[RoleCandidate], group_of: dict[str, int],
                         groups: int, transition_group: int | None,
                         offload_group: int | None) -> np.ndarray:
    matrix = np.zeros((len(candidates), groups))
    for i, c in enumerate(candidates):
        for name, seconds in c.node_seconds:
            matrix[i, group_of[name]] += seconds
        if transition_group is not None:
            matrix[i, transition_group] += c.transition_seconds
        if offload_group is not None:
            matrix[i, offload_group] += c.offload_seconds
    return matrix


def _ranks(keys: list) -> np.ndarray:
    """Position of each key in sorted order (ties share the lower position)."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    ranks = np.empty(len(keys), dtype=int)
    for position, index in enumerate(order):
        ranks[index] = position
    return ranks


def _fold(combos: _Combos, candidates: Sequence[RoleCandidate], contributions: np.ndarray,
          usable_bytes: float, prune: bool,
          label_of: Callable[[np.ndarray], tuple[str, ...]],
          count_offload: bool = False) -> _Combos:
    resident = np.array([c.resident.total for c in candidates])
    transient = np.array([c.transient_bytes for c in candidates])
    offload = np.array([c.offload_bytes for c in candidates]) if count_offload else \
        np.zeros(len(candidates))
    m, n = len(combos.resident), len(candidates)
    grown = _Combos(
        # Explicit width: reshape cannot infer it when no combination fits (m or n is 0).
        contributions=(combos.contributions[:, None, :] + contributions[None, :, :]).reshape(
            m * n, combos.contributions.shape[1]),
        resident=(combos.resident[:, None] + resident[None, :]).reshape(-1),
        transient=np.maximum(combos.transient[:, None], transient[None, :]).reshape(-1),
        picks=np.concatenate([np.repeat(combos.picks, n, axis=0),
                              np.tile(np.arange(n), m)[:, None]], axis=1),
        offload=(combos.offload[:, None] + offload[None, :]).reshape(-1),
    )
    grown = grown.take(grown.resident + grown.transient <= usable_bytes)
    if prune and len(grown.resident) > 1:
        # More state offloaded during generation leaves more KV cache: a better combination.
        values = np.column_stack([grown.contributions, grown.resident, grown.transient,
                                  -grown.offload])
        picks = grown.picks
        grown = grown.take(pareto_mask(values, key_of=lambda rows: [label_of(picks[r])
                                                                     for r in rows],
                                       all_pairs=True))
    return grown


@dataclass(frozen=True, slots=True)
class _GenerationTable:
    """Generation of one node under one generation config, as a function of the running cap."""

    kv_bytes_per_token: float
    longest_tokens: int
    sequences: int
    mean_response: float
    workspace_bytes: float
    seconds_by_cap: dict[int, float]
    peak_kv_bytes_by_cap: dict[int, float]


def _generation_table(job: JobSpec, node: Node, plan: RolePlan, gpus: int,
                      cache: dict) -> tuple[_GenerationTable, tuple[int, ...]]:
    gen: GenerationConfig = plan.generation  # type: ignore[assignment]
    # The engine's sleep and wake are added per config (_generation_seconds): configs that
    # differ only in freeing the cache share a table.
    key = (node.name, replace(gen, free_cache=None), gpus)
    if key in cache:
        return cache[key]
    work = job.workload
    model = job.model(node.role)
    lengths = generation_lengths(job, node, gen.replicas(plan.parallel))
    step = decode_step_model(model, gen, work.dtype, job.cluster.gpus_per_node)
    table = _GenerationTable(
        kv_bytes_per_token=step.kv_bytes_per_token_per_gpu,
        longest_tokens=work.prompt_length + lengths.longest, sequences=lengths.sequences,
        mean_response=lengths.mean_tokens,
        workspace_bytes=workspace_bytes(model, gen, work.dtype),
        seconds_by_cap={}, peak_kv_bytes_by_cap={})
    cache[key] = (table, lengths)
    return cache[key]


CAP_GRID_FROM = 16
"""Running caps up to this many sequences are priced as they are; above, on a grid (below)."""
CAP_GRID_STEP = 1 / 16
"""Relative step of the grid of running caps priced above CAP_GRID_FROM."""
CAP_GRID_SEQUENCES = 1024
"""Replicas of more responses than this are priced on the grid of caps; fewer, at every cap
(their event loop is cheap)."""


@lru_cache(maxsize=64)
def _grid_points(limit: int) -> tuple[int, ...]:
    """The caps priced exactly up to ``limit`` (the most a replica can run at once): every cap
    up to CAP_GRID_FROM, then steps of CAP_GRID_STEP, and ``limit`` itself."""
    points = set(range(1, min(limit, CAP_GRID_FROM) + 1))
    value = float(CAP_GRID_FROM)
    while value < limit:
        value *= 1 + CAP_GRID_STEP
        points.add(min(limit, round(value)))
    points.add(limit)
    return tuple(sorted(points))


def _cap_grid(cap: int, limit: int) -> tuple[int, int]:
    """The grid points around ``cap`` (lo <= cap <= hi <= ``limit``; equal when ``cap`` is
    one). The grid is fixed for a limit, so a grid point is always priced exactly, whatever
    cap asked for it first."""
    points = _grid_points(limit)
    i = bisect.bisect_left(points, cap)
    if i < len(points) and points[i] == cap:
        return cap, cap
    return points[i - 1], points[min(i, len(points) - 1)]


def _generation_seconds(job: JobSpec, node: Node, gen: GenerationConfig,
                        lengths: ReplicaBatch, table: _GenerationTable, cap: int,
                        gpus: int) -> float:
    """Seconds of a node's generation at running cap ``cap``. A large batch (more than
    CAP_GRID_SEQUENCES responses per replica) is priced at the caps of a geometric grid
    (steps of CAP_GRID_STEP) and interpolated linearly between them: the search meets every
    running cap from 1 to max_num_seqs (each colocated state leaves its own KV room), the
    decode time is smooth in the cap (interpolation |error| median 0.01%, max 0.18% at 40
    random caps of three long-tailed batches, benchmarks/cap_grid_error.py), and a
    decode of thousands to millions of responses costs milliseconds per cap. The plans the
    search returns are priced again exactly (``estimate_plan``)."""
    fixed = generation_fixed_seconds(job, job.model(node.role), gen) * host_slowdown(job, gpus)
    if cap in table.seconds_by_cap:
        return table.seconds_by_cap[cap] + fixed
    limit = min(gen.max_num_seqs, lengths.sequences)
    lo, hi = _cap_grid(cap, limit) if lengths.sequences > CAP_GRID_SEQUENCES else (cap, cap)
    if lo == hi:
        return _price_cap(job, node, gen, lengths, table, cap, gpus) + fixed
    low = _price_cap(job, node, gen, lengths, table, lo, gpus)
    high = _price_cap(job, node, gen, lengths, table, hi, gpus)
    t = (cap - lo) / (hi - lo)
    table.seconds_by_cap[cap] = low + t * (high - low)
    table.peak_kv_bytes_by_cap[cap] = table.peak_kv_bytes_by_cap[lo] + t * (
        table.peak_kv_bytes_by_cap[hi] - table.peak_kv_bytes_by_cap[lo])
    return table.seconds_by_cap[cap] + fixed


def _price_cap(job: JobSpec, node: Node, gen: GenerationConfig, lengths: ReplicaBatch,
               table: _GenerationTable, cap: int, gpus: int) -> float:
    """Prefill and decode seconds at running cap ``cap``, without the engine's fixed work per
    generation (which depends on whether it frees its cache)."""
    if cap not in table.seconds_by_cap:
        work = job.workload
        model = job.model(node.role)
        profile = job.cluster.profile()
        gpn = job.cluster.gpus_per_node
        rollout = job.rollout
        seconds, _, peak_tokens = decode(
            model, profile, gen, lengths=lengths, prompt_len=work.prompt_length, cap=cap,
            dtype=work.dtype, gpus_per_node=gpn, cuda_graphs=rollout.cuda_graphs,
            host_seconds_per_sequence=rollout.decode_host_seconds_per_sequence)
        seconds += prefill_seconds(model, profile, gen, sequences=lengths.sequences,
                                   prompt_len=work.prompt_length, dtype=work.dtype,
                                   gpus_per_node=gpn)
        seconds *= host_slowdown(job, gpus)
        table.seconds_by_cap[cap] = seconds
        table.peak_kv_bytes_by_cap[cap] = peak_tokens * table.kv_bytes_per_token
    return table.seconds_by_cap[cap]


@dataclass(frozen=True, slots=True)
class _SetContext:
    """What every step of one set's frontier reads: the job, the set's operation groups, the
    memory it may use and the caches it shares with the search."""

    job: JobSpec
    profile: DeviceProfile
    """The set's device, with the cluster's network."""
    group_of: dict[str, int]
    groups: int
    usable_bytes: float
    gpus: int
    prune: bool
    generation_cache: dict
    generate_nodes: list[Node]
    offload_group: int | None
    """The group charged with the framework's offload copies (the set's first generation)."""


def set_frontier(job: JobSpec, roles: Sequence[str], groups: tuple[Group, ...],
                 candidates: dict[str, list[RoleCandidate]], usable_bytes: float, *,
                 gpus: int, prune: bool = True,
                 generation_cache: dict | None = None) -> list[SetPoint]:
    """The non-dominated config combinations of a set on ``gpus`` GPUs (every feasible
    combination when ``prune`` is off)."""
    group_of = {name: i for i, g in enumerate(groups) for name in g.nodes}
    # A trainer whose actor generates on a rollout set elsewhere has no generation here.
    generate_nodes = [n for n in job.dataflow.nodes if n.role in roles
                      and n.operation == "generate" and not job.generation_elsewhere]
    transition_group = group_of[generate_nodes[0].name] if generate_nodes else None
    # The framework's offload of trained states happens around the set's first generation.
    # So do the copies of a layout that keeps the actor's parameters in host memory (they come
    # in for the weight update): both are charged to the set's first generation.
    ctx = _SetContext(job=job, profile=job.cluster.profile(), group_of=group_of,
                      groups=len(groups), usable_bytes=usable_bytes, gpus=gpus, prune=prune,
                      generation_cache={} if generation_cache is None else generation_cache,
                      generate_nodes=generate_nodes, offload_group=transition_group)
    others = [r for r in roles if not any(n.role == r for n in generate_nodes)]
    generators = [r for r in roles if r not in others]
    order = [*others, *generators]
    matrices = {r: _contribution_matrix(candidates[r], group_of, len(groups),
                                        transition_group if r in generators else None,
                                        ctx.offload_group)
                for r in order}
    labels = {r: [plan_label(c.plan) for c in candidates[r]] for r in order}
    job_order = [r for r in job.gpu_roles if r in roles]

    def label_of(picks: np.ndarray) -> tuple[str, ...]:
        chosen = {order[i]: labels[order[i]][int(k)] for i, k in enumerate(picks)}
        return tuple(chosen.get(r, "") for r in job_order)

    combos = _Combos(contributions=np.zeros((1, len(groups))), resident=np.zeros(1),
                     transient=np.zeros(1), picks=np.zeros((1, 0), dtype=int),
                     offload=np.zeros(1))
    for role in others:
        combos = _fold(combos, candidates[role], matrices[role], usable_bytes, prune, label_of,
                       count_offload=ctx.offload_group is not None)
    if generators:
        (actor_role,) = generators
        combos = _with_actor(ctx, combos, actor_role, candidates[actor_role],
                             matrices[actor_role])
        if combos is None:
            return []
        selected = np.arange(len(combos.resident))
    else:
        selected = np.flatnonzero(combos.resident + combos.transient <= usable_bytes)
    if prune and len(selected) > 1:
        selected = _least_memory_among_equals(combos, selected, label_of)
    return [_set_point(combos, row, order, candidates, roles) for row in selected]


def _with_actor(ctx: _SetContext, combos: _Combos, actor_role: str,
                actor: list[RoleCandidate], matrix: np.ndarray) -> _Combos | None:
    """The other models' combinations completed with each config of the generating actor:
    what fits, with each generate node's seconds at the running cap the memory left allows
    (None when nothing fits)."""
    rows: list[_Combos] = []
    leaders = _Leaders(ctx.groups)
    by_generation, twins = _generation_families(actor)
    for gen, indices in by_generation.items():
        rows.extend(_actor_rows(ctx, combos, actor_role, actor, matrix, gen, indices, twins,
                                leaders))
    if not rows:
        return None
    residents = np.concatenate([r.resident for r in rows])
    return _Combos(contributions=np.concatenate([r.contributions for r in rows]),
                   resident=residents, transient=np.concatenate([r.transient for r in rows]),
                   picks=np.concatenate([r.picks for r in rows]),
                   offload=np.zeros(len(residents)))


def _generation_families(actor: list[RoleCandidate],
                         ) -> tuple[dict[GenerationConfig, list[int]], dict[int, int]]:
    """The actor's configs grouped by generation config, and each freeing config's kept-cache
    twin (by index).

    A config whose engine keeps its cache is its freeing twin's config with the sleep and
    wake taken out and the engine's allocation held through the other operations: it is
    priced from its twin's group (the memory and decode work are shared). Plans are matched
    by (layout, backend, generation): RolePlan's fields, as tuples, so that no RolePlan is
    built per candidate."""
    by_generation: dict[GenerationConfig, list[int]] = {}
    freeing: dict[tuple, list[int]] = {}
    for i, c in enumerate(actor):
        if c.plan.generation is not None and c.plan.generation.free_cache is True:
            freeing.setdefault((c.plan.parallel, c.plan.training_backend, c.plan.generation),
                               []).append(i)
    twin_of: dict[int, int] = {}
    with_cache: dict[GenerationConfig, GenerationConfig] = {}
    for i, c in enumerate(actor):
        gen = c.plan.generation
        if gen is not None and gen.free_cache is False:
            twin = with_cache.get(gen)
            if twin is None:
                twin = with_cache[gen] = replace(gen, free_cache=True)
            twins = freeing.get((c.plan.parallel, c.plan.training_backend, twin))
            if twins:
                for t in twins:
                    twin_of[t] = i
                continue
        # a kept-cache config without a freeing twin (pinned) is priced alone
        by_generation.setdefault(gen, []).append(i)  # type: ignore[arg-type]
    return by_generation, twin_of


@dataclass(slots=True)
class _ActorMemory:
    """Per (combination, actor config) of one generation config: bytes per GPU."""

    resident: np.ndarray
    transient: np.ndarray
    extra: np.ndarray
    """Generation weights beyond the actor's resident training shard."""
    offloaded: np.ndarray
    during: np.ndarray
    """Resident while the engine runs (the offloaded states are out)."""


@dataclass(slots=True)
class _EngineFit:
    """What the generate nodes need and take, per (combination, actor config)."""

    ok: np.ndarray
    """Whether the longest sequence fits every node's KV cache."""
    allocation: np.ndarray
    """The engine's allocation while idle (as simulator.predict.held_engine_bytes)."""
    peak_bytes: np.ndarray
    sleep_wake: np.ndarray
    """What keeping the cache saves, per group (seconds)."""
    added: list[tuple[int, np.ndarray]]
    """(group, seconds) of each generate node."""


def _actor_rows(ctx: _SetContext, combos: _Combos, actor_role: str,
                actor: list[RoleCandidate], matrix: np.ndarray, gen: GenerationConfig,
                indices: list[int], twins: dict[int, int], leaders: _Leaders,
                ) -> list[_Combos]:
    """The completed combinations of one generation config: its freeing configs and, where
    they fit, their kept-cache twins (a ``_Combos`` per variant with rows)."""
    idx = np.array(indices)
    a_contrib = matrix[idx]
    kept_gen = replace(gen, free_cache=False)
    twin_of = np.array([twins.get(i, -1) for i in indices])
    memory = _actor_memory(ctx, combos, [actor[i] for i in indices])
    fit = _engine_fit(ctx, actor_role, actor[indices[0]].plan, gen, kept_gen, memory)
    usable = ctx.usable_bytes
    held = fit.allocation if not frees_cache(ctx.job, gen) else 0.0
    within = fit.ok & (memory.during + fit.peak_bytes <= usable)
    variants = []
    if (twin_of >= 0).any():
        # Only the twins' columns have a kept variant.
        kept = within & (twin_of >= 0)[None, :] & (
            memory.resident + memory.transient + fit.allocation <= usable)
        variants.append((np.maximum(twin_of, 0), fit.allocation, fit.sleep_wake, kept))
        if ctx.prune and fit.sleep_wake.sum() > 0:
            # Where the kept variant fits, its durations are its freeing twin's less the
            # sleep and wake: the twin is dominated (pareto_mask would drop it).
            within = within & ~kept
    variants.append((idx, held, None, within & (memory.resident + memory.transient + held
                                                <= usable)))
    rows = []
    for picks, held_bytes, saved, fits in variants:
        o_idx, a_idx = np.nonzero(fits)
        if len(o_idx) == 0:
            continue
        # Column by column: the same sums as the rows' (c + a + generation - saved).
        columns = [combos.contributions[o_idx, j] + a_contrib[a_idx, j]
                   for j in range(ctx.groups)]
        for column, added in fit.added:
            columns[column] += added[o_idx, a_idx]
        if saved is not None:
            columns = [c - saved[j] for j, c in enumerate(columns)]
        if ctx.prune:
            keep = leaders.undominated(columns)
            columns, o_idx, a_idx = [c[keep] for c in columns], o_idx[keep], a_idx[keep]
        rows.append(_Combos(
            contributions=np.column_stack(columns),
            resident=memory.resident[o_idx, a_idx],
            transient=np.maximum(memory.transient + held_bytes,
                                 fit.peak_bytes - memory.offloaded)[o_idx, a_idx],
            picks=np.column_stack([combos.picks[o_idx], picks[a_idx]]),
            offload=np.zeros(len(o_idx))))
    return rows


def _actor_memory(ctx: _SetContext, combos: _Combos,
                  configs: list[RoleCandidate]) -> _ActorMemory:
    a_resident = np.array([c.resident.total for c in configs])
    a_transient = np.array([c.transient_bytes for c in configs])
    a_extra = np.array([c.extra_generation_bytes for c in configs])
    a_offload = np.array([c.offload_bytes if ctx.offload_group is not None else 0.0
                          for c in configs])
    resident = combos.resident[:, None] + a_resident[None, :]
    offloaded = combos.offload[:, None] + a_offload[None, :]
    return _ActorMemory(resident=resident,
                        transient=np.maximum(combos.transient[:, None], a_transient[None, :]),
                        extra=np.broadcast_to(a_extra[None, :], resident.shape),
                        offloaded=offloaded, during=resident - offloaded)


def _engine_fit(ctx: _SetContext, actor_role: str, plan: RolePlan, gen: GenerationConfig,
                kept_gen: GenerationConfig, memory: _ActorMemory) -> _EngineFit:
    """Each generate node's KV budget, running cap and seconds, per (combination, config);
    the seconds are priced only for the pairs that fit (most would not)."""
    job = ctx.job
    model = job.model(actor_role)
    engine_weights = generation_weight_bytes(model, gen, job.workload.dtype)
    shape = memory.resident.shape
    ok = np.maximum(memory.resident + memory.transient,
                    memory.during + memory.extra) <= ctx.usable_bytes
    fit = _EngineFit(ok=ok, allocation=np.zeros(shape), peak_bytes=np.zeros(shape),
                     sleep_wake=np.zeros(ctx.groups), added=[])
    for node in ctx.generate_nodes:
        table, lengths = _generation_table(job, node, plan, ctx.gpus, ctx.generation_cache)
        # Same rule as simulator.predict.kv_budget_bytes, vectorised.
        budget = np.minimum(
            gen.memory_utilization * ctx.profile.memory_bytes - engine_weights
            - (table.workspace_bytes if job.rollout.workspace_in_memory_fraction else 0.0),
            ctx.usable_bytes - memory.during - memory.extra - table.workspace_bytes)
        capacity = np.maximum(budget, 0.0) / table.kv_bytes_per_token
        fit.ok &= capacity >= table.longest_tokens
        fit.allocation = np.maximum(fit.allocation, memory.extra + np.maximum(budget, 0.0)
                                    + table.workspace_bytes)
        fit.sleep_wake[ctx.group_of[node.name]] += (
            generation_fixed_seconds(job, model, gen)
            - generation_fixed_seconds(job, model, kept_gen)) * host_slowdown(job, ctx.gpus)
        top_cap = min(gen.max_num_seqs, table.sequences)
        caps = np.clip(np.floor(capacity / (job.workload.prompt_length + table.mean_response)),
                       1, top_cap).astype(int)
        # Same rule as simulator.costs.generation.running_cap, vectorised. The caps lie in
        # [1, top_cap]: each one met is priced once (ascending), then read back by index.
        # (0 marks the pairs that do not fit: np.where over the whole matrix is cheaper than
        # boolean gathers and scatters.)
        met = np.where(fit.ok, caps, 0)
        seconds = np.zeros(top_cap + 1)
        peak_kv_bytes = np.zeros(top_cap + 1)
        for cap in np.flatnonzero(np.bincount(met.ravel(), minlength=top_cap + 1)[1:]) + 1:
            seconds[cap] = _generation_seconds(job, node, gen, lengths, table, int(cap),
                                               ctx.gpus)
            peak_kv_bytes[cap] = table.peak_kv_bytes_by_cap[int(cap)]
        fit.added.append((ctx.group_of[node.name], seconds[met]))
        peak = memory.extra + peak_kv_bytes[met] + table.workspace_bytes
        fit.peak_bytes = np.where(fit.ok, np.maximum(fit.peak_bytes, peak), fit.peak_bytes)
    return fit


def _least_memory_among_equals(combos: _Combos, selected: np.ndarray,
                               label_of: Callable[[np.ndarray], tuple[str, ...]],
                               ) -> np.ndarray:
    """The non-dominated rows of ``selected``; among equal duration vectors the least memory,
    then the smallest configs: the order Candidate.sort_key uses, so pruning never drops the
    plan a full search keeps."""
    def key_of(rows: np.ndarray) -> list:
        return [(rounded(float(combos.resident[row])), rounded(float(combos.transient[row])),
                 label_of(combos.picks[row])) for row in selected[rows]]

    return selected[pareto_mask(combos.contributions[selected], key_of=key_of)]


def _set_point(combos: _Combos, row: int, order: list[str],
               candidates: dict[str, list[RoleCandidate]], roles: Sequence[str]) -> SetPoint:
    chosen = [candidates[role][int(k)] for role, k in zip(order, combos.picks[row],
                                                        strict=True)]
    resident = sum((c.resident for c in chosen), MemoryBreakdown())
    transient_bytes = float(combos.transient[row])
    plans = tuple(sorted(((c.role, c.plan) for c in chosen),
                         key=lambda item: list(roles).index(item[0])))
    return SetPoint(durations=tuple(float(x) for x in combos.contributions[row]), plans=plans,
                    peak=resident + MemoryBreakdown(activations=transient_bytes),
                    resident_bytes=float(combos.resident[row]),
                    transient_bytes=transient_bytes)
