"""How fast this machine's host runs right now: a fixed piece of eager PyTorch work, timed.

On a shared virtual machine the same code runs 10-50% faster or slower from one hour to the
next (neighbours, CPU steal). Every run records this probe so that calibration and accuracy
can compare runs made at different times (``planner/calibration.py``): a run's predicted times
scale with its probe against the probe of the runs the profile was fitted on.
"""

from __future__ import annotations

import statistics
import time

import torch

PROBE_OPERATIONS = 2000
"""Small tensor operations per repeat: the kind of work (per-operation host cost) that
dominates the executor's tiny-model runs on a CPU."""


def host_probe_seconds(repeats: int = 7) -> float:
    """Median seconds of PROBE_OPERATIONS small eager operations on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(64, 64)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = x
            for _ in range(PROBE_OPERATIONS // 4):
                y = torch.tanh(y @ x * 0.01 + 1.0)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(threads)
