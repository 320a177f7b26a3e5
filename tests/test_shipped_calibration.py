"""The shipped calibrated CPU profile cannot go stale silently: CI fails when the executor code
its runs executed changed, or when the cost model's predictions of its calibration plans moved
(then `make accuracy`, and `benchmarks/accuracy.py --reuse --install`, refit it)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from planner.provenance import ROOT, executor_fingerprint, stale_calibration
from profiles.device import load_profile

SHIPPED = "cpu-2core-calibrated"
REFIT = ("re-run `make accuracy`, then `.venv/bin/python benchmarks/accuracy.py --reuse "
         "--install` (docs/calibration.md)")


def _accuracy_module():
    spec = importlib.util.spec_from_file_location("accuracy_bench",
                                                  ROOT / "benchmarks" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_the_shipped_profile_was_fitted_on_runs_of_this_executor() -> None:
    provenance = load_profile(SHIPPED).provenance
    assert provenance.executor_fingerprint == executor_fingerprint(), (
        f"the executor code that {SHIPPED}'s runs executed has changed since its fit "
        f"({provenance.fitted_at}, commit {provenance.commit}): {REFIT}")
    assert stale_calibration(load_profile(SHIPPED)) is None


def test_the_cost_model_still_predicts_the_calibration_plans_as_at_the_fit() -> None:
    profile = load_profile(SHIPPED)
    recorded = profile.provenance.predictions
    now = _accuracy_module().calibration_predictions(profile)
    assert set(recorded) == set(now), f"the calibration plans changed: {REFIT}"
    moved = {name: (recorded[name], now[name]) for name in now
             if now[name] != pytest.approx(recorded[name], rel=1e-6)}
    assert not moved, (
        "the cost model's prediction of calibration plans moved since the fit ("
        + ", ".join(f"{n}: {a:.4f} -> {b:.4f} s" for n, (a, b) in moved.items())
        + f"), so {SHIPPED}'s fitted parameters describe other code: {REFIT}")


def test_the_shipped_profile_meets_the_accuracy_goals_it_quotes() -> None:
    """Issue 30: held-out median |error| <= 10%, max <= 20%, Kendall tau >= 0.8."""
    provenance = load_profile(SHIPPED).provenance
    accuracy = provenance.accuracy
    assert accuracy["median_abs_error_pct"] <= 10
    assert accuracy["max_abs_error_pct"] <= 20
    assert round(accuracy["kendall_tau"], 9) >= 0.8  # 9 of 10 pairs in order: 0.8 in floats


def test_the_executor_fingerprint_ignores_code_the_runs_do_not_execute(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "executor", tmp_path / "executor",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = executor_fingerprint(tmp_path)
    for unused in ("executor/profiler.py", "executor/backends/vllm.py"):
        with open(tmp_path / unused, "a") as f:
            f.write("\n# an edit the calibration runs never execute\n")
    assert executor_fingerprint(tmp_path) == before
    with open(tmp_path / "executor" / "trainer.py", "a") as f:
        f.write("\n# an edit the calibration runs execute\n")
    assert executor_fingerprint(tmp_path) != before
