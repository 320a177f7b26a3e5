"""Single controller: Ray placement groups per colocated set, one fused worker per GPU, and
role handles that dispatch a call by the protocol its worker method declares.

Calls are asynchronous: ``handle.method(batch)`` returns a ``Pending`` at once, so calls on
different sets run in parallel; calls on one set run in the order they were made (a Ray actor
runs its calls one by one), which is the calling-order semantics the simulator assumes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from executor.batch import Batch
from executor.protocols import (
    Protocol,
    RankLayout,
    chunks_needed,
    collect_ranks,
    dispatch,
    protocol_of,
)
from executor.roles import ROLE_CLASSES, RoleConfig
from executor.worker import SetWorker
from profiles.datafile import SpecError
from simulator.plan import ColocatedSet


@dataclass
class CallRecord:
    """What one call cost, as seen by the controller and by the workers."""

    node: str
    role: str
    operation: str
    location: int
    dispatch_start: float
    """time.time() when the controller began splitting and sending."""
    collected: float = 0.0
    """time.time() when the controller had the result."""
    infos: list[dict[str, Any]] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0

    @property
    def wall_seconds(self) -> float:
        return self.collected - self.dispatch_start

    @property
    def compute_seconds(self) -> float:
        return max((i["compute_seconds"] for i in self.infos), default=0.0)

    @property
    def compute_start(self) -> float:
        return min((i["start"] for i in self.infos), default=self.dispatch_start)

    @property
    def compute_end(self) -> float:
        return max((i["end"] for i in self.infos), default=self.collected)


class WorkerFailedError(RuntimeError):
    """A rank failed during a call: the operation, where it ran, and the cause in one line."""

    def __init__(self, operation: str, location: int, rank: int, cause: str):
        super().__init__(f"{operation} (set {location}, rank {rank}): {cause}")
        self.operation = operation
        self.location = location
        self.rank = rank
        self.cause = cause


def failure_cause(exc: BaseException) -> str:
    """The first line of what went wrong on a worker (its own exception when it raised)."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        inner = exc.cause
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {text[0] if text else ''}".rstrip(": ")
    if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.WorkerCrashedError):
        return f"the worker died ({type(exc).__name__})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


FAILURE_GRACE_SECONDS = 5.0
"""After a rank fails, how long to wait for the others' outcome to tell cause from effect."""


def _failure_rank(exc: BaseException) -> int:
    """0: the worker died; 1: it raised an error of its own; 2: a communication error (a
    peer that died or raised)."""
    import ray

    if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.WorkerCrashedError):
        return 0
    text = failure_cause(exc).lower()
    communication = ("connection reset", "connection closed", "gloo", "nccl", "timed out",
                     "broken pipe")
    return 2 if any(word in text for word in communication) else 1


