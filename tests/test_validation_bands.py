"""Assumption bands of validation groups (simulator/validation_bands.py): the group is priced
again at each value of each band, the goal is judged over the band, and a bad band is refused
with its key named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from profiles.datafile import SpecError
from simulator.validation import CASES_FILE, run_validation

LATENCY_GROUP = {
    "source": "a test group",
    "gate_mean_abs_error_pct": 1000, "gate_max_abs_error_pct": 1000,
    "device": "a100-80gb", "dtype": "fp16", "metric": "latency_ms",
    # Measured far below any prediction: every error is positive, so |error| grows with the
    # predicted latency.
    "cases": [{"model": "gpt-6.7b", "tp": 1, "batch": 16, "prompt": 512, "response": 32,
               "measured": 100.0}],
}


def _write(tmp_path: Path, groups: dict) -> Path:
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump(groups, sort_keys=False))
    return path


def _group(tmp_path: Path, spec: dict):
    _, groups = run_validation(_write(tmp_path, {"g": spec}), bands=True)
    return groups[0]


def test_a_factor_band_prices_each_case_at_each_multiple(tmp_path: Path) -> None:
    spec = {**LATENCY_GROUP, "bands": [
        {"input": "prompt length", "key": "case.prompt", "factors": [0.5, 2.0],
         "reason": "a test"}]}
    group = _group(tmp_path, spec)
    (band,) = group.bands
    nominal, short, long = band.points
    assert (nominal.setting, short.value, long.value) == ("nominal", "x0.5", "x2")
    # Longer prompts take longer to prefill: the latency (and its error) rises.
    assert short.median_abs_error_pct < group.median_abs_error_pct < long.median_abs_error_pct
    assert band.goal is None  # the group has no goal


def test_a_device_band_changes_the_profile_field_it_names(tmp_path: Path) -> None:
    spec = {**LATENCY_GROUP, "goal_median_abs_error_pct": 0, "bands": [
        {"input": "host work per decode step", "key": "device.overheads.decode_step_seconds",
         "values": [0.0, 0.01], "reason": "a test"}]}
    group = _group(tmp_path, spec)
    _, none, ten_ms = group.bands[0].points
    # 32 decode steps of 10 ms each: 320 ms more, over a 100 ms measurement.
    assert ten_ms.median_abs_error_pct - none.median_abs_error_pct == pytest.approx(320, rel=0.1)
    assert group.bands[0].goal == "holds nowhere in the band"


def test_the_goal_is_judged_at_each_end_and_at_every_corner(tmp_path: Path) -> None:
    nominal = _group(tmp_path, LATENCY_GROUP).median_abs_error_pct
    spec = {**LATENCY_GROUP, "goal_median_abs_error_pct": nominal + 1, "bands": [
        {"input": "prompt length", "key": "case.prompt", "factors": [0.5, 2.0],
         "reason": "a test"},
        {"input": "response length", "key": "case.response", "values": [16, 32],
         "reason": "a test"}]}
    group = _group(tmp_path, spec)
    prompt, response, together = group.bands
    # The nominal point and the shorter prompt meet it, the longer one does not.
    assert prompt.goal == "holds in part of the band only (at nominal, x0.5)"
    assert response.goal == "holds across the band"  # 16 and 32 (nominal) output tokens
    assert together.band == "all bands together"
    assert len(together.points) == 1 + 2 * 2       # nominal and four corners
    # Corners: x0.5 with 16 and x0.5 with 32 tokens meet it, x2 with either does not.
    assert together.goal == ("holds in part of the band only (at 2 of 4 corners, and at the "
                             "nominal point)")


def test_a_framework_band_prices_the_framework_setting_it_names(tmp_path: Path) -> None:
    """The driver's pickling rate of NeMo-RL: a slower rate makes the priced step longer."""
    shipped = yaml.safe_load(CASES_FILE.read_text())["nemo_rl_grpo_h100_step"]
    spec = copy.deepcopy(shipped)
    spec["cases"] = spec["cases"][:1]
    spec["bands"] = [{"input": "pickling rate", "values": [1.0e8, 1.0e10], "reason": "a test",
                      "key": "framework.controller.serialize_bytes_per_s"}]
    group = _group(tmp_path, spec)
    _, slow, fast = group.bands[0].points
    assert group.bias_pct < 0  # the case is priced too fast: a slower rate narrows the gap
    assert slow.median_abs_error_pct < group.median_abs_error_pct < fast.median_abs_error_pct


