"""Asynchronous modes: the job and plan keys, the weight sync, the multi-iteration event
simulation against its closed form, and the planner's side-by-side modes."""

from __future__ import annotations

import dataclasses

import pytest

from planner.asynchronous import rollout_sizes, search_async
from planner.planning import plan_job
from planner.search import SearchOptions
from profiles.datafile import SpecError
from simulator.asynchronous import SYNC_NODE, steady_step_seconds
from simulator.costs.weight_sync import weight_sync
from simulator.engine import simulate
from simulator.plan import (
    ColocatedSet,
    Plan,
    RolePlan,
    RolloutSet,
    job_as_planned,
    plan_from_mapping,
)
from simulator.predict import estimate_plan
from simulator.specs.cluster import ClusterSpec
from simulator.specs.job import default_job, job_from_mapping
from simulator.specs.lengths import parse_lengths
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS


def _job(**changes):
    base = default_job().to_value()
    base.update(changes)
    return job_from_mapping(base)


@pytest.mark.parametrize(("changes", "key"), [
    ({"mode": "sometimes"}, "mode"),
    ({"mode": "sync", "max_staleness": 2}, "max_staleness"),
    ({"mode": "one_step_off", "max_staleness": 3}, "max_staleness"),
    ({"mode": "async", "max_staleness": 0}, "max_staleness"),
    ({"mode": "sync", "partial_rollout": True}, "partial_rollout"),
    ({"mode": "auto", "max_staleness": -1}, "max_staleness"),
    ({"mode": "async", "partial_rollout": "yes"}, "partial_rollout"),
])
def test_contradictory_mode_keys_are_refused_naming_the_key(changes, key):
    with pytest.raises(SpecError) as error:
        _job(**changes)
    assert error.value.key == key


def test_allowed_modes_follow_the_job():
    assert _job().allowed_modes == (("sync", 0),)
    assert _job(mode="auto", max_staleness=3).allowed_modes == (
        ("sync", 0), ("one_step_off", 1), ("async", 3))
    assert _job(mode="one_step_off").allowed_modes == (("one_step_off", 1),)


def _split(job, mode="one_step_off", staleness=1, partial=False, rollout=8, gen_tp=2):
    trainer = job.cluster.total_gpus - rollout
    sets = (ColocatedSet(roles=job.gpu_roles, gpus=trainer),)
    roles = {r: RolePlan(parallel=ParallelConfig(tp=2, dp=trainer // 2,
                                                 sharding="optimizer" if r in ("actor", "critic")
                                                 else "none"),
                         generation=GenerationConfig(tp=gen_tp) if r == "actor" else None)
             for r in job.gpu_roles}
    return Plan(algorithm=job.algorithm, sets=sets, roles=roles, mode=mode,
                max_staleness=staleness, partial_rollout=partial,
                rollout=RolloutSet(gpus=rollout, first_gpu=trainer))


def test_async_plan_round_trips_and_is_checked():
    job = default_job()
    plan = _split(job)
    plan.validate(job)
    again = plan_from_mapping(plan.to_value())
    assert again.rollout == plan.rollout and again.mode == "one_step_off"
    assert again.generation_replicas() == 4
    with pytest.raises(SpecError, match="rollout"):
        dataclasses.replace(plan, mode="sync", max_staleness=0)
    with pytest.raises(SpecError) as error:
        dataclasses.replace(plan, rollout=RolloutSet(gpus=8, first_gpu=4)).validate(job)
    assert "overlap" in str(error.value)
    uneven = _split(job, rollout=8, gen_tp=4)
    with pytest.raises(SpecError) as error:
        dataclasses.replace(uneven, rollout=RolloutSet(gpus=6, first_gpu=8)).validate(job)
    assert error.value.key == "rollout.gpus"


def test_weight_sync_prices_every_weight_over_the_link_between_the_sets():
    model = MODEL_PRESETS["llama2-7b"]
    profile = default_job().cluster.profile()
    par = ParallelConfig(tp=2, dp=4, sharding="optimizer")
    across = weight_sync(model, profile, profile, par, rollout_gpus=8, dtype="bf16",
                         crosses_nodes=True, gpus_per_node=8)
    inside = weight_sync(model, profile, profile, par, rollout_gpus=8, dtype="bf16",
                         crosses_nodes=False, gpus_per_node=8)
    assert across.bytes_sent == pytest.approx(model.params() * 2)
    assert across.broadcast_seconds > inside.broadcast_seconds > 0
    assert across.gather_seconds == inside.gather_seconds > 0
    # The broadcast moves the whole model at most at the link's bandwidth.
    assert across.broadcast_seconds >= across.bytes_sent / profile.inter_node.bandwidth_bytes_per_s


