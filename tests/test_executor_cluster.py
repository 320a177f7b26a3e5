"""``hybridflow execute --address`` against a Ray cluster started elsewhere (CPU, virtual
GPUs): the cluster's workers do not share the driver's directory or PYTHONPATH, so they run
only if the executor ships its code and environment the way Ray intends (``runtime_env``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _ray_head(env: dict[str, str], cwd: Path, *extra: str):
    """A ``ray start --head --block`` with 2 virtual GPUs, its address yielded once
    ``ray status`` answers; stopped by its PID at the end."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray_cli is not None
    port = _free_port()
    # A small object store: the test session's own Ray already holds a large one in /dev/shm.
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-gpus=2",
         "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats",
         "--object-store-memory=200000000", *extra],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while subprocess.run([ray_cli, "status", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None, "ray start --head exited"
            assert time.time() < deadline, "the Ray head did not come up in 120 s"
            time.sleep(2)
        yield address
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


@pytest.fixture()
def separate_cluster(tmp_path: Path):
    """A head started from an empty directory with no PYTHONPATH."""
    # No token authentication: the test's clients carry no token.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    home = tmp_path / "elsewhere"
    home.mkdir()
    # Its own temp dir: a head started with the default one writes its address where every
    # later ray.init() on this machine looks, and leaves it behind when stopped. Short, for
    # the length limit of Unix socket paths.
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    try:
        with _ray_head(env, home, f"--temp-dir={temp_dir}") as address:
            yield address
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_run_without_an_address_starts_its_own_ray_beside_a_recorded_cluster(
        grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path) -> None:
    """A ``ray start`` cluster recorded where ``ray.init()`` looks (its temp dir, here a
    private RAY_TMPDIR so that no other test sees it): ``execute`` without ``--address`` or
    RAY_ADDRESS ran into "When connecting to an existing cluster, num_cpus and num_gpus must
    not be provided" (exit 3); it starts its own local Ray."""
    plan, job = grpo_two_gpu_files
    root = tempfile.mkdtemp(prefix="rayt-", dir="/tmp")  # short, for Unix socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=root, RAY_AUTH_MODE="disabled")
    out = tmp_path / "run"
    try:
        with _ray_head(env, tmp_path):
            # `ray start` records the address after its head answers `ray status`.
            recorded = Path(root) / "ray" / "ray_current_cluster"
            deadline = time.time() + 120
            while not recorded.exists():
                assert time.time() < deadline, "ray start recorded no cluster in 120 s"
                time.sleep(1)
            result = subprocess.run(
                [sys.executable, "-m", "planner", "execute", str(plan), "--config", str(job),
                 "--steps", "1", "--out", str(out), "--reward-warmup", "0"], cwd=ROOT,
                env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "meta.json").read_text())["ray_address"].startswith("local")


def test_execute_ships_code_and_environment_to_a_cluster(
        separate_cluster: str, grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path) -> None:
    plan, job = grpo_two_gpu_files
    out = tmp_path / "run"
    # The head runs without token authentication; a Ray started earlier in this process sets
    # RAY_AUTH_MODE=token in the environment, which the client must not inherit.
    env = {**os.environ, "NCCL_DEBUG": "WARN", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "planner", "execute", str(plan), "--config", str(job),
         "--steps", "1", "--out", str(out), "--reward-warmup", "0",
         "--address", separate_cluster], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    # Ray unpacked a copy of every package of the project onto the workers' path (this
    # machine's editable install still wins the import, which a cluster node lacks).
    from executor.run import PACKAGES

    shipped = {package.name for directory in meta["worker_code"]["shipped"]
               for package in Path(directory).iterdir() if (package / "__init__.py").exists()}
    assert shipped == set(PACKAGES)
    assert meta["worker_code"]["communication_env"]["NCCL_DEBUG"] == "WARN"
    assert meta["ray_address"] == separate_cluster


def test_cluster_runtime_env_carries_the_packages_and_communication_settings() -> None:
    from executor.run import PACKAGES, cluster_runtime_env

    env = cluster_runtime_env({"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HOME": "/root",
                               "PYTHONPATH": "/somewhere"})
    assert [Path(p).name for p in env["py_modules"]] == list(PACKAGES)
    assert all((Path(p) / "__init__.py").exists() for p in env["py_modules"])
    assert env["env_vars"] == {"OMP_NUM_THREADS": "1", "NCCL_SOCKET_IFNAME": "eth0",
                               "GLOO_SOCKET_IFNAME": "eth0",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_the_address_is_the_flag_else_ray_address_else_a_local_ray(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.cli.execute import ray_address

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_address("10.0.0.1:6379") == "10.0.0.1:6379"
    assert ray_address(None) == "10.0.0.2:6379"
    for unset in ("", "local"):
        monkeypatch.setenv("RAY_ADDRESS", unset)
        assert ray_address(None) is None
        assert os.environ["RAY_ADDRESS"] == "local"  # what makes ray.init() start its own
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address(None) is None and os.environ["RAY_ADDRESS"] == "local"