@pytest.mark.parametrize("band, key", [
    ({"input": "x", "key": "nowhere.prompt", "factors": [2.0], "reason": "r"},
     "g.bands[0].key"),
    ({"input": "x", "key": "case.prompt", "reason": "r"}, "g.bands[0].values"),
    ({"input": "x", "key": "case.prompt", "factors": [2.0], "reason": "r", "cases": ["no"]},
     "g.bands[0].cases"),
    ({"input": "x", "key": "case.nested.prompt", "factors": [2.0], "reason": "r"},
     "g.bands (case.nested.prompt)"),
    ({"input": "x", "key": "device.overheads.decode_step_secs", "values": [0.1], "reason": "r"},
     "g.bands (device.overheads.decode_step_secs)"),
])
def test_a_bad_band_is_refused_with_its_key(tmp_path: Path, band: dict, key: str) -> None:
    with pytest.raises(SpecError) as caught:
        _group(tmp_path, {**LATENCY_GROUP, "bands": [band]})
    assert caught.value.key == key
    assert str(tmp_path / "cases.yaml") in str(caught.value)


def test_the_shipped_bands_cover_the_assumed_inputs_the_issue_names() -> None:
    """Every whole-step group prices its unpublished inputs over a band, and validate reports
    the error range with a verdict for each group that has a goal."""
    _, groups = run_validation(bands=True)
    by_name = {g.group: g for g in groups}
    keys = {name: {b.key for b in g.bands} for name, g in by_name.items()}
    for name in ("nemo_rl_v03_grpo_stages", "nemo_rl_grpo_h100_step"):
        assert "framework.controller.serialize_bytes_per_s" in keys[name]
        assert all(b.goal for b in by_name[name].bands)
    assert {"job.workload.prompt_length", "job.workload.response_length.mean",
            "framework.rollout.decode_host_seconds_per_sequence"} <= \
        keys["verl_async_modes_h20"]
    for group in groups:
        for band in group.bands:
            low, high = band.median_range
            assert low <= high and band.reason


def test_a_group_of_one_stage_timer_measures_that_stage(tmp_path: Path) -> None:
    """``measures: refit`` makes the stage timer the group's measurement: the prediction is
    the sum of the stage's parts, not the whole step."""
    shipped = yaml.safe_load(CASES_FILE.read_text())["nemo_rl_v03_grpo_stages"]
    case = {**shipped["cases"][0], "measured": 5.0}
    case.pop("stages")
    spec = {k: v for k, v in shipped.items() if k not in ("bands", "first_seen")}
    spec.update(cases=[case], measures="refit", metric="refit_seconds")
    table, _ = run_validation(_write(tmp_path, {"g": spec}))
    (row,) = table.to_dict(orient="records")
    step = run_validation(_write(tmp_path, {"g": {**spec, "measures": None}}))[0]
    assert 0 < row["predicted"] < step["predicted"].iloc[0]
    with pytest.raises(SpecError) as caught:
        run_validation(_write(tmp_path, {"g": {**spec, "measures": "nowhere"}}))
    assert caught.value.key == "g.measures"


def test_a_device_band_may_set_one_of_the_profiles_corrections(tmp_path: Path) -> None:
    """``device.corrections.KEY`` sets one fitted correction (a mapping in the profile): a
    decode twice as slow makes the generation latency longer."""
    spec = {**LATENCY_GROUP, "bands": [
        {"input": "decode correction", "key": "device.corrections.decode", "values": [2.0],
         "reason": "a test"}]}
    group = _group(tmp_path, spec)
    nominal, doubled = group.bands[0].points
    assert doubled.median_abs_error_pct > nominal.median_abs_error_pct
    factors = {**spec, "bands": [{**spec["bands"][0], "values": [], "factors": [2.0]}]}
    with pytest.raises(SpecError, match="give values"):
        _group(tmp_path, factors)  # the shipped A100 profile has no decode correction


def test_a_factor_band_is_applied_once_to_cases_that_share_a_mapping(tmp_path: Path) -> None:
    """Cases written with a YAML anchor share one mapping: a factor still multiplies each
    case's own value once (not once per case that shares it)."""
    text = """
g:
  source: a test group
  gate_mean_abs_error_pct: 1000
  gate_max_abs_error_pct: 1000
  device: a100-80gb
  dtype: fp16
  metric: latency_ms
  bands:
    - {input: prompt, key: case.shape.prompt, factors: [2.0], reason: a test}
  cases:
    - {model: gpt-6.7b, tp: 1, batch: 16, measured: 100.0, shape: &s {prompt: 512}}
    - {model: gpt-6.7b, tp: 1, batch: 16, measured: 100.0, shape: *s}
"""
    from simulator.validation_bands import band_results, read_bands, summary_point

    spec = yaml.safe_load(text)["g"]
    assert spec["cases"][0]["shape"] is spec["cases"][1]["shape"]  # the anchor shares it
    priced = []

    def errors_of(variant: dict) -> list[float]:
        priced.append([c["shape"]["prompt"] for c in variant["cases"]])
        return [0.0]

    band_results(spec, read_bands(spec, "g", "test"), errors_of, goal=None,
                 nominal=summary_point("nominal", [0.0]))
    assert priced == [[1024, 1024]]
    assert [c["shape"]["prompt"] for c in spec["cases"]] == [512, 512]  # untouched


