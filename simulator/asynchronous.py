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
    iterations = iterations or iterations_for(plan.max_staleness)
    if not estimate.feasible:
        return simulation_result("des", job, plan, estimate, [], iterations)
    simulation = _AsyncSimulation(job, plan, estimate, iterations)
    simulation.run()
    return simulation.result()


def calling_order(job: JobSpec, estimate: PlanEstimate, iterations: int,
                  ) -> dict[tuple[int, str], tuple[int, str] | None]:
    """Each training-side call's predecessor at its location: iteration by iteration, the
    trainer nodes in dataflow order, the sync after the actor's update at the actor's set."""
    actor_location = estimate.nodes[last_actor_update(job)].location
    previous: dict[tuple[int, str], tuple[int, str] | None] = {}
    last_at: dict[int, tuple[int, str]] = {}
    for i in range(iterations):
        for name in trainer_names(job):
            location = estimate.nodes[name].location
            previous[(i, name)] = last_at.get(location)
            last_at[location] = (i, name)
        previous[(i, SYNC_NODE)] = last_at[actor_location]
        last_at[actor_location] = (i, SYNC_NODE)
    return previous


def peak_queue(generated: list[float], taken: list[float]) -> int:
    """Most batches fully generated that the trainer has not started on yet, given the times
    batches were generated and taken."""
    changes = sorted([(t, 1) for t in generated] + [(t, -1) for t in taken])
    depth = peak = 0
    for _, change in changes:
        depth += change
        peak = max(peak, depth)
    return peak


