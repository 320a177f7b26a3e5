"""Calibration and accuracy: recovering known parameters, and rejecting broken files."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from planner.calibration import (
    PARAMETERS,
    Run,
    accuracy,
    calibrate,
    load_run,
    predicted_stages,
)
from profiles.datafile import SpecError
from profiles.device import load_profile, load_profile_file, write_profile_file
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROLES = ("actor", "ref", "reward")
JOB = job_from_mapping({
    "algorithm": "remax", "models": {r: "tiny-4l" for r in ROLES},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu-2core"},
    "workload": {"prompts_per_iteration": 32, "prompt_length": 5, "response_length": 5,
                 "mini_batches_per_epoch": 2, "dtype": "fp32"}})


def _plan(gpus: int, tp: int, sharding: str, micro: int) -> Plan:
    par = ParallelConfig(tp=tp, dp=gpus // tp, sharding=sharding, micro_batch_size=micro,
                         sequence_parallel=False)
    return Plan(algorithm="remax", sets=(ColocatedSet(roles=ROLES, gpus=gpus),),
                roles={r: RolePlan(parallel=par, generation=GenerationConfig()
                                   if r == "actor" else None) for r in ROLES})


PLANS = [_plan(1, 1, "none", 16), _plan(1, 1, "none", 4), _plan(2, 2, "none", 16),
         _plan(2, 1, "fsdp", 8)]


def _synthetic_run(plan: Plan, truth, noise: float, seed: int, index: int) -> Run:
    """A run whose measurements are the model's own predictions with ``truth`` (+ noise)."""
    counts = {i: {4: 20, 5: 12} for i in range(4)}
    stub = Run(path=Path(f"synthetic-{index}"), plan=plan, job=JOB, prompt_length=5,
               measurements=pd.DataFrame(), length_counts=counts,
               greedy_counts={i: {3: 32} for i in range(4)})
    rng = random.Random(seed)
    rows = []
    for iteration in counts:
        for node, seconds in predicted_stages(stub, iteration, truth).items():
            seconds *= 1 + rng.uniform(-noise, noise)
            rows.append({"iteration": iteration, "node": node, "role": "x",
                         "operation": "generate" if "generate" in node else "x",
                         "location": 0, "set": "s", "gpus": 1, "wall_seconds": seconds,
                         "compute_seconds": seconds})
    return replace(stub, measurements=pd.DataFrame(rows))


def test_fitting_recovers_known_parameters_from_noisy_synthetic_runs() -> None:
    base = load_profile("cpu-2core")
    truth = base
    known = {"kernel_launch_seconds": 4e-5, "train_compute": 1.8, "infer_compute": 0.7,
             "collective": 2.5}
    for name, value in known.items():
        truth = PARAMETERS[name].set(truth, value)
    runs = [_synthetic_run(p, truth, noise=0.02, seed=i, index=i) for i, p in enumerate(PLANS)]
    result = calibrate(runs, base, fit=list(known), skip=0)
    for name, value in known.items():
        assert result.values[name] == pytest.approx(value, rel=0.15), name
    assert result.residual_after < result.residual_before
    assert result.profile.provenance.fitted_on
    fitted = accuracy(runs, result.profile, skip=0)
    assert fitted["median_abs_error_pct"] < 3.0
    assert fitted["kendall_tau"] == pytest.approx(1.0)


def test_calibration_refuses_parameters_the_runs_do_not_constrain() -> None:
    base = load_profile("cpu-2core")
    single = [_synthetic_run(PLANS[0], base, noise=0.0, seed=0, index=0)]  # no collectives
    with pytest.raises(SpecError, match="the runs do not constrain collective"):
        calibrate(single, base, fit=["train_compute", "collective"], skip=0)
    with pytest.raises(SpecError, match="unknown parameter 'speed'"):
        calibrate(single, base, fit=["speed"], skip=0)


