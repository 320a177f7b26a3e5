"""Megatron context parallelism (context_parallel_size, cp): a sequence's tokens are split over
``cp`` ranks (2 x cp chunks, rank i holding chunks i and 2cp - 1 - i, so that causal attention
work is even), every other part of a layer computes on the rank's own tokens, and attention
gets the other ranks' keys and values around a ring: cp - 1 steps, each sending this rank's
current K/V chunk to the next rank while attention runs on the chunk it holds (Megatron-core
``cp_comm_type`` "p2p", its default: transformer_config.py "Exchange KV chunks with P2P
communications in ring topology. P2P is async and can be overlapped with attention compute";
TransformerEngine's AttnFuncWithCPAndKVP2P). The backward pass circulates the K/V chunks and
their gradients. As with Ulysses (``simulator/costs/ulysses.py``) the cost models price a
rank's layer at micro-batch / cp and add these exchanges.

OpenRLHF's ring attention (``--ds.ring_attn_size``) is ring-flash-attn's "llama3" variant
instead (zhuzilin/ring-flash-attention ring_flash_attn/llama3_flash_attn_varlen.py, used by
substitute_hf_flash_attn in ring_flash_attn/adapters/hf_adapter.py): the packed micro-batch
is cut into cp contiguous slices, and in every attention layer each rank all-gathers the keys
and values of the whole micro-batch, ring_attn_head_stride KV heads per call (OpenRLHF's
default 1), before running attention on them; the backward all-gathers them again and
reduce-scatters their gradients. The collectives are issued between the attention kernels on
one stream, so nothing hides them. Causal attention over contiguous slices is uneven: the rank
holding the end of a sequence attends to all of it (``busiest_attention_share``)."""

from __future__ import annotations

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.primitives import (
    all_gather_seconds,
    group_crosses_nodes,
    p2p_seconds,
    reduce_scatter_seconds,
)
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


KV_HEADS_PER_GATHER = 1
"""KV heads one all-gather of the llama3 exchange carries: OpenRLHF's --ds.ring_attn_head_stride
default (OpenRLHF 0.11.2 openrlhf/cli/train_ppo_ray.py:546-552), which its export writes."""


def busiest_attention_share(sequences_per_micro_batch: float, cp: int) -> float:
    """Attention work of the busiest of cp contiguous slices of a packed micro-batch, over an
    even share: with k equal causal sequences and k < cp, each spans cp / k slices and the
    slice at a sequence's end attends to all of it, 2 - k / cp times the even share; from
    k >= cp on, every slice holds whole sequences (even)."""
    if cp <= 1:
        return 1.0
    return max(1.0, 2.0 - sequences_per_micro_batch / cp)


def all_gather_kv_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                          cp: int, dtype: str, attention_seconds: float,
                          sequences_per_micro_batch: float, crosses_nodes: bool
                          ) -> tuple[float, float]:
    """(forward, backward) seconds one layer of the llama3 exchange adds, for a rank holding
    ``tokens`` of a micro-batch of ``sequences_per_micro_batch`` sequences whose even share of
    attention takes ``attention_seconds``: per call (KV_HEADS_PER_GATHER of the rank's KV
    heads) the keys and the values of the whole micro-batch all-gathered, and in the backward
    gathered again and their gradients reduce-scattered; plus the busiest slice's attention
    beyond the even share (its backward twice the forward)."""
    if cp <= 1:
        return 0.0, 0.0
    heads = max(1, model.kv_heads // tp)
    calls = max(1, heads // KV_HEADS_PER_GATHER)
    # One call's gathered keys (or values): every rank's tokens, of the call's heads.
    gathered = cp * tokens * model.kv_size / model.kv_heads \
        * min(heads, KV_HEADS_PER_GATHER) * DTYPE_BYTES[dtype]
    gather = all_gather_seconds(profile, gathered, cp, crosses_nodes)
    scatter = reduce_scatter_seconds(profile, gathered, cp, crosses_nodes)
    uneven = (busiest_attention_share(sequences_per_micro_batch, cp) - 1.0) * attention_seconds
    forward = calls * 2 * gather + uneven
    backward = calls * 2 * (gather + scatter) + 2 * uneven
    return forward, backward


def layout_ring_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                        tokens: float, dtype: str, attention_seconds: float,
                        gpus_per_node: int, exchange: str = "ring",
                        sequences_per_micro_batch: float = 1.0) -> tuple[float, float]:
    """The seconds context parallelism adds to a layer of a rank of layout ``par``, forward
    and backward: Megatron's ring (``context_parallel_seconds``) or, with ``exchange``
    "all_gather", the llama3 exchange (``all_gather_kv_seconds``). The cp ranks are ``tp``
    apart (Megatron's order; OpenRLHF's (dp, sp, tp) mesh), every rank of the node
    exchanging at once."""
    crosses = group_crosses_nodes(par.cp, par.tp, gpus_per_node)
    if exchange == "all_gather":
        return all_gather_kv_seconds(
            model, profile, tokens=tokens, tp=par.tp, cp=par.cp, dtype=dtype,
            attention_seconds=attention_seconds,
            sequences_per_micro_batch=sequences_per_micro_batch, crosses_nodes=crosses)
    return context_parallel_seconds(
        model, profile, tokens=tokens, tp=par.tp, cp=par.cp, dtype=dtype,
        attention_seconds=attention_seconds, crosses_nodes=crosses,
        gpus_per_node=gpus_per_node, busy_ranks_per_node=par.world_size)
