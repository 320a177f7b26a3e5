"""Where a worker computes: its GPU when it has one, else the CPU.

Every device decision of the executor is made here, so the same worker code runs on this
machine (CPU, gloo) and on a GPU cluster (CUDA, NCCL for GPU tensors, gloo for the few CPU
tensors that cross ranks).
"""

from __future__ import annotations

from typing import Any

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
    """One backend per device: gloo on CPU, NCCL on GPUs (every tensor the executor sends
    between ranks lives on the worker's device; a second, gloo backend would open
    connections between all ranks for nothing)."""
    return "nccl" if has_gpu() else "gloo"


def process_group_device() -> torch.device | None:
    """The device to bind the process group to (``init_process_group(device_id=...)``, so
    NCCL can split communicators for sub-meshes); None on CPU."""
    return worker_device() if has_gpu() else None


_MESHES: dict[tuple, object] = {}


def clear_meshes() -> None:
    """Forget the meshes (before the process group they were made from is destroyed)."""
    _MESHES.clear()


def shared_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One device mesh per (shape, dimension names) per process: the roles of a set that
    share a layout share its communicators instead of each opening its own."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (mesh_device_type(), tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(key[0], key[1], mesh_dim_names=key[2])
    return _MESHES[key]


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


def nvidia_driver_present() -> bool:
    """Whether this machine has NVIDIA GPUs for its driver (the driver's /proc entry or a
    /dev/nvidiaN device file). Ray GPUs on a machine without them are virtual: a CPU run."""
    from pathlib import Path

    return Path("/proc/driver/nvidia/version").exists() or \
        any(Path("/dev").glob("nvidia[0-9]*"))


def unusable_gpu_reason(ray_gpu_ids: list, cuda_available: bool,
                        driver_present: bool) -> str | None:
    """Why a worker must not start (None: it may): Ray gave it a GPU of a machine that has
    NVIDIA GPUs, but its torch sees no CUDA device, so it would train on the CPU with gloo
    (issue 31 defect 8: silently, before)."""
    if not ray_gpu_ids or cuda_available or not driver_present:
        return None
    import os

    return (f"Ray gave this worker GPU {ray_gpu_ids[0]} of a machine with NVIDIA GPUs, but "
            f"its torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA "
            f"device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): it "
            "would run on the CPU with gloo. Install a CUDA build of torch on every node, or "
            "check that the driver matches it")


def bind_local_gpu() -> None:
    """Make the worker's GPU the current CUDA device; refuse a GPU that torch cannot use
    (``unusable_gpu_reason``). No-op on virtual GPUs (a machine without NVIDIA GPUs)."""
    import ray

    if not has_gpu():
        ids = ray.get_gpu_ids() if ray.is_initialized() else []
        reason = unusable_gpu_reason(ids, False, nvidia_driver_present())
        if reason:
            raise RuntimeError(reason)
        return
    import os

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


def empty_cache() -> None:
    """Hand the allocator's cached blocks back to the device (after generation and updates,
    so that the next colocated model finds the memory the planner assumes free; no-op on
    CPU)."""
    if has_gpu():
        torch.cuda.empty_cache()
