"""The hybridflow command line: JSON keys, one-line errors, and light imports."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, ROOT, run_cli, write


def run(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``hybridflow ARGS`` from the repository root, in this process (``run_cli``)."""
    result = run_cli(list(args))
    if check:
        assert result.returncode == 0, result.stderr
    return result


def run_json(*args: str) -> dict:
    result = run(*args, "--json", check=True)
    return json.loads(result.stdout)


# Llama-2-7B by hand (32 layers, hidden 4096, MLP 11008, vocab 32000): per layer 4 h^2 + 3 h f
# linear weights + 2 h norm weights; embedding and untied head h v each.
LLAMA2_7B_PER_LAYER = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
LLAMA2_7B_PARAMS = 32 * LLAMA2_7B_PER_LAYER + 2 * 32000 * 4096 + 4096  # + final norm
# One of two tensor-parallel ranks: half of every matrix, embedding and head; the norms (2 per
# layer and the final one) whole on both ranks.
TP2_LOCAL_PARAMS = (32 * (LLAMA2_7B_PER_LAYER - 2 * 4096) + 2 * 32000 * 4096) / 2 \
    + 32 * 2 * 4096 + 4096


def test_estimate_train_memory_and_mfu_by_hand() -> None:
    out = run_json("estimate", "train", "--model", "llama2-7b", "--gpus", "8", "--tp", "2",
                   "--global-batch", "64", "--micro-batch", "2", "--seq-len", "2048",
                   "--distributed-optimizer")
    assert LLAMA2_7B_PARAMS == 6_738_415_616  # the published Llama-2-7B parameter count
    memory = out["memory_bytes_per_gpu"]
    assert memory["params"] == 2 * TP2_LOCAL_PARAMS  # bf16 weights
    assert memory["grads"] == 4 * TP2_LOCAL_PARAMS  # fp32 main gradients
    assert memory["optimizer"] == 12 * TP2_LOCAL_PARAMS / 4  # Adam + master, over dp 4
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))
    assert out["micro_batches"] == 8  # 64 sequences / (dp 4 x micro-batch 2)
    # MFU: 3 x forward FLOPs (2 per weight of the linear layers and head, plus 4 s q per layer
    # for attention) over seconds x 8 GPUs x 312 TFLOP/s.
    forward_per_token = 2 * (32 * (LLAMA2_7B_PER_LAYER - 2 * 4096) + 32000 * 4096) \
        + 4 * 32 * 4096 * 2048
    flops = 64 * 2048 * 3 * forward_per_token
    assert out["mfu"] == pytest.approx(flops / (out["seconds_per_iteration"] * 8 * 312e12),
                                       rel=1e-9)
    assert out["tokens_per_s_per_gpu"] == pytest.approx(
        64 * 2048 / out["seconds_per_iteration"] / 8, rel=1e-9)


def test_estimate_infer_memory_by_hand() -> None:
    out = run_json("estimate", "infer", "--model", "llama2-7b", "--gpus", "2", "--tp", "2",
                   "--batch", "64", "--seq-len", "2048")
    memory = out["memory_bytes_per_gpu"]
    assert memory["params"] == 2 * TP2_LOCAL_PARAMS
    assert memory["grads"] == 0 and memory["optimizer"] == 0
    assert out["tokens_per_s"] == pytest.approx(64 * 2048 / out["seconds"], rel=1e-9)


def test_estimate_generate_decode_by_hand() -> None:
    """Batch 1, 64 tokens after a 128-token prompt on one A100: each step streams the bf16
    linear and head weights and the KV cache (160.5 tokens on average) at 2.039 TB/s x 0.87
    and launches 10 kernels per layer at 5 us (a100-80gb.yaml)."""
    out = run_json("estimate", "generate", "--model", "llama2-7b", "--tp", "1", "--batch",
                   "1", "--prompt-len", "128", "--response-len", "64")
    weights = 2 * (32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096)
    kv_per_token = 2 * 32 * 4096 * 2
    step = (weights + 160.5 * kv_per_token) / (2.039e12 * 0.87) + 32 * 10 * 5e-6
    assert out["decode_steps"] == 64
    assert out["decode_seconds"] == pytest.approx(64 * step, rel=1e-6)
    assert out["memory_bytes_per_gpu"]["kv_cache"] == (128 + 64) * kv_per_token
    assert out["memory_bytes_per_gpu"]["params"] == 2 * LLAMA2_7B_PARAMS
    assert out["tokens_per_s"] == pytest.approx(64 / out["seconds"], rel=1e-9)


