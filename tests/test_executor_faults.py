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

from tests.conftest import ROOT, run_cli


@pytest.mark.parametrize(("fault", "cause"), [
    ("raise_in_second_update", "RuntimeError: injected fault: CUDA error"),
    ("exit_in_second_update", "died")])
def test_a_failing_rank_stops_the_run_and_keeps_the_records(
        fault: str, cause: str, grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path,
        local_ray: object) -> None:
    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"
    result = run_cli(["execute", str(plan), "--config", str(job), "--steps", "3", "--out",
                      str(out), "--reward-warmup", "0", "--max-restarts", "0",
                      "--worker-setup", f"tests.faults.inject:{fault}"])
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


def test_restarts_are_bounded_then_the_run_fails_in_one_line(
        grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path, local_ray: object) -> None:
    """A rank that dies in every second update: one restart (from the start: no checkpoint
    yet), the same death, and then the run fails with one line; meta.json lists the restart,
    and the finished iteration's rows are there once."""
    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"
    result = run_cli(["execute", str(plan), "--config", str(job), "--steps", "3", "--out",
                      str(out), "--reward-warmup", "0", "--max-restarts", "1",
                      "--worker-setup", "tests.faults.inject:exit_in_second_update"])
    assert result.returncode == 1, result.stderr[-2000:]
    assert "a worker failed again after 1 restart(s)" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow: run failed: actor.update (set 0, rank 1)"), last
    assert "Traceback" not in result.stderr
    meta = json.loads((out / "meta.json").read_text())
    (restart,) = meta["restarts"]
    assert restart["iteration"] == 1 and restart["restored_to_iteration"] == 0
    assert restart["checkpoint"] is None
    with open(out / "measurements.csv") as f:
        iterations = [row["iteration"] for row in csv.DictReader(f)
                      if row["node"] == "iteration"]
    assert iterations == ["0"]  # redone after the restart, written once


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(
        grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path, local_ray: object) -> None:
    """SIGKILL of rank 1 in iteration 2's update: the run restarts its workers from the
    checkpoint after iteration 2, finishes, and ends with the weights of a run that never
    failed; every iteration's rows are there once; meta.json says what the failure cost.
    The failing run is a child process with a Ray of its own: its workers read the fault's
    marker path from the environment they inherit from it."""
    import os

    from safetensors.torch import load_file

    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"

    def arguments(run: Path) -> list[str]:
        return ["execute", str(plan), "--config", str(job), "--steps", "4", "--out", str(run),
                "--reward-warmup", "0", "--seed", "3", "--checkpoint-every", "1",
                "--save-hf", str(run / "hf")]

    result = subprocess.run(
        [sys.executable, "-m", "planner", *arguments(out),
         "--worker-setup", "tests.faults.inject:kill_in_third_update_once"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "HYBRIDFLOW_FAULT_MARKER": str(tmp_path / "killed")})
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "killed").exists()  # the fault did happen
    assert "restarting the workers from" in result.stderr and "Traceback" not in result.stderr
    meta = json.loads((out / "meta.json").read_text())
    (restart,) = meta["restarts"]
    assert restart["iteration"] == 2 and restart["restored_to_iteration"] == 2
    assert "died" in restart["cause"] and restart["seconds_lost"] > 0
    with open(out / "measurements.csv") as f:
        iterations = [row["iteration"] for row in csv.DictReader(f)
                      if row["node"] == "iteration"]
    assert iterations == ["0", "1", "2", "3"]  # none lost, none twice
    clean = run_cli(arguments(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    a = load_file(out / "hf" / "model.safetensors")
    b = load_file(tmp_path / "clean" / "hf" / "model.safetensors")
    assert all(bool((a[k] == b[k]).all()) for k in a)


def test_ctrl_c_stops_cleanly_and_the_run_resumes(grpo_two_gpu_files: tuple[Path, Path],
                                                  tmp_path: Path, local_ray: object) -> None:
    """SIGINT to the command's process group (what Ctrl-C sends): the workers end, the Ray it
    started stops, the records of the finished iterations and the last checkpoint stay
    valid, one line says so (exit 130), and the run resumes from that checkpoint (in this
    process, on the test process's Ray)."""
    import os
    import signal
    import time

    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "planner", "execute", str(plan), "--config", str(job),
         "--steps", "200", "--out", str(out), "--reward-warmup", "0",
         "--checkpoint-every", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        # As from a terminal: a suite started in the background by a non-interactive shell
        # inherits SIGINT ignored, and Python then installs no Ctrl-C handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    deadline = time.time() + 600
    assert process.stderr is not None
    while time.time() < deadline:
        line = process.stderr.readline()
        lines.append(line)
        if line.startswith("iteration 5/200"):
            break
    os.killpg(process.pid, signal.SIGINT)
    _, rest = process.communicate(timeout=300)
    stderr = "".join(lines) + rest
    assert process.returncode == 130, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow: interrupted: the records of "), last
    assert "Traceback" not in stderr and "last checkpoint" in last
    time.sleep(2)
    left = subprocess.run(["ps", "-o", "pid=,comm=", "-s", str(process.pid)],
                          capture_output=True, text=True).stdout.strip()
    assert left == "", f"processes of the run still alive: {left}"
    meta = json.loads((out / "meta.json").read_text())
    finished = meta["interrupted"]["after_iterations"]
    with open(out / "measurements.csv") as f:
        iterations = [int(row["iteration"]) for row in csv.DictReader(f)
                      if row["node"] == "iteration"]
    assert iterations == list(range(finished)) and finished >= 5
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert all(not name.startswith(".") for name in checkpoints)  # no partial one left
    done = int(checkpoints[-1].split("_")[1])
    resumed = run_cli(["execute", "--resume", str(out), "--steps", str(done + 1)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"after iteration {done}" in resumed.stderr
    with open(out / "measurements.csv") as f:
        iterations = [int(row["iteration"]) for row in csv.DictReader(f)
                      if row["node"] == "iteration"]
    assert iterations == list(range(done + 1))