def _write_run(path: Path) -> Path:
    run = _synthetic_run(PLANS[0], load_profile("cpu-2core"), noise=0.0, seed=0, index=0)
    path.mkdir()
    run.measurements.to_csv(path / "measurements.csv", index=False)
    pd.DataFrame([{"iteration": i, "response_length_counts": json.dumps({"4": 20, "5": 12})}
                  for i in range(4)]).to_csv(path / "metrics.csv", index=False)
    meta = {"plan": run.plan.to_value(), "job": JOB.to_value(),
            "options": {"task": {"digits": 3, "values": 5}}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_runs_round_trip_and_corrupt_files_name_line_and_field(tmp_path: Path) -> None:
    path = _write_run(tmp_path / "run")
    assert len(load_run(path).measurements) > 0
    csv_path = path / "measurements.csv"
    good = csv_path.read_text()
    lines = good.splitlines()
    header = lines[0].split(",")
    column = header.index("compute_seconds")
    broken = lines[3].split(",")
    broken[column] = "fast"
    csv_path.write_text("\n".join([*lines[:3], ",".join(broken), *lines[4:]]) + "\n")
    with pytest.raises(SpecError, match=r"measurements.csv: line 4: compute_seconds: expected "
                                        r"float, got 'fast'"):
        load_run(path)
    csv_path.write_text("\n".join(lines[:5]) + "\n" + lines[5][: len(lines[5]) // 3] + "\n")
    with pytest.raises(SpecError, match=r"line 6: \d+ fields, expected \d+ \(truncated"):
        load_run(path)
    csv_path.write_text(good.replace("compute_seconds", "seconds_computed"))
    with pytest.raises(SpecError, match="line 1: missing column 'compute_seconds'"):
        load_run(path)
    csv_path.write_text(good)
    (path / "meta.json").write_text("{broken")
    with pytest.raises(SpecError, match=r"meta.json: not valid JSON: line 1"):
        load_run(path)


def test_calibrated_profile_is_written_atomically_and_loads(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    base = load_profile("cpu-2core")
    runs = [_synthetic_run(p, base, noise=0.01, seed=i, index=i) for i, p in enumerate(PLANS)]
    result = calibrate(runs, base, fit=["train_compute", "infer_compute"], skip=0,
                       name="fitted")
    out = tmp_path / "fitted.yaml"
    write_profile_file(result.profile, out)
    loaded = load_profile_file(out)
    assert loaded.correction("train_compute") == pytest.approx(
        result.values["train_compute"])
    before = out.read_text()

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", fail)
    with pytest.raises(OSError):
        write_profile_file(replace(result.profile, name="other"), out)
    assert out.read_text() == before


def test_shipped_cpu_profiles_load_and_the_calibrated_one_records_its_error() -> None:
    measured = load_profile("cpu-2core")
    assert measured.kind == "cpu" and measured.provenance.source.startswith("measured")
    calibrated = load_profile("cpu-2core-calibrated")
    accuracy_record = calibrated.provenance.accuracy
    assert {"median_abs_error_pct", "max_abs_error_pct", "kendall_tau"} <= set(accuracy_record)
    assert all(math.isfinite(v) for v in accuracy_record.values())


def test_fit_reports_parameters_that_end_at_a_bound() -> None:
    base = load_profile("cpu-2core")
    # The truth's training is 100x cheaper than the lowest correction the fit allows (0.05).
    truth = PARAMETERS["train_compute"].set(base, 0.0005)
    runs = [_synthetic_run(p, truth, noise=0.0, seed=i, index=i) for i, p in enumerate(PLANS)]
    result = calibrate(runs, base, fit=["train_compute", "infer_compute"], skip=0)
    assert result.at_bounds == {"train_compute": "lower"}
    assert result.profile.provenance.parameters_at_bounds == ("train_compute=lower",)
    assert "at a bound: train_compute (lower)" in result.profile.provenance.notes


def test_fit_is_refused_when_held_out_runs_get_worse() -> None:
    base = load_profile("cpu-2core")
    # Held-out runs are exactly what the base profile predicts; the fitted runs come from a
    # machine whose training is 3x slower, so the fit can only make the held-out runs worse.
    held = [_synthetic_run(p, base, noise=0.0, seed=i, index=10 + i)
            for i, p in enumerate(PLANS)]
    slower = PARAMETERS["train_compute"].set(base, 3.0)
    fitted_on = [_synthetic_run(p, slower, noise=0.0, seed=i, index=i)
                 for i, p in enumerate(PLANS)]
    with pytest.raises(SpecError, match=r"--held-out: refusing to write the fit: .* worse than "
                                        r"0\.0% of cpu-2core unfitted"):
        calibrate(fitted_on, base, fit=["train_compute"], skip=0, held_out=held)
    # Held-out runs from the same machine as the fitted ones: accepted, error recorded.
    held_slow = [_synthetic_run(p, slower, noise=0.01, seed=i, index=10 + i)
                 for i, p in enumerate(PLANS)]
    result = calibrate(fitted_on, base, fit=["train_compute"], skip=0, held_out=held_slow)
    record = result.profile.provenance.accuracy
    assert record["median_abs_error_pct"] < record["unfitted_median_abs_error_pct"]
    assert record["held_out_plans"] == len(PLANS)
    assert "bias_pct" in record


def test_accuracy_takes_the_median_over_repeats_of_one_plan() -> None:
    base = load_profile("cpu-2core")
    repeats = [_synthetic_run(PLANS[0], PARAMETERS["train_compute"].set(base, factor),
                              noise=0.0, seed=0, index=i)
               for i, factor in enumerate((1.0, 1.0, 5.0))]  # one slow outlier run
    result = accuracy(repeats, base, skip=0)
    assert result["plans"] == 1 and result["runs"] == 3
    (plan,) = result["per_run"]
    assert plan["repeats"] == 3
    assert abs(plan["error_pct"]) < 1e-6  # the outlier does not move the median
    assert plan["repeat_spread_pct"] > 50


def test_stale_calibrations_are_reported() -> None:
    from planner.provenance import code_fingerprint, stale_calibration
    from profiles.device import Provenance

    base = load_profile("cpu-2core")
    assert stale_calibration(base) is None  # measured, not fitted on runs
    assert stale_calibration(load_profile("a100-80gb")) is None
    current = code_fingerprint()
    assert current is not None and len(current) == 16

    def fitted(fingerprint: str | None) -> object:
        return replace(base, provenance=Provenance(
            fitted_on=("runs/x",), fitted_at="2026-01-01T00:00:00+00:00", commit="abc123",
            code_fingerprint=fingerprint))

    assert stale_calibration(fitted(current)) is None
    warning = stale_calibration(fitted("0" * 16))
    assert "commit abc123" in warning and "has changed since" in warning
    assert "without a record of the code" in stale_calibration(fitted(None))