def test_simulate_json_keys_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    out = run_json("simulate", "--trace", str(trace))
    assert {"iteration_seconds", "throughput_tokens_per_s", "stages",
            "peak_memory_bytes_per_gpu"} <= set(out)
    assert out["gpus"] == 16 and out["algorithm"] == "ppo"
    assert {"actor.generate", "critic.infer", "actor.train"} <= set(out["stages"])
    assert json.loads(trace.read_text())["traceEvents"]
    paper = run_json("simulate", "--cost-model", "paper")
    assert paper["iteration_seconds"] <= out["iteration_seconds"]


def test_simulate_writes_report_dir_and_plan_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "report"
    run("simulate", "--config", str(EXAMPLES / "grpo-qwen-rule.yaml"), "--out", str(out),
        check=True)
    assert {"plan.json", "simulation.json", "trace.json"} <= {p.name for p in out.iterdir()}
    again = run_json("simulate", "--config", str(EXAMPLES / "grpo-qwen-rule.yaml"), "--plan",
                     str(out / "plan.json"))
    first = json.loads((out / "simulation.json").read_text())
    assert again["iteration_seconds"] == pytest.approx(first["iteration_seconds"])


def test_validate_meets_the_korthikanti_target_and_every_gate() -> None:
    out = run_json("validate")
    table5 = next(g for g in out["groups"] if g["group"] == "korthikanti_2022_table5")
    assert table5["cases"] == 8
    assert table5["max_abs_error_pct"] <= 10.0
    assert table5["meets_target"] is True
    assert all({"measured", "predicted", "error_pct"} <= set(c) for c in out["cases"])
    for group in out["groups"]:  # a regression in any group fails CI
        assert group["mean_abs_error_pct"] <= group["gate_mean_abs_error_pct"], group["group"]
        assert group["max_abs_error_pct"] <= group["gate_max_abs_error_pct"], group["group"]
        assert group["within_gate"] is True
        cases = [c for c in out["cases"] if c["group"] == group["group"] and not c["stage"]]
        assert group["cases"] == len(cases)
        assert group["bias_pct"] == pytest.approx(
            sum(c["error_pct"] for c in cases) / len(cases))
    # Whole RLHF steps with the source's stage timers beside them (not in the statistics).
    stages = [c for c in out["cases"] if c["group"] == "nemo_rl_v03_grpo_stages" and c["stage"]]
    assert {c["stage"] for c in stages} == {"policy_training", "refit", "generation",
                                            "logprobs"}
    v03 = next(g for g in out["groups"] if g["group"] == "nemo_rl_v03_grpo_stages")
    assert v03["goal_median_abs_error_pct"] == 15 and v03["meets_goal"] in (True, False)
    trt = next(g for g in out["groups"] if g["group"] == "tensorrt_llm_a100_fp16")
    assert any("per GPU" in a for a in trt["assumptions"])
    assert trt["bias_direction"] == "too fast"  # higher throughput than measured


def test_validate_fails_when_a_group_regresses(tmp_path: Path) -> None:
    from simulator.validation import CASES_FILE, run_validation

    text = CASES_FILE.read_text().replace("gate_max_abs_error_pct: 22.0",
                                          "gate_max_abs_error_pct: 5.0")
    cases = tmp_path / "cases.yaml"
    cases.write_text(text)
    # A case's framework profile file is named relative to the cases file: it comes along.
    for profile in CASES_FILE.parent.glob("hybridflow-paper-*.yaml"):
        (tmp_path / profile.name).write_text(profile.read_text())
    _, groups = run_validation(cases)
    failing = [g.group for g in groups if not g.passes]
    assert failing == ["fastertransformer_a100_fp16"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["estimate", "train", "--model", "llama2-7b", "--gpus", "16", "--tp", "16",
          "--global-batch", "8", "--seq-len", "512"], "tp=16 is larger than a node"),
        (["estimate", "train", "--model", "nope-7b", "--gpus", "8", "--global-batch", "8",
          "--seq-len", "512"], "--model: unknown model 'nope-7b'"),
        (["estimate", "generate", "--model", "llama2-7b", "--device", "tpu", "--batch", "1",
          "--prompt-len", "8", "--response-len", "8"], "--device: unknown device profile"),
        (["simulate", "--plan", "missing.json"], "missing.json: file not found"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], expected: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_job_file_names_file_and_key(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", (EXAMPLES / "ppo-7b.yaml").read_text().replace(
        "prompt_length: 1024", "prompt_length: -3"))
    result = run("simulate", "--config", str(job))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"hybridflow: error: {job}: workload.prompt_length: "
                                     "must be a positive integer, got -3")


