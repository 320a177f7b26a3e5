"""What a simulation produces, whichever simulation made it: the timeline's events and the
result read from them (``simulator.engine``'s event simulation and the paper's cost function,
``simulator.asynchronous``'s asynchronous modes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from simulator.plan import Plan
from simulator.predict import CONTROLLER_LOCATION, PlanEstimate
from simulator.specs.job import JobSpec

Mode = Literal["des", "paper"]
EventKind = Literal["compute", "transition", "transfer", "sync"]


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One interval on the timeline."""

    iteration: int
    location: int
    """Colocated set index, or -1 for the controller."""
    lane: str
    """Display row: the set's roles ('actor,ref'), 'controller', or 'network'."""
    role: str
    operation: str
    node: str
    kind: EventKind
    start: float
    """Seconds from the start of the simulation."""
    end: float
    gpus: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """The simulated timeline and what is read from it."""

    mode: Mode
    iterations: int
    timeline: tuple[TimelineEvent, ...]
    iteration_seconds: float
    """Mean seconds per iteration (makespan / iterations)."""
    throughput_tokens_per_s: float
    """Prompt + response tokens per iteration / iteration seconds (HybridFlow's metric)."""
    stage_seconds: dict[str, float]
    """Seconds of each node (one iteration), plus 'actor.transition' when there is one."""
    idle_fraction: dict[str, float]
    """Per set label: fraction of the makespan its GPUs are idle."""
    peak_memory_bytes_per_gpu: float
    feasible: bool
    reasons: tuple[str, ...] = ()
    makespan_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def lane_of(plan: Plan, location: int, job: JobSpec | None = None) -> str:
    """The timeline lane of a location: the set's roles, or 'rollout' for an asynchronous
    plan's rollout set (and its device on a mixed cluster)."""
    if location == CONTROLLER_LOCATION:
        return "controller"
    s = plan.located_sets()[location]
    if job is None or job.cluster.is_homogeneous:
        return s.label()
    return f"{s.label()} ({job.cluster.device_of(s.node_group)})"


def simulation_result(mode: Mode, job: JobSpec, plan: Plan, estimate: PlanEstimate,
            events: list[TimelineEvent], iterations: int) -> SimulationResult:
    events.sort(key=lambda e: (e.start, e.location, e.node))
    makespan = max((e.end for e in events), default=0.0)
    iteration_seconds = makespan / iterations if iterations else 0.0
    stage_seconds = {name: n.seconds for name, n in estimate.nodes.items()}
    if mode == "des" and estimate.transition is not None:
        stage_seconds["actor.transition"] = estimate.transition.seconds
    idle: dict[str, float] = {}
    for i, s in enumerate(plan.sets):
        busy = sum(e.seconds for e in events if e.location == i and e.kind != "transfer")
        idle[s.label()] = 1.0 - busy / makespan if makespan > 0 else 0.0
    throughput = (estimate.tokens_per_iteration / iteration_seconds
                  if iteration_seconds > 0 and estimate.feasible else 0.0)
    return SimulationResult(
        mode=mode, iterations=iterations, timeline=tuple(events),
        iteration_seconds=iteration_seconds if estimate.feasible else float("inf"),
        throughput_tokens_per_s=throughput, stage_seconds=stage_seconds, idle_fraction=idle,
        peak_memory_bytes_per_gpu=estimate.peak_memory_bytes_per_gpu,
        feasible=estimate.feasible, reasons=estimate.reasons, makespan_seconds=makespan)
