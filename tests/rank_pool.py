"""Spawned rank processes that outlive one test: ``run_ranks(body, args, world)`` is
``torch.multiprocessing.start_processes(body, args, nprocs=world, start_method="spawn")``
on processes this test process keeps for the next body of the same world size.

Why: a spawned rank spends most of a small test importing its libraries before it computes
anything. Measured on this project's 2-core machine (2026-12-03): ``import executor.worker``
(torch, DTensor) 2.7-3.4 s of CPU, and Megatron-core with its CPU shims 7.0 s, while a
tiny-model layout test computes for well under a second; tests/engines/test_megatron.py
alone started 43 Megatron ranks. A pool pays each import once per world size.

What a body sees is what a fresh process would give it: the random generators of torch,
Python and numpy are put back to their state at process start before each body, and after
each body the environment is restored and any process group, Megatron parallel state or
cached device mesh it left behind is torn down. A body that raises, a rank that dies and a
body that runs past its timeout all fail the call (as ``start_processes`` does) and end the
pool, whose processes are then killed: the next call starts fresh ones.

Bodies of ``tests.engines`` (which install the Megatron CPU shims, for the life of the
process) get pools of their own, so no torch-backend body runs under them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as mp

KEPT_WORLD_MAX = 4
"""Pools of at most this many ranks are kept between bodies; a larger one ends after its body
(each idle rank holds a few hundred MB, and this machine has 23 GB for two test processes,
their Ray clusters and workers)."""

DEFAULT_TIMEOUT_SECONDS = 900.0
"""How long one body may run on every rank before the call fails (a body that waits for a
peer which failed waits in gloo's collective for its whole 30-minute timeout)."""


class RankFailedError(RuntimeError):
    """A body raised on some rank, a rank died, or the body ran past its timeout."""


def _reset_after_body(environment: dict[str, str]) -> None:
    """Tear down what a body may leave behind for the next one."""
    import torch.distributed as dist

    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if "executor.device" in sys.modules:
        sys.modules["executor.device"].clear_meshes()
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
    torch.set_default_dtype(torch.float32)


def _serve(rank: int, connection: Any) -> None:
    """One rank: run each (body, args) it receives as ``body(rank, *args)`` and answer None
    or the traceback; exit on None or after a failure."""
    import random

    import numpy as np

    fresh = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    environment = dict(os.environ)
    while (job := connection.recv()) is not None:
        body, args = job
        torch.set_rng_state(fresh[0])
        random.setstate(fresh[1])
        np.random.set_state(fresh[2])
        try:
            body(rank, *args)
            _reset_after_body(environment)
        except BaseException:  # reported to the test process, which raises
            connection.send(traceback.format_exc())
            break
        connection.send(None)
    # No C++ static destructors: gloo's threads can abort a process at interpreter exit
    # ("terminate called without an active exception") after its work is done.
    os._exit(0)


class RankPool:
    """``world`` spawned processes, rank 0 to world - 1, waiting for bodies."""

    def __init__(self, world: int):
        context = mp.get_context("spawn")
        self.world = world
        pipes = [context.Pipe() for _ in range(world)]
        self._connections = [mine for mine, _ in pipes]
        self._processes = [context.Process(target=_serve, args=(rank, theirs), daemon=True)
                           for rank, (_, theirs) in enumerate(pipes)]
        for process in self._processes:
            process.start()
        for _, theirs in pipes:
            theirs.close()  # the child's end lives on in the child only
        self.alive = True

    def run(self, body: Callable[..., None], args: tuple,
            timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        """``body(rank, *args)`` on every rank; returns when all finished, raises
        ``RankFailedError`` (and ends the pool) otherwise."""
        for connection in self._connections:
            connection.send((body, args))
        deadline = time.monotonic() + timeout_seconds
        pending = dict(enumerate(self._connections))
        while pending:
            for connection in wait(list(pending.values()), timeout=1.0):
                rank = self._connections.index(connection)
                try:
                    error = connection.recv()
                except (EOFError, OSError):  # the rank died; the check below names it
                    self._processes[rank].join(timeout=5)
                    break
                if error is not None:
                    self.close(graceful=False)
                    raise RankFailedError(f"{body.__qualname__} raised on rank {rank}:\n{error}")
                del pending[rank]
            dead = [(rank, self._processes[rank].exitcode) for rank in pending
                    if not self._processes[rank].is_alive()]
            if dead:
                self.close(graceful=False)
                raise RankFailedError(f"{body.__qualname__}: rank(s) died (rank, exit code): "
                                      f"{dead}")
            if pending and time.monotonic() > deadline:
                self.close(graceful=False)
                raise RankFailedError(f"{body.__qualname__}: not finished on every rank after "
                                      f"{timeout_seconds:.0f} s")

    def close(self, graceful: bool = True) -> None:
        """Ask idle ranks to leave, then kill any that did not (at once unless
        ``graceful``: after a failure a rank may wait in a collective for a peer)."""
        if not self.alive:
            return
        self.alive = False
        for connection in self._connections:
            with contextlib.suppress(OSError, ValueError):  # the rank may be gone
                connection.send(None)
            connection.close()
        for process in self._processes:
            process.join(timeout=5 if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


_POOLS: dict[tuple[bool, int], RankPool] = {}


def _pool_key(body: Callable[..., None], world: int) -> tuple[bool, int]:
    return body.__module__.startswith("tests.engines"), world


def run_ranks(body: Callable[..., None], args: tuple, world: int,
              timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
    """``body(rank, *args)`` on ``world`` spawned ranks (a module-level function, as spawn
    needs), on this process's kept pool of that size; see the module docstring."""
    key = _pool_key(body, world)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        pool = _POOLS[key] = RankPool(world)
    try:
        pool.run(body, args, timeout_seconds)
    finally:
        if world > KEPT_WORLD_MAX or not pool.alive:
            pool.close()
            _POOLS.pop(key, None)


def close_pools() -> None:
    """End every kept pool (when the test process exits)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)
