"""Shared fixtures. These tests need no GPU, no torch and no Ray."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Two test processes share this 2-core machine (pytest-xdist), and the executor workers and
# CLI processes the tests start share it with them: each takes one compute thread, as the
# executor's workers do (executor.worker.configure_threads). Set before torch or numpy load,
# here and in every process a test starts. An idle OpenMP thread spin-waits on a core the
# others need: the two-node placement test (alone 20 s) took 60 s beside a process running
# small torch matmuls on two threads and 30 s beside the same work on one (2026-12-02).
for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# No idle Python workers started with each local Ray (Ray's prestart_worker_first_driver, read
# from RAY_<name>): the executor's actors never take them (they start processes of their
# own), and the two idle workers of a local Ray cost ~2.6% of a core while they wait, on top
# of their start (measured 2026-12-03: an idle local Ray 0.058 cores with them, 0.033 without).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

import pytest  # noqa: E402

from simulator.specs.job import JobSpec, default_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "planner" / "examples"


def run_cli(args: list[str], *, cwd: Path = ROOT,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hybridflow ARGS`` in this process: what ``python -m planner`` calls
    (``planner.cli.main``) from ``cwd``, with ``env`` added to the environment for the call;
    its exit status, stdout and stderr. A child process per call costs a second or more of
    start-up and imports (and cold cost-model caches); the tests that are about the process
    itself (its imports, a fresh interpreter, signals) start one."""
    import contextlib
    import io
    import os
    from unittest import mock

    from planner.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    status = 0
    with mock.patch.dict(os.environ, env or {}), contextlib.chdir(cwd), \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(list(args))
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["hybridflow", *args], status, stdout.getvalue(),
                                       stderr.getvalue())


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The validation cache (simulator/validation.py) goes to a directory of this session,
    not the user's ~/.cache (subprocesses the tests start inherit it)."""
    import os

    os.environ["HYBRIDFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("hybridflow-cache"))


@pytest.fixture(autouse=True, scope="session")
def _ray_starts_its_own_local_cluster() -> None:
    """Every ``ray.init()`` without an address (the tests' own and the CLI's, in subprocesses
    too) starts a local Ray of its own. Without this, Ray joins the newest cluster recorded
    under /tmp/ray, such as the two-node ``ray.cluster_utils.Cluster`` that
    tests/test_executor_placement.py runs while another test process (pytest-xdist) starts
    its Ray. Tests that mean a cluster pass ``--address``."""
    import os

    os.environ["RAY_ADDRESS"] = "local"


@pytest.fixture(autouse=True)
def _no_user_profile_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDFLOW_PROFILE_PATH", raising=False)


@pytest.fixture
def paper_job() -> JobSpec:
    return default_job()


SESSION_RAY_GPUS = 4
"""Virtual GPUs of the test process's own Ray (``local_ray``): the largest plan the suite runs
in-process has four."""


@pytest.fixture(scope="session")
def local_ray():
    """This test process's Ray (one per pytest-xdist worker), started by the first test that
    asks for it and kept for every later one: the executor runs of the tests and their
    in-process ``hybridflow execute`` calls (``run_cli``), which join a Ray that is already up
    (executor.run._start_ray) instead of starting and stopping one of their own. A Ray start
    is seven processes and ~4 s of CPU on this 2-core machine. Tests about Ray's own start,
    other clusters or a fresh interpreter run ``hybridflow`` in a child process instead."""
    try:
        import ray
    except ImportError:  # a planner-only install: the tests that need Ray skip on their own
        yield None
        return
    if not ray.is_initialized():
        start_virtual_ray(SESSION_RAY_GPUS)
    yield ray
    ray.shutdown()


def start_virtual_ray(gpus: int) -> None:
    """A local Ray of ``gpus`` virtual GPUs on this CPU machine (two more CPUs than GPUs), its
    workers with the project on their path and one OpenMP thread each, as ``execute``'s own
    local Ray gives them."""
    import ray

    ray.init(num_gpus=gpus, num_cpus=gpus + 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def grpo_two_gpu_files(tmp_path: Path) -> tuple[Path, Path]:
    """(plan.json, job.json) of a tiny GRPO run for ``hybridflow execute``: tiny-2l actor and
    reference colocated on 2 GPUs, data parallel, rule reward."""
    import json

    job = tmp_path / "job.json"
    job.write_text(json.dumps({
        "algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "workload": {"prompts_per_iteration": 4, "samples_per_prompt": 2,
                     "mini_batches_per_epoch": 2}}))
    plan = tmp_path / "plan.json"
    par = {"tp": 1, "dp": 2, "sharding": "none", "sequence_parallel": False}
    plan.write_text(json.dumps({
        "format": "hybridflow-plan", "version": 1, "algorithm": "grpo",
        "sets": [{"roles": ["actor", "ref"], "gpus": 2}],
        "roles": {"actor": {"parallel": par, "generation": {"tp": 1}},
                  "ref": {"parallel": par}}}))
    return plan, job
