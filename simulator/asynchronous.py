"""Event simulation of asynchronous RLHF plans (one_step_off, async) over many iterations.

What runs where: the actor's generate nodes on the plan's rollout set (the location after the
training sets), everything else on the training sets as in a synchronous plan, and a weight
sync after every actor update that occupies both the actor's training set and the rollout set.

The rules, each an explicit ordering (no order depends on process creation):
- Rollout set: generates batch after batch; batch i needs the weights of update
  i - 1 - K (K = the plan's staleness; sync K = 0), i.e. that sync must have ended. Without
  partial rollouts the rollout finishes the batch in flight before a sync (its calling order is
  gen(0..K), then sync(j), gen(j + K + 1) for j = 0, 1, ...); with partial rollouts a sync
  interrupts the generation in flight, which resumes when the sync ends.
- Trainer: synchronous within itself (verl's trainer loop): iteration i's training-side nodes
  start after every training-side node of iteration i - 1 and its sync, each at its location in
  dataflow order, inputs arriving a transfer after their producer ended.
- Sync(i): after the actor's update of iteration i, on the actor's set after the set's last
  node of the iteration (verl's trainer syncs when its next step begins, after both updates)
  and on the rollout set.
- Streaming (``async``): a node that consumes a generation may start once the first of the
  iteration's mini-batches has arrived, and cannot end before the last one has arrived plus
  its own share of work for it (duration / mini-batches). Only the first consumers stream;
  the nodes after them wait for their whole inputs.

The steady-state step time is read after the pipeline fills: (end of the last iteration's
training - end of iteration K + 1's) / the iterations between. ``steady_step_seconds`` is
its closed form for the search: every resource's work per iteration, max(G + S, T_s), with
G the batch's generation, S the sync and T_s the trainer's makespan of one iteration with the
sync; the loop through staleness, (G + T_s) / (K + 1), never binds for K >= 1 (tests check
the two agree).
"""

from __future__ import annotations

import simpy

from simulator.plan import ROLLOUT_LABEL, Plan
from simulator.predict import CONTROLLER_LOCATION, PlanEstimate
from simulator.schedule import Step, dataflow_steps, makespan
from simulator.specs.job import JobSpec
from simulator.timeline import SimulationResult, TimelineEvent, lane_of, simulation_result

SYNC_NODE = "actor.weight_sync"
"""The weight sync's name on timelines and in measurements."""


def generate_names(job: JobSpec) -> list[str]:
    return [n.name for n in job.dataflow.nodes if n.operation == "generate"]


def trainer_names(job: JobSpec) -> list[str]:
    return [n.name for n in job.dataflow.nodes if n.operation != "generate"]


def last_actor_update(job: JobSpec) -> str:
    return [n.name for n in job.dataflow.nodes if n.role == "actor" and n.operation == "train"][-1]


def sync_seconds(estimate: PlanEstimate) -> float:
    return estimate.weight_sync.seconds if estimate.weight_sync is not None else 0.0


def generation_seconds(job: JobSpec, estimate: PlanEstimate) -> float:
    """G: the rollout set's seconds per batch (all its generate nodes)."""
    return sum(estimate.nodes[name].seconds for name in generate_names(job))


def trainer_steps(job: JobSpec, estimate: PlanEstimate) -> tuple[list[Step], list[float]]:
    """One iteration of the training side with the sync, as schedule steps: the generate nodes
    take no time at the rollout location and their batch is already across (it crossed
    while the trainer worked on the previous one), and the sync follows the actor's update
    and the other nodes of the actor's set (it is the set's last step)."""
    nodes = job.dataflow.nodes
    names = [n.name for n in nodes]
    after = {n.name: n.after for n in nodes}
    locations = {name: estimate.nodes[name].location for name in names}
    update = last_actor_update(job)
    names.append(SYNC_NODE)
    after[SYNC_NODE] = (update,)
    locations[SYNC_NODE] = locations[update]
    # In the steady state a batch crosses to the trainer while the trainer is still busy
    # with the previous one: its transfer is not on the trainer's cycle.
    gens = set(generate_names(job))
    transfers = {edge: seconds for edge, seconds in estimate.transfers.items()
                 if edge[0] not in gens}
    steps = dataflow_steps(names, after, locations, transfers)
    durations = [0.0 if estimate.nodes[name].operation == "generate" else
                 estimate.nodes[name].seconds for name in names[:-1]]
    durations.append(sync_seconds(estimate))
    return steps, durations


def trainer_seconds(job: JobSpec, estimate: PlanEstimate) -> float:
    """T_s: the training side's makespan of one iteration, sync included, from the moment its
    batch is generated."""
    steps, durations = trainer_steps(job, estimate)
    return makespan(steps, durations)


def steady_step_seconds(job: JobSpec, estimate: PlanEstimate) -> float:
    """Closed form of the steady-state step: the busier of the rollout set (G + S) and the
    trainer (T_s)."""
    if not estimate.feasible:
        return float("inf")
    return max(generation_seconds(job, estimate) + sync_seconds(estimate),
               trainer_seconds(job, estimate))