class Pending:
    """A call in flight; ``result()`` collects it (once) and completes its record."""

    def __init__(self, ray: Any, result_refs: list, info_refs: list, ranks: list[int],
                 merge: Callable[[list[Any]], Any], record: CallRecord,
                 on_done: Callable[[CallRecord], None], trim: int = 0,
                 clock_offsets: list[float] | None = None):
        self._ray = ray
        self._result_refs = result_refs
        self._info_refs = info_refs
        self._ranks = ranks
        self._merge = merge
        self._trim = trim
        self.record = record
        self._on_done = on_done
        self._value: Any = None
        self._done = False
        self._clock_offsets = clock_offsets
        self._late = False

    def collected_late(self) -> Pending:
        """Mark a call the controller collects later than it finishes, on purpose
        (one-step-off's generation of the next batch, collected after the update): its wall
        time then ends when its last rank ended (on the controller's clock), not at its
        collection, which would read as controller overhead."""
        self._late = True
        return self

    def _raise_first_failure(self) -> None:
        """Wait for every rank, raising as soon as one failed (the others may be blocked in a
        collective with it and would never return). Ranks that fail with it within a few
        seconds are named too, the likely root cause first: a worker that died, then an
        error of its own, then the peers' communication errors it caused."""
        # A failed call fails both its returns: watching the (small) records is enough.
        rank_of = {ref: r for r, ref in enumerate(self._info_refs)}
        pending = list(rank_of)
        failures: dict[int, BaseException] = {}
        while pending and not failures:
            ready, pending = self._ray.wait(pending, num_returns=len(pending), timeout=1.0)
            failures.update(self._failed(ready, rank_of))
        if not failures:
            return
        if pending:
            ready, _ = self._ray.wait(pending, num_returns=len(pending),
                                      timeout=FAILURE_GRACE_SECONDS)
            failures.update(self._failed(ready, rank_of))
        ranked = sorted(failures.items(), key=lambda item: (_failure_rank(item[1]), item[0]))
        rank, exc = ranked[0]
        cause = failure_cause(exc)
        if len(ranked) > 1:
            cause += "; also failed: " + ", ".join(
                f"rank {r} ({failure_cause(e)[:60]})" for r, e in ranked[1:])
        raise WorkerFailedError(f"{self.record.role}.{self.record.operation}",
                                self.record.location, rank, cause)

    def _failed(self, refs: list, rank_of: dict) -> dict[int, BaseException]:
        out = {}
        for ref in refs:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayError as exc:
                out[rank_of[ref]] = exc
        return out

    def first_rank_result(self) -> Any:
        """Rank 0's own result (after ``result()``), where the merged one averages the
        ranks' metrics."""
        return self._ray.get(self._result_refs[0])

    def result(self) -> Any:
        if not self._done:
            self._raise_first_failure()
            wanted = [self._result_refs[r] for r in self._ranks]
            fetched = self._ray.get(wanted + list(self._info_refs))
            parts, self.record.infos = fetched[:len(wanted)], fetched[len(wanted):]
            self.record.collected = time.time()
            if self._clock_offsets is not None:
                # Each worker timed itself by its own clock: onto the controller's.
                for info, offset in zip(self.record.infos, self._clock_offsets, strict=True):
                    info["start"] -= offset
                    info["end"] -= offset
            if self._late:
                self.record.collected = min(self.record.collected, self.record.compute_end)
            value = self._merge(parts)
            if self._trim and isinstance(value, Batch):
                value = value.rows(slice(0, len(value) - self._trim))
            if isinstance(value, Batch) and "response_mask" in value:
                self.record.tokens = count_tokens(value)  # generation: now with responses
            self._value = value
            self._done = True
            self._on_done(self.record)
        return self._value


def wait_together(calls: list[Pending]) -> None:
    """Wait for calls whose ranks take part in one collective across worker groups (a
    weight sync): stop at the first rank of any of them that fails, since its peers in the
    other group would wait for it until the collective's timeout."""
    ray = calls[0]._ray
    owner = {ref: call for call in calls for ref in call._info_refs}
    pending = list(owner)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                owner[ref]._raise_first_failure()


INLINE_BYTES = 256 * 1024
"""Payloads up to this size are sent with the call instead of through ray.put."""


def _nbytes(payload: Any) -> int:
    return payload.nbytes() if isinstance(payload, Batch) else INLINE_BYTES + 1


def count_tokens(batch: Batch) -> int:
    """Real tokens of a batch: prompts without their left padding plus unpadded responses."""
    if "prompt_mask" in batch:
        prompt = int(batch["prompt_mask"].sum())
    elif "prompts" in batch:
        prompt = int(batch["prompts"].numel())
    else:
        prompt = len(batch) * int(batch.meta.get("prompt_length", 0))
    if "response_mask" in batch:
        return prompt + int(batch["response_mask"].sum())
    return prompt if "prompts" in batch or "prompt_mask" in batch else 0


