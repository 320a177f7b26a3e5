"""Event simulation of RLHF iterations with SimPy.

Each colocated set runs one operation at a time (colocated models time-share their GPUs,
HybridFlow §2.3) in the controller's calling order; sets run in parallel as soon as their inputs
are ready; the controller is a location of its own. Data moving between sets and the actor's
train -> generate transition are events on the timeline too. The ordering rules are those of
``simulator.schedule``: explicit calling order, so simultaneous events never depend on the order
in which processes happened to be created.

The paper's cost function (HybridFlow §6 ``d_cost``: sum within a set, max across sets, stages
summed; no transition, no transfers, no overlap across stages) is available as
``mode="paper"`` to compare on the same plan.
"""

from __future__ import annotations

import simpy

from profiles.datafile import SpecError
from simulator.asynchronous import simulate_async
from simulator.plan import Plan, job_as_planned
from simulator.predict import CONTROLLER_LOCATION, PlanEstimate
from simulator.schedule import dataflow_steps, makespan
from simulator.specs.dataflow import Dataflow, Node
from simulator.specs.job import JobSpec
from simulator.timeline import (
    EventKind,
    Mode,
    SimulationResult,
    TimelineEvent,
    lane_of,
    simulation_result,
)


def _gpus(plan: Plan, location: int) -> int:
    return 0 if location == CONTROLLER_LOCATION else plan.sets[location].gpus


def simulate_des(job: JobSpec, plan: Plan, estimate: PlanEstimate, *,
                 iterations: int = 1, overlap_iterations: bool = False) -> SimulationResult:
    """Discrete-event simulation of ``iterations`` RLHF iterations.

    Synchronous by default, as verl, OpenRLHF and NeMo-RL run them: an iteration starts when
    the previous one has ended (the controller collects every update before the next
    generation). ``overlap_iterations`` lifts that barrier: a node waits only for its inputs,
    its location and the weights it needs (a critic update on other GPUs may then run beside
    the next generation, an asynchronous mode)."""
    if not estimate.feasible:
        return simulation_result("des", job, plan, estimate, [], iterations)
    dataflow: Dataflow = job.dataflow
    env = simpy.Environment()
    done: list[dict[str, simpy.Event]] = [
        {node.name: env.event() for node in dataflow.nodes} for _ in range(iterations)]
    ends: dict[tuple[int, str], float] = {}
    events: list[TimelineEvent] = []
    first_generate = next(n.name for n in dataflow.nodes
                          if n.role == "actor" and n.operation == "generate")
    trained = set(dataflow.trained_roles)
    # Calling order at each location: iteration by iteration, nodes in dataflow order.
    previous: dict[tuple[int, str], tuple[int, str] | None] = {}
    last_at: dict[int, tuple[int, str]] = {}
    for iteration in range(iterations):
        for node in dataflow.nodes:
            location = estimate.nodes[node.name].location
            previous[(iteration, node.name)] = last_at.get(location)
            last_at[location] = (iteration, node.name)

    def record(iteration: int, location: int, role: str, operation: str, node: str,
               kind: EventKind, start: float, end: float) -> None:
        lane = "network" if kind == "transfer" else lane_of(plan, location, job)
        events.append(TimelineEvent(iteration=iteration, location=location, lane=lane,
                                    role=role, operation=operation, node=node, kind=kind,
                                    start=start, end=end, gpus=_gpus(plan, location)))

    def run(iteration: int, name: str) -> simpy.events.ProcessGenerator:
        node = dataflow.node(name)
        est = estimate.nodes[name]
        inputs = [(iteration, dep) for dep in node.after]
        waits = [done[iteration][dep] for dep in node.after]
        if iteration > 0 and node.role in trained:
            # A trained model's next use needs the weights of its previous update.
            waits += [done[iteration - 1][n.name] for n in dataflow.nodes
                      if n.role == node.role and n.operation == "train"]
        if iteration > 0 and name == first_generate:
            waits += [done[iteration - 1][n.name] for n in dataflow.nodes
                      if n.role == "actor" and n.operation == "train"]
        if iteration > 0 and not overlap_iterations:
            waits += [done[iteration - 1][n.name] for n in dataflow.nodes]
        if waits:
            yield simpy.AllOf(env, waits)
        # Inputs from other locations arrive a transfer after their producer ended.
        arrivals = []
        for key in inputs:
            transfer = estimate.transfers.get((key[1], name), 0.0)
            arrivals.append(ends[key] + transfer)
            if transfer > 0:
                record(iteration, est.location, node.role, "transfer", f"{key[1]}->{name}",
                       "transfer", ends[key], ends[key] + transfer)
        if arrivals and max(arrivals) > env.now:
            yield env.timeout(max(arrivals) - env.now)
        before = previous[(iteration, name)]
        if before is not None:
            yield done[before[0]][before[1]]
        if name == first_generate and estimate.transition is not None:
            start = env.now
            yield env.timeout(estimate.transition.seconds)
            record(iteration, est.location, "actor", "transition", "actor.transition",
                   "transition", start, env.now)
        start = env.now
        yield env.timeout(est.seconds)
        record(iteration, est.location, node.role, node.operation, name, "compute", start,
               env.now)
        ends[(iteration, name)] = env.now
        done[iteration][name].succeed()

    for iteration in range(iterations):
        for node in _creation_order(dataflow.nodes):
            env.process(run(iteration, node.name))
    env.run()
    return simulation_result("des", job, plan, estimate, events, iterations)


