"""tests.rank_pool: the spawned ranks that several tests share behave as fresh processes to
each body, and a failing body fails its call as ``torch.multiprocessing.start_processes``
does."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.rank_pool import RankFailedError, RankPool, run_ranks


def report(rank: int, out: str, mark_environment: bool) -> None:
    """Write what this process is and sees: its pid, a first draw of each generator, and
    whether a variable an earlier body set is still there."""
    import random

    import numpy as np
    import torch

    Path(f"{out}.{rank}").write_text(json.dumps({
        "pid": os.getpid(), "torch": float(torch.rand(1)), "python": random.random(),
        "numpy": float(np.random.rand()),
        "leftover": os.environ.get("RANK_POOL_TEST_LEFTOVER")}))
    if mark_environment:
        os.environ["RANK_POOL_TEST_LEFTOVER"] = "set by an earlier body"
    torch.manual_seed(1234 + rank)  # a body that reseeds must not change the next body's draws


def fail_on_rank_one(rank: int, how: str) -> None:
    if rank != 1:
        return
    if how == "raise":
        raise ValueError("injected on rank one")
    if how == "exit":
        os._exit(3)
    time.sleep(60)


def _read(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


def test_a_kept_rank_gives_each_body_what_a_fresh_process_would(tmp_path: Path) -> None:
    pool = RankPool(2)
    try:
        pool.run(report, (str(tmp_path / "first"), True))
        pool.run(report, (str(tmp_path / "second"), False))
    finally:
        pool.close()
    first, second = _read(tmp_path / "first", 2), _read(tmp_path / "second", 2)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the same processes
    for before, after in zip(first, second, strict=True):
        assert (before["torch"], before["python"], before["numpy"]) == \
            (after["torch"], after["python"], after["numpy"])
        assert after["leftover"] is None


@pytest.mark.parametrize(("how", "message"), [
    ("raise", "raised on rank 1:"), ("exit", "rank(s) died (rank, exit code): [(1, 3)]"),
    ("hang", "not finished on every rank after 3 s")])
def test_a_failing_rank_fails_the_call_and_ends_the_pool(how: str, message: str,
                                                         tmp_path: Path) -> None:
    pool = RankPool(2)
    with pytest.raises(RankFailedError) as failure:
        pool.run(fail_on_rank_one, (how,), timeout_seconds=3)
    assert message in str(failure.value)
    if how == "raise":
        assert "ValueError: injected on rank one" in str(failure.value)
    assert not pool.alive
    assert not any(p.is_alive() for p in pool._processes)  # killed, not left waiting


def test_after_a_failure_the_next_call_starts_fresh_ranks(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError):
        run_ranks(fail_on_rank_one, ("raise",), 2)
    run_ranks(report, (str(tmp_path / "after"), False), 2)
    assert len({r["pid"] for r in _read(tmp_path / "after", 2)}) == 2