def iterations_for(staleness: int) -> int:
    """Iterations to simulate: the fill (K + 1) and enough steady iterations after it."""
    return max(6, 3 * (staleness + 1) + 3)


def simulate_async(job: JobSpec, plan: Plan, estimate: PlanEstimate, *,
                   iterations: int | None = None) -> SimulationResult:
    """Simulate ``iterations`` iterations of an asynchronous plan (default: enough to reach the
    steady state) and read the steady-state step time."""
    assert plan.rollout is not None
    staleness = plan.max_staleness
    iterations = iterations or iterations_for(staleness)
    if not estimate.feasible:
        return simulation_result("des", job, plan, estimate, [], iterations)
    env = simpy.Environment()
    dataflow = job.dataflow
    rollout = len(plan.sets)
    gens = generate_names(job)
    trainer = trainer_names(job)
    update = last_actor_update(job)
    actor_location = estimate.nodes[update].location
    streaming = plan.mode == "async"
    mini_batches = job.workload.mini_batches_per_epoch
    sync_cost = sync_seconds(estimate)
    partial = plan.partial_rollout

    done = [{name: env.event() for name in [*gens, *trainer, SYNC_NODE]}
            for _ in range(iterations)]
    started = [{name: env.event() for name in gens} for _ in range(iterations)]
    taken: dict[int, float] = {}
    ends: dict[tuple[int, str], float] = {}
    gen_starts: dict[tuple[int, str], float] = {}
    events: list[TimelineEvent] = []
    versions: list[int] = []
    syncs_ended = [0]

    def record(iteration: int, location: int, role: str, operation: str, node: str,
               kind: str, start: float, end: float) -> None:
        gpus = 0 if location == CONTROLLER_LOCATION else plan.located_sets()[location].gpus
        events.append(TimelineEvent(
            iteration=iteration, location=location,
            lane="network" if kind == "transfer" else lane_of(plan, location, job), role=role,
            operation=operation, node=node, kind=kind,  # type: ignore[arg-type]
            start=start, end=end, gpus=gpus))

    # Calling order per training location: iteration by iteration, trainer nodes in dataflow
    # order, the sync after the actor's update at the actor's set.
    previous: dict[tuple[int, str], tuple[int, str] | None] = {}
    last_at: dict[int, tuple[int, str]] = {}
    for i in range(iterations):
        for name in trainer:
            location = estimate.nodes[name].location
            previous[(i, name)] = last_at.get(location)
            last_at[location] = (i, name)
        previous[(i, SYNC_NODE)] = last_at[actor_location]
        last_at[actor_location] = (i, SYNC_NODE)

    rollout_busy: list[simpy.Process | None] = [None]
    sync_running: list[simpy.Event | None] = [None]

    def generate(i: int, name: str) -> simpy.events.ProcessGenerator:
        waits = []
        if i - 1 - staleness >= 0:
            waits.append(done[i - 1 - staleness][SYNC_NODE])
        index = gens.index(name)
        if index > 0:
            waits.append(done[i][gens[index - 1]])
        elif i > 0:
            waits.append(done[i - 1][gens[-1]])
        if waits:
            yield simpy.AllOf(env, waits)
        if sync_running[0] is not None:
            yield sync_running[0]
        if index == 0:
            # Batch i is generated by the policy after syncs_ended updates; it trains against
            # the policy after i updates.
            versions.append(i - syncs_ended[0])
        remaining = estimate.nodes[name].seconds
        gen_starts[(i, name)] = env.now
        started[i][name].succeed()
        node = dataflow.node(name)
        while remaining > 1e-12:
            start = env.now
            rollout_busy[0] = env.active_process
            try:
                yield env.timeout(remaining)
                remaining = 0.0
            except simpy.Interrupt:
                remaining -= env.now - start
            finally:
                rollout_busy[0] = None
                if env.now > start:
                    record(i, rollout, node.role, node.operation, name, "compute", start,
                           env.now)
            if remaining > 1e-12 and sync_running[0] is not None:
                yield sync_running[0]
        ends[(i, name)] = env.now
        done[i][name].succeed()

    def sync(i: int) -> simpy.events.ProcessGenerator:
        yield done[i][update]
        before = previous[(i, SYNC_NODE)]
        if before is not None:
            yield done[before[0]][before[1]]
        if not partial:
            # The batch in flight drains first: the sync waits for the rollout to finish the
            # generation it is running (or has queued ahead of this sync).
            last_gen = min(i + staleness, iterations - 1)
            yield simpy.AllOf(env, [done[last_gen][g] for g in gens])
        finished = env.event()
        sync_running[0] = finished
        if rollout_busy[0] is not None:
            rollout_busy[0].interrupt("weight sync")
        start = env.now
        yield env.timeout(sync_cost)
        sync_running[0] = None
        syncs_ended[0] += 1
        finished.succeed()
        for location in (actor_location, rollout):
            record(i, location, "actor", "sync", SYNC_NODE, "sync", start, env.now)
        ends[(i, SYNC_NODE)] = env.now
        done[i][SYNC_NODE].succeed()

    def train_node(i: int, name: str) -> simpy.events.ProcessGenerator:
        node = dataflow.node(name)
        est = estimate.nodes[name]
        waits = [done[i][dep] for dep in node.after if dep not in gens]
        if i > 0:
            waits += [done[i - 1][n] for n in trainer] + [done[i - 1][SYNC_NODE]]
        stream_inputs = [dep for dep in node.after if dep in gens]
        if waits:
            yield simpy.AllOf(env, waits)
        for dep in stream_inputs:
            transfer = estimate.transfers.get((dep, name), 0.0)
            if streaming:
                # The first mini-batch is in once the stream has produced its share.
                yield started[i][dep]
                first = gen_starts[(i, dep)] + estimate.nodes[dep].seconds / mini_batches \
                    + transfer / mini_batches
                if first > env.now:
                    yield env.timeout(first - env.now)
            else:
                yield done[i][dep]
                arrival = ends[(i, dep)] + transfer
                if transfer > 0:
                    record(i, est.location, node.role, "transfer", f"{dep}->{name}",
                           "transfer", ends[(i, dep)], arrival)
                if arrival > env.now:
                    yield env.timeout(arrival - env.now)
        arrivals = []
        for dep in node.after:
            if dep in gens:
                continue
            transfer = estimate.transfers.get((dep, name), 0.0)
            arrivals.append(ends[(i, dep)] + transfer)
            if transfer > 0:
                record(i, est.location, node.role, "transfer", f"{dep}->{name}", "transfer",
                       ends[(i, dep)], ends[(i, dep)] + transfer)
        if arrivals and max(arrivals) > env.now:
            yield env.timeout(max(arrivals) - env.now)
        before = previous[(i, name)]
        if before is not None:
            yield done[before[0]][before[1]]
        start = env.now
        if stream_inputs:
            taken[i] = min(taken.get(i, start), start)
        yield env.timeout(est.seconds)
        if streaming and stream_inputs:
            # Cannot finish before the last mini-batch is in and has been processed.
            yield simpy.AllOf(env, [done[i][dep] for dep in stream_inputs])
            last = max(ends[(i, dep)] + estimate.transfers.get((dep, name), 0.0) / mini_batches
                       for dep in stream_inputs) + est.seconds / mini_batches
            if last > env.now:
                yield env.timeout(last - env.now)
        record(i, est.location, node.role, node.operation, name, "compute", start, env.now)
        ends[(i, name)] = env.now
        done[i][name].succeed()

    for i in range(iterations):
        for name in gens:
            env.process(generate(i, name))
        for name in trainer:
            env.process(train_node(i, name))
        env.process(sync(i))
    env.run()

    # An iteration ends with its last training-side node (the last sync of the simulation
    # has no next batch to drain for, so it is not a steady-state measure).
    iteration_end = [max(ends[(i, n)] for n in trainer) for i in range(iterations)]
    warm = min(staleness + 1, iterations - 2)
    steady = (iteration_end[-1] - iteration_end[warm]) / (iterations - 1 - warm)
    result = simulation_result("des", job, plan, estimate, events, iterations)
    # Queue: batches fully generated that the trainer has not started on yet.
    changes = sorted([(ends[(i, gens[-1])], 1) for i in range(iterations)]
                     + [(taken[i], -1) for i in taken])
    depth = peak = 0
    for _, change in changes:
        depth += change
        peak = max(peak, depth)
    extra = {
        "steady_step_seconds": steady,
        "first_iteration_seconds": iteration_end[0],
        "weight_sync_seconds": sync_cost,
        "generation_seconds": generation_seconds(job, estimate),
        "trainer_seconds": trainer_seconds(job, estimate),
        "max_queue_batches": float(peak),
        "max_staleness_seen": float(max(versions, default=0)),
        "staleness": float(staleness),
    }
    return SimulationResult(
        mode=result.mode, iterations=iterations, timeline=result.timeline,
        iteration_seconds=steady, throughput_tokens_per_s=(
            estimate.tokens_per_iteration / steady if steady > 0 else 0.0),
        stage_seconds={**result.stage_seconds, SYNC_NODE: sync_cost},
        idle_fraction={**result.idle_fraction, ROLLOUT_LABEL: _idle(events, rollout,
                                                                  result.makespan_seconds)},
        peak_memory_bytes_per_gpu=result.peak_memory_bytes_per_gpu, feasible=result.feasible,
        reasons=result.reasons, makespan_seconds=result.makespan_seconds, extra=extra)


def _idle(events: list[TimelineEvent], location: int, makespan_seconds: float) -> float:
    busy = sum(e.seconds for e in events if e.location == location and e.kind != "transfer")
    return 1.0 - busy / makespan_seconds if makespan_seconds > 0 else 0.0