def _merge(kind: Protocol) -> Callable[[list[Any]], Any]:
    def merge(parts: list[Any]) -> Any:
        if parts and all(isinstance(p, Batch) for p in parts):
            if any(len(p) for p in parts):
                return Batch.concat(parts)
            # Metrics only (training steps): average what the collected ranks report.
            keys = {k for p in parts for k in p.meta}
            return Batch(meta={k: sum(p.meta.get(k, 0.0) for p in parts) / len(parts)
                               for k in keys})
        return parts
    return merge


CLOCK_SAMPLES = 5
"""Round trips per worker when estimating its clock's offset."""


def offset_from_samples(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """A worker clock's offset from the controller's, seconds, and its uncertainty: from
    (controller send, worker time, controller receive) samples, the one with the shortest
    round trip, assuming the worker read its clock at the trip's midpoint (error at most
    half the round trip)."""
    send, worker, receive = min(samples, key=lambda s: s[2] - s[0])
    return worker - (send + receive) / 2, (receive - send) / 2


def clock_offset(read_worker_clock: Callable[[], float],
                 samples: int = CLOCK_SAMPLES) -> tuple[float, float]:
    """Measure a worker clock's (offset, uncertainty) in seconds by timed round trips."""
    readings = []
    for _ in range(samples):
        send = time.time()
        worker = read_worker_clock()
        readings.append((send, worker, time.time()))
    return offset_from_samples(readings)


class WorkerGroup:
    """The workers of one colocated set: a placement group of GPU bundles, one fused worker
    per bundle, forming one torch.distributed group."""

    def __init__(self, ray: Any, index: int, colocated: ColocatedSet,
                 setup: str | None = None, node_ids: list[str] | None = None,
                 form: bool = True):
        """``node_ids``: the Ray node of each rank's bundle (``executor.placement``); ranks
        then follow the plan's GPU order. Without it, Ray packs the bundles where it likes
        and ranks are ordered by node, then GPU. ``form=False`` only asks Ray for the
        bundles and the workers (nothing is waited for): several groups then start their
        processes at once, and each is ready once ``form()`` returns."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from executor.placement import NODE_ID_LABEL

        self.ray = ray
        self.index = index
        self.colocated = colocated
        self._ordered_by_plan = bool(node_ids)
        selectors = [{NODE_ID_LABEL: node} for node in node_ids] if node_ids else None
        self.placement_group = placement_group([{"GPU": 1}] * colocated.gpus,
                                               strategy="PACK",
                                               bundle_label_selector=selectors)
        remote = ray.remote(SetWorker)
        # Rank order until form() knows where each landed (shutdown() needs them before).
        self.workers = [
            remote.options(num_gpus=1, num_cpus=0, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self.placement_group,
                                                 placement_group_bundle_index=i)))
            .remote(colocated.gpus, index, setup)
            for i in range(colocated.gpus)]
        self.nodes: list[str] = []
        """Ray node id of each rank."""
        self.addresses: list[str] = []
        """Node IP address of each rank."""
        self.clock_offsets: list[tuple[float, float]] = []
        """Per rank: (worker clock - controller clock, uncertainty), seconds."""
        if form:
            self.form()

    def form(self) -> None:
        """Wait for the bundles and the workers, order the ranks and form the set's
        torch.distributed group."""
        ray, workers = self.ray, self.workers
        ray.get(self.placement_group.ready(), timeout=600)
        locations = ray.get([w.location.remote() for w in workers])
        if self._ordered_by_plan:
            order = list(range(len(workers)))
        else:
            # Consecutive ranks (a tensor-parallel group) share a node whenever the placement
            # group gave each node whole groups.
            order = sorted(range(len(workers)), key=lambda i: (locations[i], i))
        self.workers = [workers[i] for i in order]
        self.nodes = [locations[i][0] for i in order]
        self.addresses = [locations[i][1] for i in order]
        # One node: the loopback interface (always there); several: rank 0's node address.
        host = "127.0.0.1" if len(set(self.nodes)) == 1 else self.addresses[0]
        port = ray.get(self.workers[0].open_rendezvous.remote(host))
        ray.get([w.join.remote(f"{host}:{port}", rank) for rank, w in enumerate(self.workers)])
        self.clock_offsets = [clock_offset(lambda w=w: ray.get(w.clock.remote()))
                              for w in self.workers]

    def check_groups_share_nodes(self, size: int, what: str) -> None:
        """Raise if any group of ``size`` consecutive ranks spans two nodes (tensor-parallel
        traffic would leave NVLink)."""
        for start in range(0, len(self.nodes), size):
            if len(set(self.nodes[start:start + size])) > 1:
                raise SpecError(
                    f"ranks {start}-{start + size - 1} ({what}) landed on nodes "
                    f"{sorted(set(self.nodes[start:start + size]))}; Ray's placement group did "
                    "not give each node whole groups. Free whole nodes for this set or lower "
                    "tp", key=f"sets[{self.index}]")

    def build(self, config: RoleConfig) -> list[dict[str, Any]]:
        return self.ray.get(self.start_build(config))

    def start_build(self, config: RoleConfig) -> list[Any]:
        """Ask every rank to build ``config``'s role; the result references (a group's
        workers build in the order they are asked, other groups' at the same time)."""
        return [w.build.remote(config) for w in self.workers]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the group's workers: ``graceful`` lets each close its process groups first;
        after a worker failed, the others may sit in a collective with it, where that call
        would wait its whole timeout, so they are killed outright."""
        from ray.util.placement_group import remove_placement_group

        if graceful:
            with contextlib.suppress(Exception):
                self.ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        for worker in self.workers:
            self.ray.kill(worker)
        remove_placement_group(self.placement_group)


class RoleHandle:
    """The controller's view of one role: ``handle.op(batch)`` -> ``Pending``."""

    def __init__(self, group: WorkerGroup, role: str, layout: RankLayout,
                 on_done: Callable[[CallRecord], None], node_names: dict[str, str],
                 label: str | None = None):
        """``label``: the role its records name (default ``role``; the rollout set's
        generator records as the actor, the simulator's role of that stage)."""
        self.group = group
        self.role = role
        self.label = label or role
        self.layout = layout
        self.cls = ROLE_CLASSES[role]
        self._on_done = on_done
        self._node_names = node_names

    def __getattr__(self, method: str) -> Callable[..., Pending]:
        if method.startswith("_"):
            raise AttributeError(method)
        kind = protocol_of(self.cls, method)

        def call(payload: Any, node: str | None = None, record: bool = True) -> Pending:
            """``record``: add the call's record to the run's (False: the caller records
            it, e.g. one record for a transfer made of calls on two sets)."""
            ray = self.group.ray
            on_done = self._on_done if record else (lambda _record: None)
            record_ = CallRecord(node=node or self._node_names.get(method,
                                                                   f"{self.label}.{method}"),
                                 role=self.label, operation=method,
                                 location=self.group.index, dispatch_start=time.time())
            trim = 0
            if isinstance(payload, Batch) and kind is not Protocol.ONE_TO_ALL:
                record_.sequences = len(payload)
                record_.tokens = count_tokens(payload)
                payload, trim = payload.pad_rows(chunks_needed(kind, self.layout))
            chunks, assignment = dispatch(kind, self.layout, payload)
            # Big chunks go through the object store once, however many ranks read them;
            # small ones ride inside the call.
            refs = [ray.put(c) if _nbytes(c) > INLINE_BYTES else c for c in chunks]
            calls = [w.call.options(num_returns=2).remote(self.role, method, refs[assignment[r]])
                     for r, w in enumerate(self.group.workers)]
            result_refs = [c[0] for c in calls]
            info_refs = [c[1] for c in calls]
            return Pending(ray, result_refs, info_refs, collect_ranks(kind, self.layout),
                           _merge(kind), record_, on_done, trim,
                           [offset for offset, _ in self.group.clock_offsets])

        return call
