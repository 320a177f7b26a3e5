"""The fused worker: one process per GPU of a colocated set, holding all of the set's roles
(they run one after another, in the order the controller calls them)."""

from __future__ import annotations

import os
import resource
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.batch import Batch
from executor.device import (
    bind_local_gpu,
    clear_meshes,
    empty_cache,
    has_gpu,
    peak_memory_bytes,
    process_group_backend,
    process_group_device,
    reset_peak_memory,
    synchronize,
    worker_device,
)
from executor.roles import ROLE_CLASSES, Role, RoleConfig


def configure_threads() -> None:
    """One compute thread per worker: with two cores shared by several workers, more threads
    make every timing slower and erratic."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def setup_hook_parts(spec: str) -> tuple[str, str]:
    """``MODULE[:FUNCTION]`` of ``--worker-setup`` as (module, function); the function is
    ``setup`` when not named."""
    module, _, function = spec.partition(":")
    return module, function or "setup"


def run_setup_hook(spec: str) -> None:
    """Import ``module:function`` and call it: site-specific preparation every worker runs
    before it builds a model (``hybridflow execute --worker-setup``)."""
    import importlib

    module, function = setup_hook_parts(spec)
    getattr(importlib.import_module(module), function)()


class SetWorker:
    """One rank of the worker group of colocated set ``set_index`` (the rank is given when
    the group forms, once the controller knows which node each worker landed on)."""

    def __init__(self, world: int, set_index: int, setup: str | None = None):
        configure_threads()
        if setup:
            run_setup_hook(setup)
        bind_local_gpu()
        self.device = worker_device()
        self.rank = -1
        self._store: dist.TCPStore | None = None
        self.world = world
        self.set_index = set_index
        self.roles: dict[str, Role] = {}

    def location(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, GPU id) of this worker."""
        import ray

        gpu_ids = ray.get_gpu_ids()
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                int(gpu_ids[0]) if gpu_ids else -1)

    def open_rendezvous(self, host: str) -> int:
        """Rank 0: start the group's rendezvous store on a port the system picks and keep it
        bound (no window in which another process could take the port); returns the port."""
        self._store = dist.TCPStore(host, 0, self.world, is_master=True,
                                    timeout=timedelta(minutes=10), wait_for_workers=False)
        return self._store.port

    def join(self, master: str, rank: int) -> int:
        """Take ``rank`` and form the set's torch.distributed group through rank 0's store."""
        self.rank = rank
        host, port = master.rsplit(":", 1)
        store = self._store if rank == 0 else dist.TCPStore(
            host, int(port), self.world, is_master=False, timeout=timedelta(minutes=10))
        dist.init_process_group(process_group_backend(), store=store, rank=rank,
                                world_size=self.world, timeout=timedelta(minutes=10),
                                device_id=process_group_device())
        return rank

    def clock(self) -> float:
        """This worker's wall clock, seconds (for the controller's offset estimate)."""
        return time.time()

    def has_gpu(self) -> bool:
        return has_gpu()

    def code_location(self) -> dict[str, Any]:
        """Where this worker imported the executor from, and the copies of the project's
        packages Ray unpacked for this job onto its path (``runtime_env`` ``py_modules``;
        an editable install on the node takes precedence over them)."""
        import sys

        import executor

        shipped = [p for p in sys.path if "runtime_resources" in p]
        return {"executor": str(Path(executor.__file__).resolve().parent),
                "shipped": sorted(p for p in shipped
                                  if any(Path(p).glob("*/__init__.py"))),
                "communication_env": {k: v for k, v in os.environ.items()
                                      if k.startswith(("NCCL_", "GLOO_"))}}

    def build(self, config: RoleConfig) -> dict[str, Any]:
        start = time.perf_counter()
        self.roles[config.role] = ROLE_CLASSES[config.role](config)
        return {"seconds": time.perf_counter() - start,
                "state_bytes": self.roles[config.role].state_bytes()}

    def call(self, role: str, method: str, payload: Any) -> tuple[Any, dict[str, Any]]:
        """Run ``role.method(payload)``; the second return value is this rank's record."""
        target = self.roles[role]
        synchronize()
        reset_peak_memory()
        start_wall = time.time()
        start = time.perf_counter()
        if isinstance(payload, Batch):
            payload = payload.to(self.device)
        offloaded = self._offload_for_generation() if method == "generate" else 0
        try:
            result = getattr(target, method)(payload)
        finally:
            if offloaded:
                for other in self.roles.values():
                    other.trainer.reload()
        if isinstance(result, Batch):
            result = result.to("cpu")
        synchronize()  # an update returns only metrics: its kernels may still be queued
        seconds = time.perf_counter() - start
        if method in ("generate", "update"):
            empty_cache()  # the KV cache and activations go back to the device, not the cache
        info: dict[str, Any] = {
            "rank": self.rank, "start": start_wall, "end": start_wall + seconds,
            "compute_seconds": seconds,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_gpu_bytes": peak_memory_bytes(),
        }
        # After every call: optimizer states appear at the first step, and FSDP's gradients
        # come and go.
        info["state_bytes"] = target.state_bytes()
        if offloaded:
            info["offloaded_bytes"] = offloaded
        transition = getattr(target, "last_transition", None)
        if method == "generate" and transition is not None:
            info["transition"] = {
                "mode": transition.mode, "seconds": transition.seconds,
                "bytes_received_per_gpu": transition.bytes_received_per_gpu,
                "peak_param_bytes_per_gpu": transition.peak_param_bytes_per_gpu,
                "generation_param_bytes": transition.generation_param_bytes,
                "training_param_bytes": transition.training_param_bytes}
        if isinstance(result, Batch):
            info["rows"] = len(result)
        return result, info

    def _offload_for_generation(self) -> int:
        """Move the set's training-only states to host memory while generation runs, as the
        framework profile says (each role's ``offload_*``); bytes moved."""
        moved = 0
        for role in self.roles.values():
            config = role.config
            if config.offload_optimizer or config.offload_grads:
                moved += role.trainer.offload(optimizer=config.offload_optimizer,
                                              grads=config.offload_grads)
        return moved

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        clear_meshes()
        if dist.is_initialized():
            dist.destroy_process_group()
