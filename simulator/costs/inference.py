"""Inference: one forward pass over a batch (critic values, reference / actor log-probs,
reward and cost scores). Compute-bound; pipelined over micro-batches without a backward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.context_parallel import layout_ring_seconds
from simulator.costs.memory import MemoryBreakdown
from simulator.costs.primitives import all_gather_seconds, group_crosses_nodes, p2p_seconds
from simulator.costs.training import (
    FP32_LOGITS_AND_GRADIENT_BYTES,
    expert_parallel_span,
    fsdp_group_span,
    fsdp_local_param_count,
)
from simulator.costs.transformer import (
    LOSS_BYTES_PER_VOCAB_ENTRY,
    AttentionImpl,
    embedding_seconds,
    head_forward_seconds,
    layer_cost,
    stage_param_count,
    vocab_parallel_seconds,
)
from simulator.costs.ulysses import ulysses_forward_seconds
from simulator.packing import PackedBatch
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import ParallelConfig, stage_layers


@dataclass(frozen=True, slots=True)
class InferenceCost:
    seconds: float
    memory: MemoryBreakdown
    """Per-GPU weights (bf16, no optimizer) and the pass's transient activations."""
    micro_batches: int

    @property
    def activations_bytes(self) -> float:
        return self.memory.activations


@lru_cache(maxsize=65536)
def forward_pass(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                 sequences: int, seq_len: float, micro_batch: int, dtype: str = "bf16",
                 value_head: bool = False, gpus_per_node: int = 8,
                 attention: AttentionImpl = "flash",
                 packed: PackedBatch | None = None,
                 logprob_bytes: float = LOSS_BYTES_PER_VOCAB_ENTRY,
                 logits_bytes_per_entry: float = FP32_LOGITS_AND_GRADIENT_BYTES,
                 cp_exchange: str = "ring") -> InferenceCost:
    """Forward ``sequences`` sequences of ``seq_len`` tokens through the model laid out as
    ``par``; the data-parallel ranks split the sequences (with ``packed``, the busiest rank
    runs its packed micro-batches instead; ``logprob_bytes``: the log-prob pass's memory traffic
    per token and vocabulary entry)."""
    per_rank = math.ceil(sequences / par.data_shards)
    mbs: float = max(1, min(micro_batch, per_rank))
    micro_batches = max(1, math.ceil(per_rank / mbs))
    if packed is not None:
        mbs, seq_len = packed.sequences_per_micro_batch, packed.tokens_per_sequence
        micro_batches = packed.micro_batches
    # Ulysses and context parallelism: a micro-batch's sequences are split over sp (cp) ranks,
    # each computing 1 / sp (1 / cp) of it.
    mbs /= par.ulysses * par.cp
    tp_cross = group_crosses_nodes(par.tp, 1, gpus_per_node)
    layer = layer_cost(model, profile, micro_batch=mbs, seq_len=seq_len, tp=par.tp,
                       sequence_parallel=par.sequence_parallel, dtype=dtype,
                       attention=attention, recompute="none", tp_crosses_nodes=tp_cross,
                       ep=par.ep, etp=par.etp, ep_span=expert_parallel_span(par, gpus_per_node),
                       dispatcher=par.moe_dispatcher)
    tokens = mbs * seq_len
    # The fitted compute correction scales kernels only, not collectives or per-call costs.
    compute_scale = profile.correction("infer_compute")
    forward = layer.forward_seconds * compute_scale
    # The pass runs in the training engine: its collectives are the engine's.
    tp_comm = layer.tp_training_forward_seconds + ulysses_forward_seconds(
        model, profile, tokens=mbs * seq_len, tp=par.tp, sp=par.ulysses, dtype=dtype,
        gpus_per_node=gpus_per_node, busy_ranks_per_node=par.world_size)
    tp_comm += layout_ring_seconds(
        model, profile, par, tokens=mbs * seq_len, dtype=dtype,
        attention_seconds=layer.attention_core_seconds * compute_scale,
        gpus_per_node=gpus_per_node, exchange=cp_exchange,
        sequences_per_micro_batch=mbs * par.ulysses * par.cp)[0]
    stage = stage_layers(model.layers, par.pp) * (forward + tp_comm)
    if par.sharding == "fsdp" and par.dp > 1:
        gather = all_gather_seconds(profile, model.params_per_layer / par.tp * DTYPE_BYTES[dtype],
                                    par.fsdp_shards, span=fsdp_group_span(par, gpus_per_node),
                                    correction="train_collective")
        per_layer_compute = forward + tp_comm
        overlap = profile.kind == "gpu"  # on a CPU the gathers compete for the same cores
        stage += (model.layers * max(0.0, gather - per_layer_compute) + gather if overlap
                  else model.layers * gather)
        stage += model.layers * profile.overheads.fsdp_unit_seconds
    first = embedding_seconds(model, profile, tokens=tokens, dtype=dtype) * compute_scale
    last = head_forward_seconds(model, profile, tokens=tokens, tp=par.tp, dtype=dtype,
                                value_head=value_head, loss=True,
                                loss_bytes_per_entry=logprob_bytes) * compute_scale
    vocab_comm = vocab_parallel_seconds(model, profile, tokens=tokens, tp=par.tp, dtype=dtype,
                                        value_head=value_head,
                                        sequence_parallel=par.sequence_parallel,
                                        tp_crosses_nodes=tp_cross)
    if par.pp == 1:
        last += vocab_comm
    else:
        # The embedding's collective on the first stage, the head's on the last: each stage's
        # own (split evenly; both are small).
        first += vocab_comm / 2
        last += vocab_comm / 2
    if par.pp == 1:
        seconds = micro_batches * (stage + first + last)
    else:
        slowest = stage + max(first, last)
        seconds = micro_batches * slowest + (par.pp - 1) * stage + min(first, last)
        message = tokens * model.hidden * DTYPE_BYTES[dtype] / par.tp
        seconds += (micro_batches + par.pp - 1) * p2p_seconds(
            profile, message, par.world_size > gpus_per_node,
            busy_ranks_per_node=par.tp * par.dp, gpus_per_node=gpus_per_node)
    vocab_local = model.head_output_size(value_head=value_head) / (1 if value_head else par.tp)
    # One layer's intermediate tensors are live at a time, plus the logits and what the
    # log-prob computation holds beside them (fp32 logits and log-softmax by default).
    activations = layer.activation_bytes + logits_bytes_per_entry * tokens * vocab_local
    if par.sharding == "fsdp":
        weights = fsdp_local_param_count(model, par, value_head=value_head) * DTYPE_BYTES[dtype]
    else:
        weights = stage_param_count(model, tp=par.tp, pp=par.pp, value_head=value_head,
                                    ep=par.ep, etp=par.etp) \
            * DTYPE_BYTES[dtype]
    return InferenceCost(seconds=seconds,
                         memory=MemoryBreakdown(params=weights, activations=activations),
                         micro_batches=micro_batches)