def _long_tail_job(nodes=4):
    job = default_job()
    lengths = parse_lengths({"distribution": "lognormal", "median": 400, "sigma": 0.8,
                             "max": 4096}, "response_length")
    return dataclasses.replace(
        job, workload=dataclasses.replace(job.workload, response_length=lengths),
        cluster=ClusterSpec.homogeneous(nodes=nodes, gpus_per_node=8, device="a100-80gb"))


@pytest.mark.parametrize(("rollout", "mode", "staleness", "partial"), [
    (8, "one_step_off", 1, False),   # generation-bound
    (16, "one_step_off", 1, False),  # trainer-bound
    (8, "async", 1, False),
    (8, "async", 2, True),
    (16, "async", 3, True),
])
def test_event_simulation_reaches_the_closed_form_steady_state(rollout, mode, staleness,
                                                               partial):
    job = _long_tail_job()
    plan = _split(job, mode=mode, staleness=staleness, partial=partial, rollout=rollout)
    result = simulate(job, plan)
    planned = job_as_planned(job, plan)
    closed = steady_step_seconds(planned, estimate_plan(planned, plan))
    assert result.iteration_seconds == pytest.approx(closed, rel=1e-6)
    assert result.extra["max_staleness_seen"] == staleness
    assert result.stage_seconds[SYNC_NODE] > 0


def test_generation_of_the_next_batch_overlaps_training_and_the_sync_blocks_both_sets():
    job = _long_tail_job()
    result = simulate(job, _split(job, rollout=8))
    generate = {e.iteration: e for e in result.timeline if e.node == "actor.generate"}
    train = {e.iteration: e for e in result.timeline if e.node == "actor.train"}
    assert any(generate[i + 1].start < train[i].end and train[i].start < generate[i + 1].end
               for i in train if i + 1 in generate)
    syncs = [e for e in result.timeline if e.kind == "sync"]
    assert {e.lane for e in syncs} == {",".join(job.gpu_roles), "rollout"}
    # Batch i + 1 is generated with the weights after update i - 1: never before that sync.
    sync_end = {e.iteration: e.end for e in syncs}
    for i, event in generate.items():
        if i - 2 in sync_end:
            assert event.start >= sync_end[i - 2] - 1e-9


def test_partial_rollouts_remove_the_tail_from_a_generation_bound_step():
    job = _long_tail_job()
    drained = simulate(job, _split(job, mode="async", staleness=1, partial=False))
    streamed = simulate(job, _split(job, mode="async", staleness=1, partial=True))
    assert streamed.extra["generation_seconds"] < drained.extra["generation_seconds"]
    assert streamed.iteration_seconds <= drained.iteration_seconds


def test_rollout_sizes_keep_whole_nodes():
    assert rollout_sizes(8, 8) == [1, 2, 4]
    assert rollout_sizes(32, 8) == [8, 16, 24]
    assert all(r % 8 == 0 for r in rollout_sizes(1024, 8))
    assert len(rollout_sizes(1024, 8)) <= 8
    # A trainer of a power of two of nodes beside the rollout set: 128 + 128 of 256 GPUs (the
    # split of NeMo-RL's one-step-off Qwen3-235B run) is tried.
    assert 128 in rollout_sizes(256, 8)
    assert all(256 - r in (16, 32, 64, 128) or r in (16, 32, 64, 128)
               for r in rollout_sizes(256, 8))


def test_search_async_ranks_feasible_splits_by_their_simulated_step():
    # One trainer set: the closed-form step is the simulated one.
    job = dataclasses.replace(_long_tail_job(), framework="hybridflow")
    trainer = SearchOptions(placements=((job.gpu_roles,),))
    found = search_async(job, "async", 2, trainer, top_k=3)
    assert found
    steps = [c.step_seconds for c in found]
    assert steps == sorted(steps)
    for candidate in found:
        assert simulate(job, candidate.plan).iteration_seconds == pytest.approx(
            candidate.step_seconds, rel=1e-6)


def test_a_trainer_of_several_sets_overlaps_iterations_below_the_closed_form():
    """verl's asynchronous trainers keep a reward model on a pool of its own: it scores the
    next batch while the trainer pool trains, which the closed form (one iteration's trainer
    makespan) does not count, so it bounds the simulated step from above."""
    job = _long_tail_job()
    found = search_async(job, "async", 2, top_k=3)
    assert found and all(len(c.plan.sets) == 2 for c in found)
    for candidate in found:
        simulated = simulate(job, candidate.plan).iteration_seconds
        assert simulated <= candidate.step_seconds * (1 + 1e-9)


