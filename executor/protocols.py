"""Transfer protocols between the single controller and a worker group (HybridFlow §4.1,
Table 3), declared on the worker method with ``@protocol(...)``.

Ranks of a worker group are laid out as the roles build their models, in Megatron's order:
training rank ``r = (pp_index * dp + dp_index) * tp + tp_index`` (pp = 1 for the torch
backend). For generation (pp_g = 1) the ranks of one training replica holding the same
generation tp index form its micro-DP group: the tp index splits into
``gen_tp_index * (tp / gen_tp) + i`` and the micro-DP index is ``pp_index * (tp / gen_tp) + i``
(with pp = 1: micro-DP groups are consecutive ranks, generation TP groups take every
``micro_dp``-th rank, HybridFlow §5.3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from executor.batch import Batch

F = TypeVar("F", bound=Callable[..., Any])


class Protocol(StrEnum):
    ONE_TO_ALL = "one_to_all"
    """The same input to every rank; every rank's output returned (init, weights)."""
    DP = "dp"
    """The batch split over all ranks; every rank's output concatenated."""
    THREE_D = "3d"
    """The batch split over the data-parallel ranks, each chunk sent to every rank of that
    replica's tensor-parallel group; the output of tp rank 0 of each replica collected."""
    MICRO_DP = "micro_dp"
    """The batch split over generation replicas (data-parallel x micro-DP), each chunk sent to
    the replica's generation tensor-parallel group; generation tp rank 0 collected."""


def protocol(kind: Protocol) -> Callable[[F], F]:
    """Declare how a worker method's input is split and its output collected."""
    def mark(fn: F) -> F:
        fn.protocol = kind  # type: ignore[attr-defined]
        return fn
    return mark


def protocol_of(cls: type, method: str) -> Protocol:
    fn = getattr(cls, method, None)
    kind = getattr(fn, "protocol", None)
    if kind is None:
        raise AttributeError(f"{cls.__name__}.{method} is not a worker operation "
                             "(no @protocol)")
    return kind


@dataclass(frozen=True, slots=True)
class RankLayout:
    """One role's arrangement of the ranks of its worker group."""

    world: int
    dp: int
    tp: int
    gen_tp: int = 1
    pp: int = 1

    @property
    def micro_dp(self) -> int:
        """Generation replicas per training replica, d_g = pp * tp / gen_tp."""
        return self.pp * self.tp // self.gen_tp

    @property
    def replicas(self) -> int:
        """Generation replicas in the group."""
        return self.dp * self.micro_dp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp index, dp index, tp index) of a training rank."""
        rest, tp_index = divmod(rank, self.tp)
        pp_index, dp_index = divmod(rest, self.dp)
        return pp_index, dp_index, tp_index

    def dp_index(self, rank: int) -> int:
        return self.coordinates(rank)[1]

    def micro_dp_rank(self, rank: int) -> int:
        """Index of ``rank`` in its micro-DP group."""
        pp_index, _, tp_index = self.coordinates(rank)
        block = self.tp // self.gen_tp
        return pp_index * block + tp_index % block

    def replica_of(self, rank: int) -> int:
        return self.dp_index(rank) * self.micro_dp + self.micro_dp_rank(rank)

    def gen_tp_rank(self, rank: int) -> int:
        return (rank % self.tp) // (self.tp // self.gen_tp)


def dispatch(kind: Protocol, layout: RankLayout, payload: Any) -> tuple[list[Any], list[int]]:
    """Chunks of ``payload`` and, for every rank, the index of the chunk it receives."""
    if kind is Protocol.ONE_TO_ALL:
        return [payload], [0] * layout.world
    if not isinstance(payload, Batch):
        raise TypeError(f"{kind.value} splits a Batch, got {type(payload).__name__}")
    if kind is Protocol.DP:
        return payload.split(layout.world), list(range(layout.world))
    if kind is Protocol.THREE_D:
        return payload.split(layout.dp), [layout.dp_index(r) for r in range(layout.world)]
    return payload.split(layout.replicas), [layout.replica_of(r) for r in range(layout.world)]


def collect_ranks(kind: Protocol, layout: RankLayout) -> list[int]:
    """Ranks whose outputs make the result, in the order of the chunks."""
    if kind in (Protocol.ONE_TO_ALL, Protocol.DP):
        return list(range(layout.world))
    if kind is Protocol.THREE_D:
        # Pipeline stage 0, tp rank 0 of each replica (Megatron's last stage broadcasts).
        return [d * layout.tp for d in range(layout.dp)]
    ranks = [r for r in range(layout.world) if layout.gen_tp_rank(r) == 0]
    return sorted(ranks, key=layout.replica_of)


def chunks_needed(kind: Protocol, layout: RankLayout) -> int:
    """How many equal parts a batch must split into under ``kind``."""
    return {Protocol.ONE_TO_ALL: 1, Protocol.DP: layout.world, Protocol.THREE_D: layout.dp,
            Protocol.MICRO_DP: layout.replicas}[kind]
