"""Where a worker computes: its GPU when it has one, else the CPU.

Every device decision of the executor is made here, so the same worker code runs on this
machine (CPU, gloo) and on a GPU cluster (CUDA, NCCL for GPU tensors, gloo for the few CPU
tensors that cross ranks).
"""

from __future__ import annotations

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def mesh_device_type() -> str:
    """Device type of the torch.distributed device meshes (``init_device_mesh``)."""
    return "cuda" if has_gpu() else "cpu"


def worker_device() -> torch.device:
    """The device this worker computes on.

    Ray gives each worker one GPU and sets CUDA_VISIBLE_DEVICES to it, so inside the worker
    that GPU is device 0.
    """
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else \
        torch.device("cpu")


def process_group_backend() -> str:
    """gloo on CPU; on GPUs NCCL for CUDA tensors and gloo for CPU ones."""
    return "cpu:gloo,cuda:nccl" if has_gpu() else "gloo"


def local_gpu_index(ray_gpu_ids: list, visible: str | None) -> int:
    """The CUDA index of Ray's first GPU for this worker: its position in
    CUDA_VISIBLE_DEVICES when Ray set that variable (usually index 0), else its id."""
    if not ray_gpu_ids:
        return 0
    gpu = str(ray_gpu_ids[0])
    if visible:
        listed = [v.strip() for v in visible.split(",")]
        if gpu in listed:
            return listed.index(gpu)
    return int(gpu)


def bind_local_gpu() -> None:
    """Make the worker's GPU the current CUDA device (no-op without one)."""
    if not has_gpu():
        return
    import os

    import ray

    torch.cuda.set_device(local_gpu_index(ray.get_gpu_ids(),
                                          os.environ.get("CUDA_VISIBLE_DEVICES")))


def synchronize() -> None:
    """Wait for the GPU's queued work, so a clock read after it measures the work (no-op on
    CPU, where work is synchronous)."""
    if has_gpu():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    """Start a new peak of allocated GPU memory (per stage)."""
    if has_gpu():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes() -> int | None:
    """Peak GPU bytes allocated since the last reset (None without a GPU)."""
    return torch.cuda.max_memory_allocated() if has_gpu() else None
