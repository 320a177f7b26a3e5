"""The GPU check kit's CPU dry run (issue 31): the kit end to end on tiny models, in a process
where Ray and vLLM cannot be imported (the kit runs on a plain CUDA PyTorch image)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

RAY_FREE = ("import sys\n"
            "for blocked in ('ray', 'vllm', 'megatron'):\n"
            "    sys.modules[blocked] = None\n"
            "from benchmarks.gpu_check import main\n"
            "sys.exit(main(sys.argv[1:]))\n")


def test_the_kit_runs_on_the_cpu_without_ray_and_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-c", RAY_FREE, "--out", str(out),
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failed"] == []
    assert results["environment"]["backend"] == "gloo"
    assert results["environment"]["ray"] in (True, False)  # recorded, not needed
    checks = {(c["model"], c["check"]): c for c in results["checks"]}
    for model, family in (("tiny-qwen2", "Qwen2ForCausalLM"),
                          ("tiny-llama3.1", "LlamaForCausalLM")):
        assert checks[(model, "save-hf checkpoint reloads equal")]["passed"] is True
        loaded = checks[(model, "transformers loads it (no missing or unexpected weight)")]
        assert loaded["measured"] == family and loaded["passed"] is True
        timed = [c for (m, what), c in checks.items()
                 if m == model and what.startswith(("training step (", "log-prob pass",
                                                    "generation ("))]
        assert len(timed) == 3
        assert all(c["measured"] > 0 and c["predicted"] > 0 for c in timed)
    assert any(m.startswith("profile vs") for m, _ in checks)
    table = (out / "table.md").read_text()
    assert "| model | check | measured | predicted | error | |" in table
    assert table.count("\n|") == len(results["checks"]) + 2  # header, rule, one row each


def test_the_kit_refuses_cuda_where_there_is_none(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out",
                           str(tmp_path), "--device", "cuda"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert "torch sees no CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_python_without_torch_gets_one_line(tmp_path: Path) -> None:
    """The kit runs with the image's own Python (``make gpu-check`` uses python3): where
    that Python has no torch, one line says so and which Python to use, not a traceback."""
    code = ("import runpy, sys\n"
            "sys.modules['torch'] = None\n"
            "runpy.run_module('benchmarks.gpu_check', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code, "--out", str(tmp_path / "check")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("gpu_check: error:") and "has no torch" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
