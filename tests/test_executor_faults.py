"""A worker that raises, or dies, in the middle of a call: the run stops at once with one line
naming the operation and the cause, tears its workers down, and keeps the records of the
iterations that finished (faults injected with ``--worker-setup tests.faults.inject:...``)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("fault", "cause"), [
    ("raise_in_second_update", "RuntimeError: injected fault: CUDA error"),
    ("exit_in_second_update", "died")])
def test_a_failing_rank_stops_the_run_and_keeps_the_records(
        fault: str, cause: str, grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path) -> None:
    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "planner", "execute", str(plan), "--config", str(job),
         "--steps", "3", "--out", str(out), "--reward-warmup", "0",
         "--worker-setup", f"tests.faults.inject:{fault}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow: run failed: actor.update (set 0, rank 1)"), last
    assert cause in last and "Traceback" not in result.stderr
    assert str(out) in last  # where the records are
    with open(out / "measurements.csv") as f:
        iterations = {row["iteration"] for row in csv.DictReader(f)}
    assert iterations == {"0"}  # the finished iteration, nothing of the failed one
    meta = json.loads((out / "meta.json").read_text())
    assert meta["failure"]["operation"] == "actor.update" and meta["failure"]["iteration"] == 1
