"""Weight sync from the trainer's actor to the rollout set (``one_step_off`` plans).

The rollout set is a worker group of its own (its own placement group and torch.distributed
world), so the two sets share no process group. A sync group is made for the purpose: a
standalone gloo process group (NCCL on GPUs) over a TCP store opened by the trainer's rank 0,
whose members are the trainer's rank 0 (sync rank 0) and every rollout rank (sync ranks 1..R).
It is not the default group of any of them and is never registered with
``torch.distributed``: its collectives are called on the process group object itself.

Each sync sends the actor's tensors one by one, in the order of the model's
``named_parameters`` (tied weights once), in the compute dtype: every trainer rank takes part
in gathering the whole tensor from its shards (FSDP / tensor parallelism), then trainer rank 0
broadcasts it to the rollout ranks, and each rollout rank keeps its generation shard of it.
That is what the simulator prices: the model's bytes over the link between the two sets, plus
a latency per tensor. The sync goes through neither the controller nor Ray's object store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.device import has_gpu, synchronize, worker_device
from simulator.specs.model import ModelSpec

SYNC_TIMEOUT = timedelta(minutes=10)
"""How long a sync collective waits for its peers (the rollout set may still be generating
when the trainer arrives)."""

STORE_PREFIX = "weight_sync"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]


def weight_manifest(spec: ModelSpec) -> list[TensorSpec]:
    """The actor's tensors in sync order: the language model's parameters under Hugging Face
    names, as ``named_parameters`` lists them (a tied head once, as the embedding). Both sides
    derive it from the ModelSpec, so nothing but the tensors travels."""
    from executor.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(spec, value_head=False)
    return [TensorSpec(name, tuple(p.shape)) for name, p in model.named_parameters()]


def open_store(host: str, members: int) -> tuple[dist.TCPStore, int]:
    """The sync group's rendezvous store on the trainer's rank 0 (a port the system picks,
    kept bound); returns it and its port."""
    store = dist.TCPStore(host, 0, members, is_master=True, timeout=SYNC_TIMEOUT,
                          wait_for_workers=False)
    return store, store.port


class SyncGroup:
    """This process's membership in the sync group (sync rank 0 sends)."""

    def __init__(self, address: str, rank: int, size: int,
                 store: dist.TCPStore | None = None):
        host, port = address.rsplit(":", 1)
        if store is None:
            store = dist.TCPStore(host, int(port), size, is_master=False, timeout=SYNC_TIMEOUT)
        self.store = store
        self.rank = rank
        self.size = size
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        if has_gpu():
            self.group: Any = dist.ProcessGroupNCCL(prefixed, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, SYNC_TIMEOUT)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Sync rank 0's ``tensor`` into every member's (in place)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self.group = None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def whole_tensors(trainer: Any, manifest: list[TensorSpec]):
    """(name, whole tensor in the compute dtype) of the trainer's actor, one at a time, every
    rank of the trainer's group taking part in each gather: the torch backend gathers one
    DTensor at a time; another backend gives its Hugging Face state whole."""
    from torch.distributed.tensor import DTensor

    from executor.trainer import Trainer

    if isinstance(trainer, Trainer):
        params = dict(trainer.model.named_parameters())
        for item in manifest:
            param = params[item.name].detach()
            if isinstance(param, DTensor):
                # Cast first: FSDP's shards of a trained model are its fp32 masters.
                whole = param.to(trainer.dtype).full_tensor()
            else:
                whole = param.to(trainer.dtype)
            yield item.name, whole
        return
    state = trainer.hf_state()
    for item in manifest:
        yield item.name, state[item.name]


@torch.no_grad()
def send(trainer: Any, manifest: list[TensorSpec], group: SyncGroup | None) -> dict[str, float]:
    """Trainer side (every rank of the actor's group): gather each tensor whole and, on the
    rank in the sync group, broadcast it. Returns what it did (bytes sent, tensors, seconds
    gathering and broadcasting)."""
    synchronize()
    gather = broadcast = 0.0
    sent = 0
    start = time.perf_counter()
    for item, (name, whole) in zip(manifest, whole_tensors(trainer, manifest), strict=True):
        if tuple(whole.shape) != item.shape:
            raise RuntimeError(f"{name}: the trainer holds {tuple(whole.shape)}, the rollout "
                               f"expects {item.shape}")
        now = time.perf_counter()
        gather += now - start
        if group is not None:
            whole = whole.contiguous()
            group.broadcast(whole)
            sent += _bytes(whole)
        synchronize()
        start = time.perf_counter()
        broadcast += start - now
    return {"bytes": float(sent), "tensors": float(len(manifest)),
            "gather_seconds": gather, "broadcast_seconds": broadcast}


@torch.no_grad()
def receive(manifest: list[TensorSpec], group: SyncGroup, dtype: torch.dtype,
            keep: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Rollout side (every rank): receive each tensor whole and keep ``keep(name, tensor)``
    of it (the rank's generation shard). Returns the kept tensors and what it did."""
    synchronize()
    start = time.perf_counter()
    device = worker_device()
    kept: dict[str, torch.Tensor] = {}
    received = 0
    for item in manifest:
        buffer = torch.empty(item.shape, dtype=dtype, device=device)
        group.broadcast(buffer)
        received += _bytes(buffer)
        kept[item.name] = keep(item.name, buffer)
    synchronize()
    return kept, {"bytes": float(received), "tensors": float(len(manifest)),
                  "seconds": time.perf_counter() - start}