class _AsyncSimulation:
    """One simulation of ``simulate_async``: the SimPy processes of the rollout set (one per
    generate node and iteration), of the trainer's nodes and of the syncs, and what they
    record (the module's docstring gives the rules)."""

    def __init__(self, job: JobSpec, plan: Plan, estimate: PlanEstimate, iterations: int):
        self.job, self.plan, self.estimate = job, plan, estimate
        self.iterations = iterations
        self.env = simpy.Environment()
        self.staleness = plan.max_staleness
        self.rollout = len(plan.sets)
        self.gens = generate_names(job)
        self.trainer = trainer_names(job)
        self.update = last_actor_update(job)
        self.actor_location = estimate.nodes[self.update].location
        self.streaming = plan.mode == "async"
        self.mini_batches = job.workload.mini_batches_per_epoch
        self.sync_cost = sync_seconds(estimate)
        self.partial = plan.partial_rollout
        env = self.env
        self.done = [{name: env.event() for name in [*self.gens, *self.trainer, SYNC_NODE]}
                     for _ in range(iterations)]
        self.started = [{name: env.event() for name in self.gens} for _ in range(iterations)]
        self.previous = calling_order(job, estimate, iterations)
        self.taken: dict[int, float] = {}
        """Iteration -> when the trainer started on its batch."""
        self.ends: dict[tuple[int, str], float] = {}
        self.gen_starts: dict[tuple[int, str], float] = {}
        self.events: list[TimelineEvent] = []
        self.versions: list[int] = []
        """Per batch: how many updates behind the policy it trains against its generator is."""
        self.syncs_ended = 0
        self.rollout_busy: simpy.Process | None = None
        self.sync_running: simpy.Event | None = None

    def run(self) -> None:
        for i in range(self.iterations):
            for name in self.gens:
                self.env.process(self.generate(i, name))
            for name in self.trainer:
                self.env.process(self.train_node(i, name))
            self.env.process(self.sync(i))
        self.env.run()

    def record(self, iteration: int, location: int, role: str, operation: str, node: str,
               kind: str, start: float, end: float) -> None:
        plan = self.plan
        gpus = 0 if location == CONTROLLER_LOCATION else plan.located_sets()[location].gpus
        self.events.append(TimelineEvent(
            iteration=iteration, location=location,
            lane="network" if kind == "transfer" else lane_of(plan, location, self.job),
            role=role, operation=operation, node=node, kind=kind,  # type: ignore[arg-type]
            start=start, end=end, gpus=gpus))

    def _generation_waits(self, i: int, index: int) -> list[simpy.Event]:
        """Batch i waits for the sync of update i - 1 - K, and each generate node for the one
        before it on the rollout set."""
        waits = []
        if i - 1 - self.staleness >= 0:
            waits.append(self.done[i - 1 - self.staleness][SYNC_NODE])
        if index > 0:
            waits.append(self.done[i][self.gens[index - 1]])
        elif i > 0:
            waits.append(self.done[i - 1][self.gens[-1]])
        return waits

    def generate(self, i: int, name: str) -> simpy.events.ProcessGenerator:
        env = self.env
        index = self.gens.index(name)
        waits = self._generation_waits(i, index)
        if waits:
            yield simpy.AllOf(env, waits)
        if self.sync_running is not None:
            yield self.sync_running
        if index == 0:
            # Batch i is generated by the policy after syncs_ended updates; it trains against
            # the policy after i updates.
            self.versions.append(i - self.syncs_ended)
        remaining = self.estimate.nodes[name].seconds
        self.gen_starts[(i, name)] = env.now
        self.started[i][name].succeed()
        node = self.job.dataflow.node(name)
        while remaining > 1e-12:
            start = env.now
            self.rollout_busy = env.active_process
            try:
                yield env.timeout(remaining)
                remaining = 0.0
            except simpy.Interrupt:
                remaining -= env.now - start
            finally:
                self.rollout_busy = None
                if env.now > start:
                    self.record(i, self.rollout, node.role, node.operation, name, "compute",
                                start, env.now)
            if remaining > 1e-12 and self.sync_running is not None:
                yield self.sync_running
        self.ends[(i, name)] = env.now
        self.done[i][name].succeed()

    def sync(self, i: int) -> simpy.events.ProcessGenerator:
        env, done = self.env, self.done
        yield done[i][self.update]
        before = self.previous[(i, SYNC_NODE)]
        if before is not None:
            yield done[before[0]][before[1]]
        if not self.partial:
            # The batch in flight drains first: the sync waits for the rollout to finish the
            # generation it is running (or has queued ahead of this sync).
            last_gen = min(i + self.staleness, self.iterations - 1)
            yield simpy.AllOf(env, [done[last_gen][g] for g in self.gens])
        finished = env.event()
        self.sync_running = finished
        if self.rollout_busy is not None:
            self.rollout_busy.interrupt("weight sync")
        start = env.now
        yield env.timeout(self.sync_cost)
        self.sync_running = None
        self.syncs_ended += 1
        finished.succeed()
        for location in (self.actor_location, self.rollout):
            self.record(i, location, "actor", "sync", SYNC_NODE, "sync", start, env.now)
        self.ends[(i, SYNC_NODE)] = env.now
        done[i][SYNC_NODE].succeed()

    def _await_generated(self, i: int, dep: str, name: str, location: int,
                         role: str) -> simpy.events.ProcessGenerator:
        """Until a generated input is in: its first mini-batch when streaming, else all of
        it after its transfer."""
        env = self.env
        transfer = self.estimate.transfers.get((dep, name), 0.0)
        if self.streaming:
            # The first mini-batch is in once the stream has produced its share.
            yield self.started[i][dep]
            first = self.gen_starts[(i, dep)] + self.estimate.nodes[dep].seconds / \
                self.mini_batches + transfer / self.mini_batches
            if first > env.now:
                yield env.timeout(first - env.now)
            return
        yield self.done[i][dep]
        arrival = self.ends[(i, dep)] + transfer
        if transfer > 0:
            self.record(i, location, role, "transfer", f"{dep}->{name}", "transfer",
                        self.ends[(i, dep)], arrival)
        if arrival > env.now:
            yield env.timeout(arrival - env.now)

    def _trainer_inputs_arrival(self, i: int, name: str, location: int, role: str) -> float:
        """When the last training-side input of node ``name`` is across (recording each
        transfer); 0 when it has none."""
        arrivals = [0.0]
        for dep in self.job.dataflow.node(name).after:
            if dep in self.gens:
                continue
            transfer = self.estimate.transfers.get((dep, name), 0.0)
            arrivals.append(self.ends[(i, dep)] + transfer)
            if transfer > 0:
                self.record(i, location, role, "transfer", f"{dep}->{name}", "transfer",
                            self.ends[(i, dep)], self.ends[(i, dep)] + transfer)
        return max(arrivals)

    def train_node(self, i: int, name: str) -> simpy.events.ProcessGenerator:
        env, done = self.env, self.done
        node = self.job.dataflow.node(name)
        est = self.estimate.nodes[name]
        waits = [done[i][dep] for dep in node.after if dep not in self.gens]
        if i > 0:
            waits += [done[i - 1][n] for n in self.trainer] + [done[i - 1][SYNC_NODE]]
        stream_inputs = [dep for dep in node.after if dep in self.gens]
        if waits:
            yield simpy.AllOf(env, waits)
        for dep in stream_inputs:
            yield from self._await_generated(i, dep, name, est.location, node.role)
        arrival = self._trainer_inputs_arrival(i, name, est.location, node.role)
        if arrival > env.now:
            yield env.timeout(arrival - env.now)
        before = self.previous[(i, name)]
        if before is not None:
            yield done[before[0]][before[1]]
        start = env.now
        if stream_inputs:
            self.taken[i] = min(self.taken.get(i, start), start)
        yield env.timeout(est.seconds)
        if self.streaming and stream_inputs:
            # Cannot finish before the last mini-batch is in and has been processed.
            yield simpy.AllOf(env, [done[i][dep] for dep in stream_inputs])
            last = max(self.ends[(i, dep)] + self.estimate.transfers.get((dep, name), 0.0)
                       / self.mini_batches for dep in stream_inputs) \
                + est.seconds / self.mini_batches
            if last > env.now:
                yield env.timeout(last - env.now)
        self.record(i, est.location, node.role, node.operation, name, "compute", start,
                    env.now)
        self.ends[(i, name)] = env.now
        done[i][name].succeed()

    def result(self) -> SimulationResult:
        """The steady-state step and what else the run shows (queue, staleness seen)."""
        job, plan, estimate, iterations = self.job, self.plan, self.estimate, self.iterations
        # An iteration ends with its last training-side node (the last sync of the
        # simulation has no next batch to drain for, so it is not a steady-state measure).
        iteration_end = [max(self.ends[(i, n)] for n in self.trainer)
                         for i in range(iterations)]
        warm = min(self.staleness + 1, iterations - 2)
        steady = (iteration_end[-1] - iteration_end[warm]) / (iterations - 1 - warm)
        result = simulation_result("des", job, plan, estimate, self.events, iterations)
        peak = peak_queue([self.ends[(i, self.gens[-1])] for i in range(iterations)],
                          list(self.taken.values()))
        extra = {
            "steady_step_seconds": steady,
            "first_iteration_seconds": iteration_end[0],
            "weight_sync_seconds": self.sync_cost,
            "generation_seconds": generation_seconds(job, estimate),
            "trainer_seconds": trainer_seconds(job, estimate),
            "max_queue_batches": float(peak),
            "max_staleness_seen": float(max(self.versions, default=0)),
            "staleness": float(self.staleness),
        }
        return SimulationResult(
            mode=result.mode, iterations=iterations, timeline=result.timeline,
            iteration_seconds=steady, throughput_tokens_per_s=(
                estimate.tokens_per_iteration / steady if steady > 0 else 0.0),
            stage_seconds={**result.stage_seconds, SYNC_NODE: self.sync_cost},
            idle_fraction={**result.idle_fraction,
                           ROLLOUT_LABEL: _idle(self.events, self.rollout,
                                                result.makespan_seconds)},
            peak_memory_bytes_per_gpu=result.peak_memory_bytes_per_gpu,
            feasible=result.feasible, reasons=result.reasons,
            makespan_seconds=result.makespan_seconds, extra=extra)


def _idle(events: list[TimelineEvent], location: int, makespan_seconds: float) -> float:
    busy = sum(e.seconds for e in events if e.location == location and e.kind != "transfer")
    return 1.0 - busy / makespan_seconds if makespan_seconds > 0 else 0.0
