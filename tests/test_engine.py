"""Event simulation: ordering, parallelism between sets, the paper's cost mode, traces."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import engine
from simulator.default_plan import colocate_plan
from simulator.engine import simulate, simulate_des
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.predict import estimate_plan
from simulator.specs.job import JobSpec, default_job
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.trace import chrome_trace, write_chrome_trace


def split_plan(job: JobSpec, critic: ParallelConfig | None = None) -> Plan:
    """actor,ref on the first node | critic,reward on the second (the paper's split)."""
    train = ParallelConfig(tp=4, dp=2, sharding="optimizer")
    frozen = ParallelConfig(tp=4, dp=2)
    return Plan(algorithm="ppo", strategy="split",
                sets=(ColocatedSet(roles=("actor", "ref"), gpus=8, first_gpu=0),
                      ColocatedSet(roles=("critic", "reward"), gpus=8, first_gpu=8)),
                roles={"actor": RolePlan(parallel=train, generation=GenerationConfig(tp=2)),
                       "ref": RolePlan(parallel=frozen),
                       "critic": RolePlan(parallel=critic or train),
                       "reward": RolePlan(parallel=frozen)})


SLOW_CRITIC = ParallelConfig(tp=8, dp=1, recompute="full")
"""A critic layout whose update ends after the actor's (so the next generation could start
before it if iterations overlapped)."""


def test_colocated_set_runs_its_nodes_one_after_another(paper_job: JobSpec) -> None:
    plan = colocate_plan(paper_job)
    result = simulate(paper_job, plan)
    gpu_events = sorted((e for e in result.timeline if e.location == 0 and e.kind != "transfer"),
                        key=lambda e: e.start)
    for before, after in itertools.pairwise(gpu_events):
        assert after.start >= before.end - 1e-9
    busy = sum(e.seconds for e in gpu_events)
    controller = result.stage_seconds["advantage"]
    moves = sum(e.seconds for e in result.timeline if e.kind == "transfer")
    assert busy + controller <= result.iteration_seconds <= busy + controller + moves + 1e-9


def test_sets_run_in_parallel_when_inputs_are_ready(paper_job: JobSpec) -> None:
    result = simulate(paper_job, split_plan(paper_job))
    events = {e.node: e for e in result.timeline if e.kind == "compute"}
    # verl recomputes the actor's log-probs first on the actor's set; the critic's values run
    # meanwhile on the other set.
    old, critic = events["actor.old_log_prob"], events["critic.infer"]
    assert old.start < critic.end and critic.start < old.end  # overlap on different sets
    actor_train, critic_train = events["actor.train"], events["critic.train"]
    assert actor_train.start == pytest.approx(critic_train.start, abs=0.1)
    # The critic's set idles while the actor generates.
    assert result.idle_fraction["critic,reward"] > result.idle_fraction["actor,ref"]


def test_paper_cost_is_sum_within_set_max_across_sets(paper_job: JobSpec) -> None:
    plan = split_plan(paper_job)
    paper = simulate(paper_job, plan, mode="paper")
    s = paper.stage_seconds
    expected = (s["actor.generate"]
                + max(s["actor.old_log_prob"] + s["ref.infer"],
                      s["critic.infer"] + s["reward.infer"])
                + max(s["actor.train"], s["critic.train"]))
    assert paper.iteration_seconds == pytest.approx(expected)
    des = simulate(paper_job, plan)
    # The event simulation adds what the paper leaves out (transition, transfers, controller).
    assert des.iteration_seconds > paper.iteration_seconds


def test_synchronous_iterations_wait_for_the_previous_one(paper_job: JobSpec) -> None:
    """verl, OpenRLHF and NeMo-RL run iterations one after another: with the critic on its
    own GPUs its update must still end before the next generation starts."""
    plan = split_plan(paper_job, critic=SLOW_CRITIC)
    one = simulate(paper_job, plan, iterations=1)
    three = simulate(paper_job, plan, iterations=3)
    assert three.iterations == 3
    assert three.iteration_seconds == pytest.approx(one.iteration_seconds)
    events = [e for e in three.timeline if e.kind == "compute"]
    for iteration in (1, 2):
        start = min(e.start for e in events if e.iteration == iteration)
        assert start >= max(e.end for e in events if e.iteration == iteration - 1)


def test_overlapping_iterations_are_an_explicit_option(paper_job: JobSpec) -> None:
    plan = split_plan(paper_job, critic=SLOW_CRITIC)
    one = simulate(paper_job, plan, iterations=1)
    three = simulate(paper_job, plan, iterations=3, overlap_iterations=True)
    # Iteration 2's generation waits for iteration 1's actor update, never for the critic's.
    events = [e for e in three.timeline if e.kind == "compute"]
    gen2 = next(e for e in events if e.node == "actor.generate" and e.iteration == 1)
    train1 = next(e for e in events if e.node == "actor.train" and e.iteration == 0)
    critic1 = next(e for e in events if e.node == "critic.train" and e.iteration == 0)
    assert gen2.start >= train1.end
    assert gen2.start < critic1.end  # the critic's update runs beside the next generation
    assert three.iteration_seconds < one.iteration_seconds


def test_simultaneous_requests_are_ordered_by_dataflow_position(
        paper_job, monkeypatch: pytest.MonkeyPatch) -> None:
    # critic.infer, ref.infer and reward.infer all become ready when generation ends and
    # share one set: they run in dataflow order, whatever order the processes are created in.
    plan = colocate_plan(paper_job)
    estimate = estimate_plan(paper_job, plan)
    forward = simulate_des(paper_job, plan, estimate)
    monkeypatch.setattr(engine, "_creation_order", lambda nodes: list(reversed(nodes)))
    backward = simulate_des(paper_job, plan, estimate)
    order = [e.node for e in forward.timeline if e.kind == "compute"]
    assert order == [e.node for e in backward.timeline if e.kind == "compute"]
    assert [(e.start, e.end) for e in forward.timeline] == \
        [(e.start, e.end) for e in backward.timeline]
    assert order.index("critic.infer") < order.index("ref.infer") < order.index("reward.infer")
    assert order.index("actor.train") < order.index("critic.train")


def test_infeasible_plan_reports_why(paper_job: JobSpec) -> None:
    tiny = Plan(algorithm="ppo", strategy="colocate",
                sets=(ColocatedSet(roles=("actor", "critic", "ref", "reward"), gpus=16),),
                roles={r: RolePlan(parallel=ParallelConfig(tp=1, dp=16),
                                   generation=GenerationConfig() if r == "actor" else None)
                       for r in ("actor", "critic", "ref", "reward")})
    result = simulate(paper_job, tiny)
    assert not result.feasible
    assert any("does not fit: needs" in r and "optimizer" in r for r in result.reasons)
    assert result.timeline == ()


def test_chrome_trace_has_one_process_per_set(paper_job: JobSpec, tmp_path: Path) -> None:
    result = simulate(paper_job, split_plan(paper_job))
    trace = chrome_trace(result.timeline)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(result.timeline)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"actor,ref", "critic,reward", "controller"} <= names
    path = tmp_path / "t.json"
    write_chrome_trace(path, result.timeline)
    assert json.loads(path.read_text())["traceEvents"]


