"""Megatron context parallelism (context_parallel_size, cp): a sequence's tokens are split over
``cp`` ranks (2 x cp chunks, rank i holding chunks i and 2cp - 1 - i, so that causal attention
work is even), every other part of a layer computes on the rank's own tokens, and attention
gets the other ranks' keys and values around a ring: cp - 1 steps, each sending this rank's
current K/V chunk to the next rank while attention runs on the chunk it holds (Megatron-core
``cp_comm_type`` "p2p", its default: transformer_config.py "Exchange KV chunks with P2P
communications in ring topology. P2P is async and can be overlapped with attention compute";
TransformerEngine's AttnFuncWithCPAndKVP2P). The backward pass circulates the K/V chunks and
their gradients. As with Ulysses (``simulator/costs/ulysses.py``) the cost models price a
rank's layer at micro-batch / cp and add these exchanges."""

from __future__ import annotations

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.primitives import group_crosses_nodes, p2p_seconds
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import ParallelConfig


def ring_step_bytes(model: ModelSpec, *, tokens: float, tp: int, dtype: str) -> float:
    """Bytes one ring step sends: the keys and values of a rank's ``tokens`` tokens (its
    tensor-parallel share of the KV heads)."""
    return tokens * 2 * model.kv_size / tp * DTYPE_BYTES[dtype]


def context_parallel_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float,
                             tp: int, cp: int, dtype: str, attention_seconds: float,
                             crosses_nodes: bool, gpus_per_node: int,
                             busy_ranks_per_node: int) -> tuple[float, float]:
    """(forward, backward) seconds one layer's ring exchange adds beyond the attention it
    hides behind, for a rank holding ``tokens`` tokens whose attention forward takes
    ``attention_seconds`` (its whole share): each of the cp - 1 steps sends one K/V chunk while
    attention runs on 1 / cp of that share; the backward sends the chunk and its gradient
    while attention's backward (twice its forward) runs."""
    if cp <= 1:
        return 0.0, 0.0
    step = p2p_seconds(profile, ring_step_bytes(model, tokens=tokens, tp=tp, dtype=dtype),
                       crosses_nodes, busy_ranks_per_node=busy_ranks_per_node,
                       gpus_per_node=gpus_per_node)
    hidden_behind = attention_seconds / cp
    forward = (cp - 1) * max(0.0, step - hidden_behind)
    backward = (cp - 1) * max(0.0, 2 * step - 2 * hidden_behind)
    return forward, backward


def layout_ring_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                        tokens: float, dtype: str, attention_seconds: float,
                        gpus_per_node: int) -> tuple[float, float]:
    """``context_parallel_seconds`` for a rank of layout ``par``: its cp ranks are ``tp``
    apart (Megatron's order), every rank of the node exchanging at once."""
    return context_parallel_seconds(
        model, profile, tokens=tokens, tp=par.tp, cp=par.cp, dtype=dtype,
        attention_seconds=attention_seconds,
        crosses_nodes=group_crosses_nodes(par.cp, par.tp, gpus_per_node),
        gpus_per_node=gpus_per_node, busy_ranks_per_node=par.world_size)