def _creation_order(nodes: tuple[Node, ...]) -> list[Node]:
    """Order in which node processes are created. It must not matter (each location follows
    the calling order); tests reverse it to prove that."""
    return list(nodes)


def iteration_seconds(job: JobSpec, estimate: PlanEstimate) -> float:
    """One iteration's time by the rules of ``simulator.schedule`` without running SimPy
    (the search's fast path; equal to ``simulate_des(...).iteration_seconds``)."""
    nodes = job.dataflow.nodes
    names = [n.name for n in nodes]
    steps = dataflow_steps(names, {n.name: n.after for n in nodes},
                           {name: estimate.nodes[name].location for name in names},
                           estimate.transfers)
    first_generate = next(n.name for n in nodes if n.role == "actor" and n.operation == "generate")
    transition = estimate.transition.seconds if estimate.transition is not None else 0.0
    durations = [estimate.nodes[name].seconds + (transition if name == first_generate else 0.0)
                 for name in names]
    return makespan(steps, durations)


def simulate_paper(job: JobSpec, plan: Plan, estimate: PlanEstimate) -> SimulationResult:
    """HybridFlow's d_cost: for each stage, sum the nodes within a set and take the max over
    sets; stages run one after another. Controller work, transfers and the transition are
    left out, as in the paper."""
    events: list[TimelineEvent] = []
    if not estimate.feasible:
        return simulation_result("paper", job, plan, estimate, events, 1)
    now = 0.0
    for stage in ("generation", "preparation", "training"):
        longest = 0.0
        for location in range(len(plan.sets)):
            cursor = now
            for node in job.dataflow.nodes:
                est = estimate.nodes[node.name]
                if node.stage != stage or est.location != location:
                    continue
                events.append(TimelineEvent(
                    iteration=0, location=location, lane=lane_of(plan, location, job),
                    role=node.role,
                    operation=node.operation, node=node.name, kind="compute", start=cursor,
                    end=cursor + est.seconds, gpus=_gpus(plan, location)))
                cursor += est.seconds
            longest = max(longest, cursor - now)
        now += longest
    return simulation_result("paper", job, plan, estimate, events, 1)


def simulate(job: JobSpec, plan: Plan, *, mode: Mode = "des", iterations: int = 1,
             transition_scheme: str | None = None,
             overlap_iterations: bool = False) -> SimulationResult:
    """Validate ``plan`` against ``job``, predict every node, and simulate."""
    from simulator.predict import estimate_plan

    plan.validate(job)
    job = job_as_planned(job, plan)
    estimate = estimate_plan(job, plan, transition_scheme=transition_scheme)  # type: ignore[arg-type]
    return simulate_estimated(job, plan, estimate, mode=mode, iterations=iterations,
                              overlap_iterations=overlap_iterations)


def simulate_estimated(job: JobSpec, plan: Plan, estimate: PlanEstimate, *, mode: Mode = "des",
                       iterations: int = 1, overlap_iterations: bool = False) -> SimulationResult:
    """Simulate a plan whose nodes are already predicted, in the plan's own mode: the
    asynchronous simulation for a plan with a rollout set of its own (``iterations`` 1 means
    enough iterations to reach its steady state, as ``plan`` prices it), else the synchronous
    event simulation or the paper's cost function. Every command prices a plan through here,
    so ``simulate`` reproduces what ``plan`` wrote."""
    if plan.rollout is not None:
        if mode == "paper":
            raise SpecError("the paper's cost function prices synchronous plans only "
                            f"(this plan runs {plan.mode}); use --cost-model des", key="mode")
        return simulate_async(job, plan, estimate, iterations=iterations if iterations > 1
                              else None)
    if mode == "paper":
        return simulate_paper(job, plan, estimate)
    return simulate_des(job, plan, estimate, iterations=iterations,
                        overlap_iterations=overlap_iterations)
