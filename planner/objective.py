"""What the planner ranks plans by: iteration time, or dollars.

``throughput`` ranks by iteration time (tokens per second); ``cost`` by dollars per iteration
(tokens per dollar, since every plan of a job processes the same tokens); ``cost-at-deadline``
by dollars per iteration among the plans whose iteration ends within a deadline. Dollars are
GPU-hours times each node group's price: every GPU of the cluster when the user pays for the
whole cluster (unused GPUs still cost), or only the GPUs the plan's sets use (``pay_for:
used``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from profiles.datafile import SpecError, require
from simulator.specs.cluster import ClusterSpec, Pool
from simulator.specs.job import JobSpec

Objective = Literal["throughput", "cost", "cost-at-deadline"]
OBJECTIVES: tuple[str, ...] = ("throughput", "cost", "cost-at-deadline")
PayFor = Literal["cluster", "used"]
PAY_FOR: tuple[str, ...] = ("cluster", "used")
SECONDS_PER_HOUR = 3600.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Ranking:
    """How plans are ranked (``plan --objective``)."""

    objective: Objective = "throughput"
    """throughput: fastest iteration; cost: fewest dollars per iteration; cost-at-deadline:
    fewest dollars per iteration among plans no slower than the deadline."""
    pay_for: PayFor = "cluster"
    """cluster: every GPU of the cluster is paid for, used or not; used: only the GPUs the
    plan's colocated sets use."""
    deadline_seconds_per_iteration: float | None = None
    """cost-at-deadline: the slowest iteration allowed, in seconds."""

    def __post_init__(self) -> None:
        require(self.objective in OBJECTIVES, f"unknown objective {self.objective!r} (choose "
                f"{', '.join(OBJECTIVES)})", "objective")
        require(self.pay_for in PAY_FOR, f"unknown {self.pay_for!r} (choose "
                f"{' or '.join(PAY_FOR)})", "pay_for")
        deadline = self.deadline_seconds_per_iteration
        if self.objective == "cost-at-deadline":
            require(deadline is not None, "cost-at-deadline needs "
                    "--deadline-seconds-per-iteration", "deadline_seconds_per_iteration")
        if deadline is not None:
            require(math.isfinite(deadline) and deadline > 0,
                    f"must be a positive number of seconds, got {deadline}",
                    "deadline_seconds_per_iteration")

    @property
    def by_cost(self) -> bool:
        return self.objective != "throughput"

    def meets_deadline(self, iteration_seconds: float) -> bool:
        deadline = self.deadline_seconds_per_iteration
        return self.objective != "cost-at-deadline" or deadline is None or \
            iteration_seconds <= deadline * (1 + 1e-12)


def group_price_per_gpu_hour(cluster: ClusterSpec, index: int) -> float | None:
    """Dollars per GPU-hour of node group ``index``: the job's override, else its device
    profile's price (None when neither gives one)."""
    group = cluster.node_groups[index]
    if group.price_per_gpu_hour is not None:
        return group.price_per_gpu_hour
    return group.profile().price_per_gpu_hour


def pool_price_per_gpu_hour(cluster: ClusterSpec, pool: Pool) -> float | None:
    """A pool's price (its groups are identical, price included)."""
    return group_price_per_gpu_hour(cluster, pool.index)


def check_prices(job: JobSpec) -> None:
    """Raise SpecError naming the key when some node group has no price."""
    cluster = job.cluster
    for i, group in enumerate(cluster.node_groups):
        if group_price_per_gpu_hour(cluster, i) is None:
            key = "cluster.price_per_gpu_hour" if cluster.is_homogeneous else \
                f"cluster.node_groups[{i}].price_per_gpu_hour"
            raise SpecError(f"missing: device profile {group.profile().name!r} has no "
                            "price_per_gpu_hour; give the price of its GPUs (US dollars per "
                            "GPU per hour) to rank plans by cost", key=key)


def priced(job: JobSpec) -> bool:
    """Whether every node group of the job has a price."""
    return all(group_price_per_gpu_hour(job.cluster, i) is not None
               for i in range(len(job.cluster.node_groups)))


def cluster_dollars_per_second(cluster: ClusterSpec) -> float:
    """What the whole cluster costs per second, in dollars (every group priced)."""
    total = 0.0
    for i, group in enumerate(cluster.node_groups):
        price = group_price_per_gpu_hour(cluster, i)
        assert price is not None, "check_prices first"
        total += group.gpus * price
    return total / SECONDS_PER_HOUR


def sets_dollars_per_second(cluster: ClusterSpec,
                            sets: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> float:
    """What the GPUs of some sets cost per second, in dollars: ``sets`` lists each set's
    (node group, GPUs)."""
    total = 0.0
    for node_group, gpus in sets:
        price = group_price_per_gpu_hour(cluster, node_group)
        assert price is not None, "check_prices first"
        total += gpus * price
    return total / SECONDS_PER_HOUR


def plan_dollars_per_second(job: JobSpec, sets: list[tuple[int, int]] | tuple[tuple[int, int],
                                                                                ...],
                            pay_for: PayFor) -> float:
    """Dollars per second while a plan with these (node group, GPUs) sets runs."""
    if pay_for == "cluster":
        return cluster_dollars_per_second(job.cluster)
    return sets_dollars_per_second(job.cluster, sets)
