"""The weight sync of an asynchronous plan: after an update the trainer's actor sends its new
weights to the rollout set's generation replicas.

How verl's one-step-off-policy and fully-async trainers do it (NCCL, tensor by tensor): each
weight tensor is gathered whole on the trainer (FSDP ``full_tensor``: an all-gather over the
shards holding it; Megatron: over its tensor and pipeline shards) and broadcast from one
trainer rank to every rollout rank over a collective group spanning both sets; each rollout
rank keeps its own tensor-parallel slice. So per tensor: one all-gather inside the trainer's
actor layout and one broadcast across the sets, one after the other.

A broadcast pipelines its chunks down a chain of ranks, so it costs the message over the
slowest link on the way (the sender's NIC when the sets sit on different nodes, NVLink when
they share one) plus one link latency per hop.
"""

from __future__ import annotations

from dataclasses import dataclass

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.primitives import all_gather_seconds, group_span, p2p_seconds
from simulator.costs.transition import weight_tensors
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import ParallelConfig


@dataclass(frozen=True, slots=True)
class WeightSyncCost:
    """One sync of the actor's weights from the trainer to the rollout set."""

    seconds: float
    gather_seconds: float
    """Assembling each tensor whole on the trainer (all-gathers over its shards)."""
    broadcast_seconds: float
    """Sending each tensor from one trainer rank to every rollout rank."""
    bytes_sent: float
    """Weight bytes broadcast (the whole model, once)."""
    tensors: int
    """Tensors synced (one gather and one broadcast each)."""


def broadcast_seconds(link: DeviceProfile, message_bytes: float, receivers: int, *,
                      crosses_nodes: bool, gpus_per_node: int) -> float:
    """A pipelined broadcast of ``message_bytes`` from one rank to ``receivers`` ranks: the
    message over the bottleneck link once, plus a link latency per further hop of the chain."""
    if message_bytes <= 0 or receivers < 1:
        return 0.0
    one_hop = p2p_seconds(link, message_bytes, crosses_nodes, gpus_per_node=gpus_per_node)
    hop_latency = (link.inter_node if crosses_nodes else link.intra_node).latency_seconds
    return one_hop + (receivers - 1) * hop_latency


def weight_sync(model: ModelSpec, trainer: DeviceProfile, link: DeviceProfile,
                train: ParallelConfig, *, rollout_gpus: int, dtype: str,
                crosses_nodes: bool, gpus_per_node: int) -> WeightSyncCost:
    """Seconds of one weight sync: per weight tensor, an all-gather over the trainer ranks
    holding its shards (on ``trainer``'s links) and a broadcast to ``rollout_gpus`` ranks
    over ``link`` (the link between the two sets)."""
    element_bytes = DTYPE_BYTES[dtype]
    shards = train.weight_shards
    span = group_span(shards, 1, gpus_per_node)
    gather = broadcast = 0.0
    count = 0
    total = 0.0
    # An MoE model's routed experts are whole on one expert-parallel rank each (or cut over
    # etp): they are gathered over etp only, the rest over the tensor x pipeline shards.
    expert_shards = train.weight_shards if train.sharding == "fsdp" else train.etp
    parts = ((weight_tensors(model, part="dense"), shards, span),
             (weight_tensors(model, part="experts"), expert_shards,
              group_span(expert_shards, 1, gpus_per_node)))
    for tensors, group, group_at in parts:
        for elements, how_many in tensors.items():
            nbytes = elements * element_bytes
            gather += how_many * all_gather_seconds(trainer, nbytes, group, span=group_at)
            broadcast += how_many * broadcast_seconds(link, nbytes, rollout_gpus,
                                                      crosses_nodes=crosses_nodes,
                                                      gpus_per_node=gpus_per_node)
            count += how_many
            total += how_many * nbytes
    return WeightSyncCost(seconds=gather + broadcast, gather_seconds=gather,
                          broadcast_seconds=broadcast, bytes_sent=total, tensors=count)