def test_plan_shows_every_mode_and_picks_among_the_allowed_ones():
    job = _long_tail_job(nodes=2)
    result = plan_job(job)
    assert [m.name for m in result.modes] == ["sync-colocate", "sync", "one_step_off", "async"]
    assert result.best.plan.mode == "sync"
    assert [m.allowed for m in result.modes] == [True, True, False, False]
    auto = plan_job(dataclasses.replace(job, mode="auto", max_staleness=2))
    fastest = min((m.result for m in auto.modes if m.result is not None),
                  key=lambda e: e.iteration_seconds)
    assert auto.best.iteration_seconds == pytest.approx(fastest.iteration_seconds)
    pinned = plan_job(dataclasses.replace(job, mode="one_step_off"))
    assert pinned.best.plan.mode == "one_step_off"
    assert all(e.plan.mode == "one_step_off" for e in pinned.ranking)


@pytest.mark.parametrize(("framework", "mode", "recomputes"), [
    ("verl", "sync", True), ("verl", "one_step_off", True), ("verl", "async", False),
    ("hybridflow", "sync", True), ("hybridflow", "one_step_off", True),
    ("hybridflow", "async", False),
])
def test_each_mode_runs_the_old_log_prob_pass_its_framework_runs(framework, mode, recomputes):
    """verl's one-step-off trainer recomputes the old log-probs, its fully-async trainer uses
    the rollout's; this project's executor recomputes them in sync and one-step-off
    runs. A plan of an ``auto`` job is priced with the passes of the plan's own mode."""
    job = dataclasses.replace(_long_tail_job(), framework=framework, mode="auto",
                              max_staleness=1)
    plan = _split(job, mode=mode, rollout=8) if mode != "sync" else None
    planned = job_as_planned(job, plan) if plan is not None else job
    nodes = [n.name for n in planned.dataflow.nodes]
    assert ("actor.old_log_prob" in nodes) == recomputes
    if plan is not None:
        assert planned.mode == mode
        estimate = estimate_plan(planned, plan)
        assert ("actor.old_log_prob" in estimate.nodes) == recomputes
        with pytest.raises(ValueError, match="job_as_planned"):
            estimate_plan(job, plan)  # the auto job's own passes are the synchronous ones
        assert simulate(job, plan).iteration_seconds == pytest.approx(
            steady_step_seconds(planned, estimate), rel=1e-6)


def test_validate_compares_every_verl_mode_and_names_the_winner_per_scale():
    from simulator.validation import run_validation

    frame, groups = run_validation()
    group = next(g for g in groups if g.group == "verl_async_modes_h20")
    rows = frame[frame["group"] == "verl_async_modes_h20"]
    assert set(rows["mode"]) == {"sync", "one_step_off", "async"}
    # One line per scale, with the measured and the predicted faster mode.
    assert [w.split(":")[0] for w in group.winners] == ["16 GPUs", "32 GPUs", "64 GPUs",
                                                        "128 GPUs"]
    assert "measured one_step_off" in group.winners[0]
    one_step = rows[rows["mode"] == "one_step_off"].iloc[0]
    assert one_step["predicted"] > 0 and one_step["measured"] == 520


def test_every_validation_group_records_its_first_seen_error_and_sample_label() -> None:
    """Each group carries the error it had when its cases were added; a group is out of
    sample today only if its cases came alone and its errors have not moved since."""
    from dataclasses import replace

    from simulator.validation import run_validation

    _, groups = run_validation()
    assert all(g.first_seen is not None for g in groups)
    alone = {g.group for g in groups if g.first_seen.cases_only}
    assert alone == {"verl_async_modes_h20", "megatron_bridge_moe_h100_bf16",
                     "nemo_rl_grpo_moe_h100_step", "nemo_rl_v03_refit",
                     "hybridflow_fig15_generation_tp", "nemo_rl_v04_grpo_moe_h100_step",
                     "nemo_rl_v03_refit_rerun"}
    fig15 = next(g for g in groups if g.group == "hybridflow_fig15_generation_tp")
    assert fig15.sample_label == "out-of-sample"  # nothing changed for it since bf05c98
    refit = next(g for g in groups if g.group == "nemo_rl_v03_refit")
    assert refit.sample_label == "in-sample"  # the DTensor refit's fp32 gather moved it
    verl = next(g for g in groups if g.group == "verl_async_modes_h20")
    assert verl.sample_label == "in-sample"  # the kl: none change moved it
    unchanged = replace(verl, mean_abs_error_pct=verl.first_seen.mean_abs_error_pct,
                        max_abs_error_pct=verl.first_seen.max_abs_error_pct,
                        cases=verl.first_seen.cases)
    assert unchanged.sample_label == "out-of-sample"