@settings(max_examples=40, deadline=None)
@given(scale=st.lists(st.floats(0.01, 10.0), min_size=8, max_size=8),
       transfer=st.floats(0.0, 5.0), placement=st.sampled_from(["colocate", "split"]))
def test_fast_evaluator_equals_the_event_simulation(scale: list[float], transfer: float,
                                                    placement: str) -> None:
    job = default_job()
    plan = colocate_plan(job) if placement == "colocate" else split_plan(job)
    base = estimate_plan(job, plan)
    nodes = {name: replace(node, seconds=node.seconds * factor)
             for (name, node), factor in zip(base.nodes.items(), scale, strict=True)}
    transfers = {edge: seconds + transfer for edge, seconds in base.transfers.items()}
    estimate = replace(base, nodes=nodes, transfers=transfers)
    assert engine.iteration_seconds(job, estimate) == pytest.approx(
        simulate_des(job, plan, estimate).iteration_seconds, rel=1e-12)


def test_every_batch_goes_through_the_single_controller(paper_job: JobSpec) -> None:
    """The controller collects each call's output and sends the next call its input: an edge
    costs two crossings of the controller's link (one 25 GB/s NIC at the nccl-tests
    fraction 0.86, 20 us latency), whether or not the two nodes share GPUs, and more GPUs on
    either side do not make it faster."""
    plan = split_plan(paper_job)
    estimate = estimate_plan(paper_job, plan)
    work = paper_job.workload
    generated = work.prompts_per_iteration * work.mean_sequence_tokens() * (4 + 1 + 4)
    two_legs = 2 * (generated / (25e9 * 0.86) + 20e-6)
    other_set = estimate.transfers[("actor.generate", "critic.infer")]
    same_set = estimate.transfers[("actor.generate", "ref.infer")]
    assert other_set == pytest.approx(two_legs, rel=1e-9)
    assert same_set == pytest.approx(other_set)
    # Controller work needs one leg in (advantage) or out.
    advantage_in = estimate.transfers[("critic.infer", "advantage")]
    values = work.prompts_per_iteration * work.mean_sequence_tokens() * 4
    assert advantage_in == pytest.approx(values / (25e9 * 0.86) + 20e-6, rel=1e-9)
