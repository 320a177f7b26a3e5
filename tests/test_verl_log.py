"""Calibrating from verl logs (planner/verl_log.py): reading verl's console and file-logger
formats, recovering known profile parameters, and refusing logs that do not match.

Every log here is SYNTHETIC: written by the test in verl's formats (``step:N - key:value``
lines as verl's console logger prints them, ``{"step": N, "data": {...}}`` lines as its file
logger writes them) from the simulator's own prediction of a job under a profile with known
parameters, perturbed by a few percent of noise. They test the reading and the fit, not the
simulator's accuracy on real verl runs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from planner.calibration import PARAMETERS, Run, accuracy, calibrate, predicted_stages
from planner.cli import main
from planner.verl_log import STAGES, length_counts, read_verl_steps, verl_run
from profiles.datafile import SpecError
from profiles.device import load_profile
from profiles.framework import FixedCosts
from simulator.default_plan import colocate_plan
from simulator.specs.job import job_from_mapping

JOB_MAPPING = {
    "name": "ppo-qwen-1.5b-verl", "algorithm": "ppo",
    "models": {r: "qwen2.5-1.5b" for r in ("actor", "critic", "ref", "reward")},
    "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "a100-80gb"},
    "workload": {"prompts_per_iteration": 128, "prompt_length": 512, "response_length": 512},
}
JOB = job_from_mapping(JOB_MAPPING)
PLAN = colocate_plan(JOB)
KNOWN = {"train_compute": 1.4, "infer_compute": 0.8, "decode": 1.6, "prefill_compute": 1.3}
TIMER = {node: timer for timer, node in STAGES.items()}


def _truth() -> Any:
    profile = load_profile("a100-80gb")
    for name, value in KNOWN.items():
        profile = PARAMETERS[name].set(profile, value)
    return profile


def synthetic_steps(steps: int = 8, noise: float = 0.02, seed: int = 1,
                    job: Any = JOB, plan: Any = PLAN,
                    fixed_costs: FixedCosts | None = None) -> list[dict[str, Any]]:
    """verl's per-step metrics dicts for ``job`` under ``plan``: stage times predicted with
    the known parameters (times 1 +- ``noise``), lengths varying between steps, and the other
    metrics verl logs beside them (losses, throughput, per-token timings, validation)."""
    rng = random.Random(seed)
    truth = _truth()
    sequences = job.workload.prompts_per_iteration * job.workload.samples_per_prompt
    out = []
    for i in range(steps):
        mean, high = rng.uniform(250, 450), rng.choice([700, 900, 1024])
        low, clip, prompt = rng.uniform(10, 60), rng.choice([0.0, 0.02]), rng.uniform(300, 700)
        stub = Run(path=Path("synthetic"), plan=plan, job=job, prompt_length=512,
                   measurements=pd.DataFrame(),
                   length_counts={i: length_counts(mean, low, high, clip, sequences)},
                   prompt_tokens={i: round(prompt)}, framework=job.framework)
        data: dict[str, Any] = {"training/global_step": i + 1, "actor/pg_loss": -0.01 * i,
                                "critic/vf_loss": 0.5}
        for node, seconds in predicted_stages(stub, i, truth, fixed_costs=fixed_costs).items():
            if node in TIMER and (seconds > 0 or node != "actor.transition"):
                data[f"timing_s/{TIMER[node]}"] = seconds * (1 + rng.uniform(-noise, noise))
        data["timing_s/generate_sequences"] = 0.9 * data["timing_s/gen"]
        data["timing_s/generation_timing/max"] = 0.9 * data["timing_s/gen"]
        data["timing_per_token_ms/gen"] = 1000 * data["timing_s/gen"] / (mean * sequences)
        data.update({"response_length/mean": mean, "response_length/max": high,
                     "response_length/min": low, "response_length/clip_ratio": clip,
                     "prompt_length/mean": prompt})
        tokens = (mean + prompt) * sequences
        data.update({"perf/total_num_tokens": tokens, "perf/time_per_step": data["timing_s/step"],
                     "perf/throughput": tokens / (data["timing_s/step"] * plan.total_gpus)})
        if i == steps - 1:
            data.update({"timing_s/testing": 12.0, "val-core/gsm8k/reward/mean@1": 0.4})
        out.append({"step": i + 1, "data": data})
    return out


def write_jsonl(path: Path, steps: list[dict[str, Any]]) -> Path:
    """verl's file logger: one ``{"step", "data"}`` object per line (a validation-only line
    at step 0 first, as ``val_before_train`` logs it)."""
    lines = [json.dumps({"step": 0, "data": {"val-core/gsm8k/reward/mean@1": 0.1}})]
    lines += [json.dumps(s) for s in steps]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_console(path: Path, steps: list[dict[str, Any]]) -> Path:
    """verl's console logger as a captured terminal shows it: the Ray actor's prefix, colour
    codes, other output between the steps, some values as numpy scalars
    (``pprint.pformat(np.float64(x))``)."""
    lines = ["2026-01-29 11:20:04,123 INFO worker.py:1841 -- Started a local Ray instance.",
             "\x1b[36m(TaskRunner pid=4242)\x1b[0m step:0 - val-core/gsm8k/reward/mean@1:0.1"]
    for s in steps:
        pieces = [f"step:{s['step']}"]
        for j, (key, value) in enumerate(s["data"].items()):
            text = repr(float(value)) if isinstance(value, float) else str(value)
            pieces.append(f"{key}:np.float64({text})" if j % 3 == 0 else f"{key}:{text}")
        lines.append("Training Progress:  10%|#         | 1/10 [00:05<00:45]")
        lines.append(f"\x1b[36m(TaskRunner pid=4242)\x1b[0m {' - '.join(pieces)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_console_and_file_logger_formats_read_the_same(tmp_path: Path) -> None:
    steps = synthetic_steps(steps=4)
    console = verl_run(write_console(tmp_path / "console.log", steps), JOB, PLAN)
    jsonl = verl_run(write_jsonl(tmp_path / "metrics.jsonl", steps), JOB, PLAN)
    columns = ["iteration", "step", "node", "wall_seconds"]
    pd.testing.assert_frame_equal(console.measurements[columns], jsonl.measurements[columns])
    assert console.length_counts == jsonl.length_counts
    assert console.prompt_tokens == jsonl.prompt_tokens
    # Validation at step 0 is no training step; iteration 0 is verl's step 1.
    assert sorted(jsonl.length_counts) == [0, 1, 2, 3]
    assert set(jsonl.measurements["node"]) == {
        "actor.generate", "actor.old_log_prob", "ref.infer", "critic.infer", "reward.infer",
        "advantage", "actor.train", "critic.train", "iteration"}
    assert jsonl.framework == "verl"


def test_length_histogram_keeps_the_mean_the_extremes_and_the_clipped_share() -> None:
    counts = length_counts(mean=300.0, low=20.0, high=1024.0, clipped=0.05, sequences=1000)
    assert sum(counts.values()) == 1000
    assert min(counts) == 20 and max(counts) == 1024 and counts[1024] == 50
    assert sum(n * c for n, c in counts.items()) / 1000 == pytest.approx(300.0, abs=1.0)
    # A mean the middle cannot keep falls back to the two extremes.
    two = length_counts(mean=1000.0, low=10.0, high=1024.0, clipped=0.0, sequences=10)
    assert set(two) == {10, 1024}
    assert length_counts(mean=64.0, low=64.0, high=64.0, clipped=1.0, sequences=8) == {64: 8}


def test_calibration_recovers_known_parameters_from_a_synthetic_verl_log(tmp_path: Path
                                                                         ) -> None:
    run = verl_run(write_jsonl(tmp_path / "metrics.jsonl", synthetic_steps()), JOB, PLAN)
    base = load_profile("a100-80gb")
    result = calibrate([run], base, fit=list(KNOWN), skip=0)
    for name, value in KNOWN.items():
        # Prefill is told apart from decode only by how lengths vary between steps.
        tolerance = 0.1 if name == "prefill_compute" else 0.03
        assert result.values[name] == pytest.approx(value, rel=tolerance), name
    assert result.residual_before > 0.15 and result.residual_after < 0.02
    assert accuracy([run], result.profile, skip=0)["median_abs_error_pct"] < 2.0


def test_cli_calibrate_and_accuracy_from_console_log_with_plan_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_console(tmp_path / "verl.log", synthetic_steps(steps=6))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB_MAPPING), encoding="utf-8")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN.to_value()), encoding="utf-8")
    out = tmp_path / "fitted.yaml"
    main(["calibrate", "--verl-log", str(log), "--job", str(job), "--plan", str(plan),
          "--profile", "a100-80gb", "-o", str(out), "--skip", "0", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["values"]["decode"] == pytest.approx(KNOWN["decode"], rel=0.03)
    assert summary["residual_after"] < 0.02 and out.exists()
    main(["accuracy", "--verl-log", str(log), "--job", str(job), "--profile", str(out),
          "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["runs"] == 1 and result["median_abs_error_pct"] < 2.0
    assert {r["iteration"] for r in result["rows"]} == {1, 2, 3, 4, 5}  # --skip 1


FIXED = FixedCosts(call_seconds=0.2, optimizer_step_seconds=0.3, micro_batch_seconds=0.02,
                   iteration_seconds=1.5)
"""Framework fixed costs the synthetic logs of the framework-profile tests are made with."""
FRAMEWORK_FIT = [f"framework.{name}" for name in (
    "call_seconds", "optimizer_step_seconds", "micro_batch_seconds", "iteration_seconds")]


def test_calibration_recovers_a_frameworks_fixed_costs_from_a_synthetic_verl_log(
        tmp_path: Path) -> None:
    run = verl_run(write_jsonl(tmp_path / "metrics.jsonl",
                               synthetic_steps(steps=10, fixed_costs=FIXED)), JOB, PLAN)
    # Kernels known: the fixed costs come back within the noise.
    result = calibrate([run], _truth(), fit=FRAMEWORK_FIT, skip=0)
    assert result.framework == "verl" and result.fixed_costs is not None
    for name in FRAMEWORK_FIT:
        truth = getattr(FIXED, name.removeprefix("framework."))
        assert result.values[name] == pytest.approx(truth, rel=0.03), name
        assert getattr(result.fixed_costs, name.removeprefix("framework.")) == \
            result.values[name]
    # The device profile is left as it was: only the framework's fixed costs moved.
    assert result.profile.corrections == _truth().corrections
    # Kernels and fixed costs together, from an unfitted profile: the lengths varying between
    # steps tell them apart (less sharply).
    joint = calibrate([run], load_profile("a100-80gb"), fit=[*KNOWN, *FRAMEWORK_FIT], skip=0)
    assert joint.values["framework.optimizer_step_seconds"] == pytest.approx(0.3, rel=0.1)
    assert joint.values["framework.iteration_seconds"] == pytest.approx(1.5, rel=0.05)
    assert joint.values["train_compute"] == pytest.approx(1.4, rel=0.1)
    assert joint.residual_before > 0.3 and joint.residual_after < 0.02


def test_cli_writes_a_framework_profile_the_job_can_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_jsonl(tmp_path / "metrics.jsonl", synthetic_steps(steps=6, fixed_costs=FIXED))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB_MAPPING), encoding="utf-8")
    device = tmp_path / "device.yaml"
    framework = tmp_path / "verl-mycluster.yaml"
    main(["calibrate", "--verl-log", str(log), "--job", str(job), "--profile", "a100-80gb",
          "--fit", ",".join([*KNOWN, *FRAMEWORK_FIT]), "-o", str(device),
          "--framework-out", str(framework), "--skip", "0", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["framework_profile"] == str(framework) and device.exists()
    written = framework.read_text(encoding="utf-8")
    assert written.startswith("# Calibrated by `hybridflow calibrate`") and "base: verl" in written
    # The job that names the written profile is predicted with the fitted fixed costs and
    # everything else of verl's.
    calibrated_job = tmp_path / "job-calibrated.json"
    calibrated_job.write_text(json.dumps({**JOB_MAPPING, "framework": framework.name}),
                              encoding="utf-8")
    main(["accuracy", "--verl-log", str(log), "--job", str(calibrated_job), "--profile",
          str(device), "--skip", "0", "--json"])
    fitted = json.loads(capsys.readouterr().out)
    main(["accuracy", "--verl-log", str(log), "--job", str(job), "--profile", str(device),
          "--skip", "0", "--json"])
    unfitted = json.loads(capsys.readouterr().out)
    assert fitted["median_abs_error_pct"] < 2.0 < unfitted["median_abs_error_pct"]
    # Only framework costs fitted: no device profile is written.
    only = tmp_path / "only-device.yaml"
    main(["calibrate", "--verl-log", str(log), "--job", str(job), "--profile", "a100-80gb",
          "--fit", ",".join(FRAMEWORK_FIT), "-o", str(only), "--framework-out",
          str(tmp_path / "only-framework.yaml"), "--skip", "0"])
    out = capsys.readouterr().out
    assert not only.exists() and "wrote " + str(tmp_path / "only-framework.yaml") in out


@pytest.mark.parametrize("args, expected", [
    (["--fit", "decode", "--framework-out", "fw.yaml"], ("--framework-out", "framework.*")),
    (["--fit", "call_seconds,framework.call_seconds"], ("--fit", "same term")),
    (["--fit", "framework.nap_seconds"], ("--fit", "unknown parameter")),
])
def test_cli_refuses_framework_fits_it_cannot_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
        expected: tuple[str, ...]) -> None:
    log = write_jsonl(tmp_path / "metrics.jsonl", synthetic_steps(steps=2))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB_MAPPING), encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--verl-log", str(log), "--job", str(job), "--profile",
              "a100-80gb", "-o", str(tmp_path / "out.yaml"), "--skip", "0", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in err, (part, err)
    assert not (tmp_path / "out.yaml").exists()


def _refused(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str],
             *expected: str, job: dict[str, Any] | None = None,
             name: str = "verl.log") -> str:
    """Run ``accuracy`` on a log with ``text``: exit 2, one line naming the log and
    ``expected``, no traceback."""
    log = tmp_path / name
    log.write_text(text, encoding="utf-8")
    job_path = tmp_path / "job.json"
    job_path.write_text(json.dumps(job or JOB_MAPPING), encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["accuracy", "--verl-log", str(log), "--job", str(job_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in err, (part, err)
    return err


def _jsonl(steps: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(s) + "\n" for s in steps)


def test_refuses_unknown_timer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = synthetic_steps(steps=2)
    steps[1]["data"]["timing_s/reshard"] = 1.0
    _refused(tmp_path, _jsonl(steps), capsys, "verl.log", "line 2", "timing_s/reshard",
             "unknown verl timer")


def test_refuses_a_timer_the_jobs_dataflow_lacks(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    grpo = {**JOB_MAPPING, "algorithm": "grpo",
            "models": {"actor": "qwen2.5-1.5b", "ref": "qwen2.5-1.5b", "reward": "rule"},
            "workload": {**JOB_MAPPING["workload"], "prompts_per_iteration": 32,
                         "samples_per_prompt": 4}}
    _refused(tmp_path, _jsonl(synthetic_steps(steps=1)), capsys, "line 1",
             "timing_s/values", "critic.infer", job=grpo)


def test_refuses_a_missing_timer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = synthetic_steps(steps=3)
    del steps[2]["data"]["timing_s/update_actor"]
    _refused(tmp_path, _jsonl(steps), capsys, "line 3", "step 3", "timing_s/update_actor")
    del steps[0]["data"]["response_length/mean"]
    _refused(tmp_path, _jsonl(steps), capsys, "line 1", "response_length/mean")


def test_refuses_malformed_console_lines(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    good = "step:1 - timing_s/gen:3.5 - timing_s/step:9.0\n"
    _refused(tmp_path, good + "step:2 - timing_s/gen:fast - timing_s/step:9.0\n", capsys,
             "line 2", "timing_s/gen", "expected a number")
    _refused(tmp_path, good + "step:2 - timing_s/gen:3.5 - timing_s/st\n", capsys,
             "line 2", "not key:value")
    _refused(tmp_path, good + "step:two - timing_s/gen:3.5\n", capsys, "line 2", "step")
    _refused(tmp_path, "some output\nno steps here\n", capsys, "no training steps")


def test_refuses_malformed_json_lines(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    text = _jsonl(synthetic_steps(steps=2))
    _refused(tmp_path, text[: len(text) - 40], capsys, "metrics.jsonl", "line 2",
             "not a JSON object", name="metrics.jsonl")
    _refused(tmp_path, '{"step": 1, "metrics": {}}\n', capsys, "line 1", "file logger",
             name="metrics.jsonl")
    _refused(tmp_path, '{"step": 1.5, "data": {}}\n', capsys, "line 1", "step",
             name="metrics.jsonl")


def test_refuses_steps_that_do_not_increase(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    steps = synthetic_steps(steps=3)
    steps[2]["step"] = 2
    _refused(tmp_path, _jsonl(steps), capsys, "line 3", "step 2 after step 2",
             "must increase")


def test_refuses_impossible_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = synthetic_steps(steps=2)
    steps[0]["data"]["timing_s/ref"] = -1.0
    _refused(tmp_path, _jsonl(steps), capsys, "line 1", "timing_s/ref", "negative")
    steps = synthetic_steps(steps=2)
    steps[1]["data"]["response_length/max"] = 10.0
    _refused(tmp_path, _jsonl(steps), capsys, "line 2", "response_length")
    steps = synthetic_steps(steps=2)
    steps[1]["data"]["perf/throughput"] /= 2  # as if it ran on 16 GPUs
    _refused(tmp_path, _jsonl(steps), capsys, "line 2", "16 GPUs", "the plan has 8")


def test_refuses_a_job_verl_cannot_run_and_options_without_a_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safe = {**JOB_MAPPING, "algorithm": "safe-rlhf",
            "models": {**JOB_MAPPING["models"], "cost": "qwen2.5-1.5b"}}
    _refused(tmp_path, _jsonl(synthetic_steps(steps=1)), capsys, "job.json", "cost.infer",
             job=safe)
    with pytest.raises(SystemExit):
        main(["accuracy", "--job", str(tmp_path / "job.json")])
    assert "--job: only used with --verl-log" in capsys.readouterr().err


def test_reader_skips_validation_lines_and_ignored_timers(tmp_path: Path) -> None:
    log = write_console(tmp_path / "verl.log", synthetic_steps(steps=2))
    steps = read_verl_steps(log)
    assert [s.step for s in steps] == [1, 2]
    assert steps[1].metrics["timing_s/testing"] == 12.0
    with pytest.raises(SpecError, match="is a directory"):
        read_verl_steps(tmp_path)


def test_framework_fixed_costs_are_fitted_on_one_frameworks_runs_only(tmp_path: Path) -> None:
    from dataclasses import replace

    run = verl_run(write_jsonl(tmp_path / "metrics.jsonl", synthetic_steps(steps=2)), JOB, PLAN)
    executor_like = replace(run, framework="hybridflow")
    with pytest.raises(SpecError, match="different frameworks \\(hybridflow, verl\\)"):
        calibrate([run, executor_like], _truth(), fit=FRAMEWORK_FIT, skip=0)