def test_job_that_does_not_fit_exits_1_with_the_numbers(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", (EXAMPLES / "ppo-7b.yaml").read_text()
                .replace("llama2-7b", "llama2-70b").replace("nodes: 2", "nodes: 1"))
    result = run("simulate", "--config", str(job))
    assert result.returncode == 1
    assert "does not fit: needs" in result.stderr and "GiB" in result.stderr


def test_existing_output_is_not_damaged_by_a_failed_run(tmp_path: Path) -> None:
    out = tmp_path / "report"
    run("simulate", "--out", str(out), check=True)
    before = (out / "plan.json").read_text()
    job = write(tmp_path / "bad.yaml", "algorithm: ppo\nmodels: 3\n")
    assert run("simulate", "--config", str(job), "--out", str(out)).returncode == 2
    assert (out / "plan.json").read_text() == before


def test_planner_and_simulator_import_without_torch_or_ray() -> None:
    code = ("import sys, planner.cli, planner.report, simulator.engine, simulator.predict,"
            " simulator.validation;"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; print(bad)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_list_commands() -> None:
    assert "llama2-70b" in run("list", "models", check=True).stdout
    assert "h20" in run("list", "devices", check=True).stdout
    assert "safe-rlhf" in run("list", "algorithms", check=True).stdout


TINY_PPO = """\
algorithm: ppo
framework: hybridflow
models: {actor: tiny-4l, critic: tiny-4l, ref: tiny-2l, reward: tiny-2l}
cluster: {nodes: 1, gpus_per_node: 8}
workload: {prompts_per_iteration: 64, prompt_length: 16, response_length: 32,
           mini_batches_per_epoch: 2}
"""


def test_plan_json_keys_report_files_and_plan_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = run_json("plan", "--out", str(out))
    assert {"placement", "gpus_per_set", "iteration_seconds",
            "throughput_tokens_per_s"} <= set(result["best"])
    assert {"strategies", "search_seconds", "candidates_evaluated"} <= set(result)
    names = [s["name"] for s in result["strategies"]]
    assert names == ["colocate", "standalone", "split"]
    for strategy in result["strategies"]:
        assert {"name", "placement", "iteration_seconds", "throughput_tokens_per_s",
                "feasible"} <= set(strategy)
    feasible = [s["iteration_seconds"] for s in result["strategies"] if s["feasible"]]
    assert result["best"]["iteration_seconds"] <= min(feasible) + 1e-9
    expected = {"plan.json", "ranking.csv", "strategies.csv", "report.md", "report.html",
                "throughput.png", "timeline.png", "memory.png"}
    assert expected <= {p.name for p in out.iterdir()}
    assert "data:image/png;base64," in (out / "report.html").read_text()
    assert "Why this plan" in (out / "report.md").read_text()
    again = run_json("simulate", "--plan", str(out / "plan.json"))
    assert again["iteration_seconds"] == pytest.approx(result["best"]["iteration_seconds"])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "planner", "plan", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: os.umask(umask))
    assert result.returncode == 0, result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_plan_with_pinned_placement_and_with_a_plan_file(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", TINY_PPO)
    pinned = run_json("plan", "--config", str(job), "--out", str(tmp_path / "a"),
                      "--placement", "actor,ref|critic,reward")
    assert pinned["best"]["placement"] == "actor,ref|critic,reward"
    given = run_json("plan", "--config", str(job), "--out", str(tmp_path / "b"), "--plan",
                     str(tmp_path / "a" / "plan.json"))
    assert given["best"]["iteration_seconds"] == pytest.approx(
        pinned["best"]["iteration_seconds"])
    bad = run("plan", "--config", str(job), "--placement", "actor|critic")
    assert bad.returncode == 2 and "'ref' is missing" in bad.stderr


def test_plan_of_a_job_that_cannot_fit(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", (EXAMPLES / "ppo-7b.yaml").read_text()
                .replace("llama2-7b", "llama2-70b").replace("nodes: 2", "nodes: 1"))
    result = run("plan", "--config", str(job), "--out", str(tmp_path / "r"))
    assert result.returncode == 1
    # verl: FSDP without tensor parallelism, or Megatron with the frozen models unsharded, and
    # states kept in host memory between calls.
    assert "smallest cluster that fits: 32 GPUs" in result.stderr
    assert (tmp_path / "r" / "report.md").exists()


def test_compare_json_is_a_list_shaped_like_plan(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", TINY_PPO)
    out = tmp_path / "cmp"
    result = run_json("compare", "--config", str(job), "--gpus", "4,8", "--out", str(out))
    assert [r["gpus"] for r in result] == [4, 8]
    assert all({"best", "strategies", "search_seconds", "candidates_evaluated"} <= set(r)
               for r in result)
    assert {"compare.csv", "compare.md", "throughput_vs_gpus.png"} <= {
        p.name for p in out.iterdir()}


def test_the_product_never_imports_the_test_only_shims() -> None:
    """tests/compat patches GPU-only libraries for this CPU machine; no product module may
    import anything from tests/."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+tests\b", re.MULTILINE)
    for package in ("planner", "simulator", "executor", "profiles", "reports"):
        for path in (ROOT / package).rglob("*.py"):
            assert not pattern.search(path.read_text(encoding="utf-8")), path


def test_plan_json_on_a_mixed_cluster_ranked_by_cost(tmp_path: Path) -> None:
    out = run_json("plan", "--config", str(EXAMPLES / "ppo-7b-h100-h20.yaml"), "--out",
                   str(tmp_path), "--objective", "cost", "--pay-for", "used", "--top", "2")
    best = out["best"]
    assert len(best["node_groups"]) == len(best["gpus_per_set"])
    assert best["dollars_per_iteration"] > 0 and best["tokens_per_dollar"] > 0
    costs = [r["dollars_per_iteration"] for r in out["ranking"]]
    assert costs == sorted(costs)  # ranked by dollars, not by time
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [s["node_group"] for s in plan["sets"]] == best["node_groups"]
    assert plan["predicted"]["paying_for"] == "used"
    report = (tmp_path / "report.md").read_text()
    assert "| node_group | device |" in report and "Cost: **$" in report


def test_learning_rates_default_to_a_toys_or_to_verls() -> None:
    # Tiny models learn the built-in task from scratch at 1e-2; pretrained ones get verl's
    # 1e-6 (actor) and 1e-5 (critic) unless given.
    from dataclasses import replace

    from planner.cli import learning_rates
    from simulator.specs.job import default_job
    from simulator.specs.presets import MODEL_PRESETS

    real = default_job()  # PPO, four Llama-2-7B
    tiny = replace(real, models={r: MODEL_PRESETS["tiny-2l"] for r in real.models})
    assert learning_rates(tiny, None, None) == (1e-2, 1e-2)
    assert learning_rates(real, None, None) == (1e-6, 1e-5)
    assert learning_rates(real, 3e-6, None) == (3e-6, 1e-5)
    assert learning_rates(tiny, 0.1, 0.2) == (0.1, 0.2)


def test_a_dry_run_on_several_nodes_says_the_run_needs_a_shared_filesystem(
        tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", TINY_PPO.replace("nodes: 1, gpus_per_node: 8",
                                                        "nodes: 2, gpus_per_node: 2"))
    run_json("plan", "--config", str(job), "--out", str(tmp_path / "rep"), "--backend", "fsdp")
    plan = str(tmp_path / "rep" / "plan.json")
    many = run("execute", plan, "--dry-run", "--address", "10.0.0.1:6379", check=True)
    assert "shared filesystem" in many.stdout
    assert run_json("execute", plan, "--dry-run", "--address",
                    "10.0.0.1:6379")["needs_shared_filesystem"]
    local = run_json("execute", plan, "--dry-run")
    assert not local["needs_shared_filesystem"]
