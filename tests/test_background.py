"""planner/background.py: work in a forked child, collected like a plain call; and the plan a
search returns is the same whether its asynchronous modes ran beside it or after it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from planner.background import SERIAL_ENV, Background, fork_pays
from profiles.datafile import SpecError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="background processes are forked on Linux only")


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _refuse(key: str) -> None:
    raise SpecError("not a valid thing", key=key, source="job.yaml")


def _die() -> None:
    os._exit(7)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("fork", [True, False])
def test_the_value_comes_back_from_a_child_or_from_an_inline_call(fork: bool) -> None:
    with Background(_square_and_pid, 12, fork=fork) as job:
        assert job.forked is fork
        value, pid = job.result()
    assert value == 144
    assert (pid != os.getpid()) is fork


@pytest.mark.parametrize("fork", [True, False])
def test_an_error_is_raised_in_the_caller_as_the_call_raised_it(fork: bool) -> None:
    with Background(_refuse, "workload.n", fork=fork) as job, \
            pytest.raises(SpecError) as caught:
        job.result()
    assert str(caught.value) == "job.yaml: workload.n: not a valid thing"
    assert caught.value.key == "workload.n"
    if fork:  # the child's traceback travels with it, for HYBRIDFLOW_DEBUG
        assert "in the background process" in "".join(caught.value.__notes__)


def test_a_child_that_dies_without_a_result_is_reported_with_its_exit_code() -> None:
    with Background(_die, fork=True) as job, \
            pytest.raises(RuntimeError, match=r"_die ended without a result \(exit code 7\)"):
        job.result()


def test_leaving_the_block_before_the_result_ends_the_child() -> None:
    with Background(_sleep, 60, fork=True) as job:
        process = job._process
        assert process.is_alive()
    process.join(timeout=10)
    assert not process.is_alive()


def test_a_result_is_collected_once() -> None:
    job = Background(_square_and_pid, 3, fork=True)
    job.result()
    with pytest.raises(RuntimeError, match="collected once"):
        job.result()


def test_no_fork_beside_another_thread_or_when_told_to_run_serially(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    monkeypatch.delenv(SERIAL_ENV, raising=False)
    assert fork_pays() is (threading.active_count() == 1)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not fork_pays()
    finally:
        stop.set()
        other.join()
    monkeypatch.setenv(SERIAL_ENV, "1")
    assert not fork_pays()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    monkeypatch.delenv(SERIAL_ENV)
    assert not fork_pays()


def test_a_plan_is_the_same_with_its_modes_searched_beside_it_or_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The asynchronous modes (one_step_off, async) searched in a child process while the
    synchronous search runs, and inline after it: the same plans, modes, strategies and
    confidence, and the same cost-model cache counts of the synchronous search."""
    from planner import planning
    from planner.report import plan_json
    from planner.search import SearchOptions, cost_model_cache
    from simulator.specs.job import default_job

    job = default_job()
    forked_runs = []
    real = planning.Background

    def recording(*args, **kwargs):
        job_ = real(*args, **kwargs)
        forked_runs.append(job_.forked)
        return job_

    monkeypatch.setattr(planning, "Background", recording)
    outcomes = []
    for serial in ("0", "1"):
        monkeypatch.setenv(SERIAL_ENV, serial)
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
        result = planning.plan_job(job, SearchOptions())
        value = plan_json(result)
        value.pop("search_seconds")
        outcomes.append((json.dumps(value, sort_keys=True),
                         [m.name for m in result.modes],
                         result.stats.cost_model_cache["hits"] > 0))
    assert forked_runs == [threading.active_count() == 1, False]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == ["sync-colocate", "sync", "one_step_off", "async"]
    assert cost_model_cache()["misses"] > 0
