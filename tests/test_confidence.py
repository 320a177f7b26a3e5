"""Plan confidence (planner/confidence.py): the finalists re-ranked under the model's validated
error, by kind of work along each finalist's critical path."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.confidence import (
    ErrorModel,
    Finalist,
    confidence,
    critical_path_shares,
    error_model,
)
from simulator.engine import TimelineEvent


def _model(**log_errors: tuple[float, ...]) -> ErrorModel:
    errors = {k: log_errors.get(k, (0.0, 0.0)) for k in ("generate", "train", "infer", "other")}
    return ErrorModel(log_errors=errors, correlation=dict.fromkeys(errors, 0.0))


def _event(lane: str, operation: str, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(iteration=0, location=0, lane=lane, role="actor", operation=operation,
                         node=f"actor.{operation}", kind="compute", start=start, end=end,
                         gpus=8)


def test_the_critical_path_follows_the_event_that_decided_each_start() -> None:
    """Generation (0-10 s) on one set and a short training (0-4 s) on another, then the
    training that waited for the generation (10-15 s): the path is generation then training."""
    shares = critical_path_shares([
        _event("a", "generate", 0, 10), _event("b", "train", 0, 4),
        _event("b", "train", 10, 15)])
    assert shares["generate"] == pytest.approx(10 / 15)
    assert shares["train"] == pytest.approx(5 / 15)
    assert shares["infer"] == shares["other"] == 0


def test_a_wait_between_events_counts_as_other_work() -> None:
    shares = critical_path_shares([_event("a", "generate", 0, 6), _event("a", "train", 8, 10)])
    assert shares == pytest.approx({"generate": 0.6, "train": 0.2, "infer": 0, "other": 0.2})


def test_a_clear_winner_is_firm_and_costs_no_regret() -> None:
    model = _model(generate=(-0.1, 0.0, 0.1), train=(-0.05, 0.05))
    result = confidence([
        Finalist(label="fast", mode="sync", value=100.0, shares={"generate": 0.5, "train": 0.5}),
        Finalist(label="slow", mode="sync", value=200.0, shares={"generate": 0.5, "train": 0.5}),
    ], model)
    assert result is not None
    assert result.p_best == 1.0 and result.verdict == "firm"
    assert result.expected_regret == 0.0 and result.rival is None


def test_a_systematic_error_in_one_kind_of_work_flips_the_verdict() -> None:
    """Generation is validated 26% too fast (log-error -0.3) and training exact: a winner
    that is all generation at 100 s is in truth 135 s, slower than a 105 s training plan."""
    model = _model(generate=(-0.3, -0.3), train=(0.0, 0.0))
    result = confidence([
        Finalist(label="generation-heavy", mode="sync", value=100.0, shares={"generate": 1.0}),
        Finalist(label="training-heavy", mode="async", value=105.0, shares={"train": 1.0}),
    ], model)
    assert result is not None
    assert result.p_best == 0.0 and result.verdict == "flips inside the model's error"
    assert result.rival == "training-heavy" and result.p_rival == 1.0
    assert result.expected_regret == pytest.approx(100 * math.exp(0.3) - 105)
    assert result.p_mode == {"sync": 0.0, "async": 1.0}


def test_independent_errors_split_two_equal_plans_and_shared_ones_do_not() -> None:
    plans = [Finalist(label=x, mode="sync", value=100.0, shares={"train": 1.0})
             for x in ("a", "b")]
    independent = _model(train=(-0.2, -0.1, 0.0, 0.1, 0.2))
    result = confidence(plans, independent)
    assert result is not None and 0.3 < result.p_best < 0.7
    shared = ErrorModel(log_errors=independent.log_errors,
                        correlation=dict.fromkeys(independent.log_errors, 1.0))
    result = confidence(plans, shared)
    assert result is not None and result.p_best == 1.0  # equal in every draw: the first wins


def test_the_error_model_reads_times_and_throughputs_the_same_way() -> None:
    rows = [
        {"group": "g", "metric": "iteration_seconds", "stage": "", "measured": 10.0,
         "predicted": 11.0},
        {"group": "g", "metric": "iteration_seconds", "stage": "", "measured": 10.0,
         "predicted": 9.0},
        # A throughput predicted too high is a generation time predicted too short.
        {"group": "h", "metric": "out_tokens_per_s", "stage": "", "measured": 100.0,
         "predicted": 125.0},
        {"group": "h", "metric": "latency_ms", "stage": "", "measured": 100.0,
         "predicted": 80.0},
        {"group": "s", "metric": "stage_seconds", "stage": "logprobs", "measured": 10.0,
         "predicted": 12.0},
        {"group": "s", "metric": "step_seconds", "stage": "", "measured": 10.0,
         "predicted": 50.0},  # a whole RL step mixes every kind: not used
    ]
    model = error_model(rows)
    assert model.log_errors["train"] == pytest.approx((math.log(1.1), math.log(0.9)))
    assert model.log_errors["generate"] == pytest.approx((math.log(0.8), math.log(0.8)))
    # A kind with fewer than two cases takes the errors of every other case.
    assert len(model.log_errors["infer"]) == 4


def test_plan_prints_and_writes_its_confidence(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["plan", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "confidence: the winner is the fastest of" in result.output
    assert "### How sure" in (tmp_path / "r" / "report.md").read_text()
    result = runner.invoke(cli, ["plan", "--out", str(tmp_path / "j"), "--json"])
    value = json.loads(result.output)["confidence"]
    assert 0 <= value["p_best"] <= 1 and value["expected_regret"] >= 0
    assert set(value["p_mode"]) == {"sync", "one_step_off", "async"}
    assert sum(value["p_mode"].values()) == pytest.approx(1.0)


def test_the_critical_path_walk_ends_on_events_too_short_to_tell_apart() -> None:
    """An event shorter than the walk's tolerance right after another: the walk still moves
    back and ends."""
    shares = critical_path_shares([_event("a", "train", 0, 100), _event("a", "infer", 100,
                                                                         100 + 1e-8)])
    assert shares["train"] == pytest.approx(1.0)


def test_a_group_of_one_stage_timer_feeds_that_kind_of_work() -> None:
    rows = [{"group": "refit", "metric": "refit_seconds", "stage": "", "measures": "refit",
             "measured": 10.0, "predicted": 5.0},
            {"group": "other", "metric": "refit_seconds", "stage": "", "measures": "refit",
             "measured": 10.0, "predicted": 20.0}]
    assert error_model(rows).log_errors["other"] == pytest.approx(
        (math.log(0.5), math.log(2.0)))