def test_one_trainer_search_serves_both_asynchronous_modes():
    """The trainer's side of a split does not depend on the mode: plan searches it once for
    one_step_off and async, with the same plans as a search per mode."""
    from planner.asynchronous import trainer_sides

    job = _long_tail_job()
    shared = trainer_sides(job)
    for mode in ("one_step_off", "async"):
        alone = search_async(job, mode, 1, top_k=3)  # type: ignore[arg-type]
        reused = search_async(job, mode, 1, top_k=3, trainers=shared)  # type: ignore[arg-type]
        assert [c.plan.to_value() for c in reused] == [c.plan.to_value() for c in alone]
        assert [c.step_seconds for c in reused] == [c.step_seconds for c in alone]


QWEN3_235B_ONE_STEP_OFF = {
    # NeMo-RL's one-step-off GRPO of Qwen3-235B-A22B on 256 H100 (issue 30): Megatron TP 4,
    # EP 16, PP 8 on the trainer, vLLM TP 8 on the rollout GPUs; 16 prompts x 32 samples of
    # up to 8K tokens.
    "algorithm": "grpo", "framework": "nemo-rl", "mode": "one_step_off",
    "models": {"actor": "qwen3-235b-a22b", "ref": "qwen3-235b-a22b", "reward": "rule"},
    "cluster": {"nodes": 32, "gpus_per_node": 8, "device": "h100-80gb"},
    "workload": {"prompts_per_iteration": 16, "samples_per_prompt": 32, "prompt_length": 128,
                 "response_length": {"distribution": "max_entropy", "mean": 5700,
                                     "max": 8064},
                 "mini_batches_per_epoch": 1},
    "parallel": {"actor": {"tp": 4, "pp": 8, "ep": 16, "generation_tp": 8}},
}


def test_the_published_235b_one_step_off_run_plans_with_its_own_layout():
    """It needs a trainer of a power of two of nodes (128 of 256 GPUs), a rollout engine
    that takes more than a colocated engine's 0.6 of the memory (235B at TP 8 holds 59 GB of
    weights per GPU), and NeMo-RL's micro-batch rule under TP 4 in the search."""
    result = plan_job(job_from_mapping(QWEN3_235B_ONE_STEP_OFF))
    best = result.best
    assert best is not None, result.infeasible_reason
    assert best.plan.mode == "one_step_off"
    actor = best.plan.roles["actor"]
    assert (actor.parallel.tp, actor.parallel.pp, actor.parallel.ep) == (4, 8, 16)
    assert actor.generation.tp == 8 and actor.generation.memory_utilization == 0.9
    assert best.plan.total_gpus == 128 and best.plan.rollout.gpus % 8 == 0
    # NeMo-RL asserts train_micro_batch_size == logprob_batch_size under TP >= 4.
    assert actor.parallel.micro_batch_size == result.job.workload.infer_micro_batch_size


def test_a_mode_that_does_not_fit_is_told_apart_from_a_job_that_does_not():
    """A job allowing only one_step_off on too few GPUs for a split: the refusal says that
    a synchronous plan fits, not that the models' memory does not."""
    job = _job(mode="one_step_off",
               cluster={"nodes": 1, "gpus_per_node": 2, "device": "a100-80gb"})
    result = plan_job(job)
    if result.best is not None:
        pytest.skip("a split fits on 2 GPUs for this job")
    assert "set mode: auto" in result.infeasible_reason
    assert "GiB" not in result.infeasible_reason


def test_trainer_searches_that_share_caches_find_what_each_finds_alone():
    """The trainer sides share one cost cache (a model or set on g GPUs costs the same on
    every trainer size): each side's ranking is the one its own search finds."""
    from planner.asynchronous import trainer_sides
    from planner.search import Search

    job = _long_tail_job()
    for side in trainer_sides(job):
        alone = Search(side.job, SearchOptions()).run(top_k=3).ranking
        assert [c.to_plan(side.job).to_value() for c in side.ranking] == \
            [c.to_plan(side.job).to_value() for c in alone]