def test_the_breakdown_tool_runs_every_whole_step_case_and_prices_stage_groups_as_stages(
        capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/validation_breakdown.py: asynchronous rows included, and a group of one
    stage timer compared on that stage (not on the whole step)."""
    import importlib.util

    path = CASES_FILE.parents[2] / "benchmarks" / "validation_breakdown.py"
    spec = importlib.util.spec_from_file_location("validation_breakdown", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "7b async 16+16 H20 (async): step measured 294.8 s" in out
    line = next(x for x in out.splitlines() if "llama3.1-8b 8xH100 dtensor" in x)
    assert "refit (" in line and "measured 4.0 s" in line


RATIO_JOB = {
    "algorithm": "grpo", "framework": "hybridflow",
    "models": {"actor": "llama2-7b", "ref": "llama2-7b", "reward": "rule"},
    "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "a100-80gb"},
    "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 4, "prompt_length": 256,
                 "response_length": 256, "ppo_epochs": 1, "mini_batches_per_epoch": 1,
                 "train_micro_batch_size": 2, "infer_micro_batch_size": 8, "dtype": "bf16"},
    "parallel": {"actor": {"tp": 8, "pp": 1, "sharding": "none", "generation_tp": 2},
                 "ref": {"tp": 8, "pp": 1, "sharding": "none"}},
}
RATIO_GROUP = {
    "source": "a test group", "gate_mean_abs_error_pct": 1000, "gate_max_abs_error_pct": 1000,
    "kind": "rlhf_step", "metric": "generation_latency_ratio", "measures": "generation",
    "stage_parts": {"generation": ["actor.generate"]},
}


def test_a_relative_case_is_the_ratio_of_its_job_to_the_job_with_other_settings(
        tmp_path: Path) -> None:
    """``relative_to`` (a published "x% less than with TP 8"): the prediction is the measured
    stage of the case's job over that of the same job with the settings given."""
    at_tp8 = copy.deepcopy(RATIO_JOB)
    at_tp8["parallel"]["actor"]["generation_tp"] = 8
    absolute = {**RATIO_GROUP, "metric": "generation_seconds", "cases": [
        {"name": "tp2", "measured": 1.0, "job": RATIO_JOB},
        {"name": "tp8", "measured": 1.0, "job": at_tp8}]}
    table, _ = run_validation(_write(tmp_path, {"g": absolute}))
    tp2, tp8 = table["predicted"]
    relative = {**RATIO_GROUP, "cases": [
        {"name": "tp2 over tp8", "measured": 0.5, "job": RATIO_JOB,
         "relative_to": {"parallel": {"actor": {"generation_tp": 8}}}}]}
    table, (group,) = run_validation(_write(tmp_path, {"g": relative}))
    (row,) = table.to_dict(orient="records")
    assert tp2 != tp8
    assert row["predicted"] == pytest.approx(tp2 / tp8, rel=1e-12)
    assert row["error_pct"] == pytest.approx(100 * (tp2 / tp8 - 0.5) / 0.5)
    assert group.cases == 1
    # The plan's confidence draws errors of one layout's time, which a ratio is not.
    from planner.confidence import _row_kind

    assert _row_kind(row) is None and _row_kind({**row, "relative": float("nan")}) == "generate"
    bad = {**relative, "cases": [{**relative["cases"][0], "relative_to": 8}]}
    with pytest.raises(SpecError) as caught:
        run_validation(_write(tmp_path, {"g": bad}))
    assert caught.value.key == "g.cases[0].relative_to"


def test_a_case_may_name_a_framework_profile_beside_the_cases_file(tmp_path: Path) -> None:
    """``framework: NAME.yaml`` is read relative to the cases file (a system no shipped profile
    describes), wherever validate runs from, and a framework band builds on it."""
    (tmp_path / "older-engine.yaml").write_text(yaml.safe_dump({
        "base": "hybridflow", "name": "older-engine",
        "rollout": {"decode_host_seconds_per_sequence": 1.0e-4}}))
    shipped = {**RATIO_GROUP, "metric": "generation_seconds",
               "cases": [{"name": "c", "measured": 1.0, "job": RATIO_JOB}]}
    beside = {**shipped, "cases": [{"name": "c", "measured": 1.0,
                                    "job": {**RATIO_JOB, "framework": "older-engine.yaml"}}],
              "bands": [{"input": "host work", "reason": "a test", "values": [0.0],
                         "key": "framework.rollout.decode_host_seconds_per_sequence"}]}
    table, _ = run_validation(_write(tmp_path, {"g": shipped}))
    base_seconds = table["predicted"].iloc[0]
    table, (group,) = run_validation(_write(tmp_path, {"g": beside}), bands=True)
    assert table["predicted"].iloc[0] > base_seconds  # the file's host work is priced
    _, without_host_work = group.bands[0].points
    assert without_host_work.mean_abs_error_pct == pytest.approx(
        abs(100 * (base_seconds - 1.0)), rel=1e-9)
