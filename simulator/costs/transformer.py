"""One transformer block on one GPU: seconds of its forward and backward passes, its
tensor-parallel communication, and the activations it saves. Shared by the training, inference
and prefill cost models.

Activation bytes follow Korthikanti et al. 2022 (arXiv 2205.05198, §4), generalised to
grouped-query attention, SwiGLU and models without dropout: for GPT with dropout and no tensor
parallelism a layer saves s*b*h*(34 + 5*a*s/h) bytes in 16-bit, which ``layer_cost`` reproduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.primitives import (
    Span,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    attention_kernel_seconds,
    exchange_seconds,
    gemm_seconds,
    memory_seconds,
    reduce_scatter_seconds,
)
from simulator.specs.model import ModelSpec, MoESpec
from simulator.specs.parallel import stage_layers

AttentionImpl = Literal["flash", "unfused"]
"""flash: fused attention that never stores the s x s scores (FlashAttention-2);
unfused: batched GEMMs plus softmax/dropout kernels on the full score matrix (Megatron 2022)."""

FLASH_BACKWARD_FLOPS_RATIO = 2.5
"""FlashAttention's backward does 2.5x the forward FLOPs (Dao 2023, arXiv 2307.08691, §4.1)."""


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Seconds and bytes of one transformer block for one micro-batch on one GPU."""

    forward_seconds: float
    """Compute and memory-bound kernels of the forward pass (no communication)."""
    backward_seconds: float
    """Compute and memory-bound kernels of the backward pass (no communication)."""
    attention_core_seconds: float
    """Forward of the attention core alone (what selective recompute repeats)."""
    tp_forward_seconds: float
    """Tensor-parallel communication in the forward pass (not overlapped)."""
    tp_backward_seconds: float
    """Tensor-parallel communication in the backward pass (not overlapped)."""
    tp_training_forward_seconds: float
    """The forward's tensor-parallel communication inside the training engine (a training
    step, or an inference pass of the same engine)."""
    activation_bytes: float
    """Activations this layer keeps for the backward pass, given the recompute mode."""
    input_bytes: float
    """Bytes of the layer's input tensor on this GPU (what full recompute keeps)."""
    forward_flops: float
    """Forward FLOPs of this layer on this GPU."""


@lru_cache(maxsize=65536)
def layer_cost(model: ModelSpec, profile: DeviceProfile, *, micro_batch: int, seq_len: float,
               tp: int, sequence_parallel: bool, dtype: str, attention: AttentionImpl = "flash",
               recompute: str = "none", tp_crosses_nodes: bool = False, ep: int = 1,
               etp: int = 1, ep_span: Span | None = None,
               dispatcher: str = "alltoall") -> LayerCost:
    """Cost of one block processing ``micro_batch`` sequences of ``seq_len`` tokens. For a
    mixture-of-experts model the block is the mean over the layers (the leading dense ones
    and the MoE ones), its experts laid out over ``ep`` x ``etp`` ranks (``ep_span``: where
    the expert-parallel group sits)."""
    tokens = micro_batch * seq_len
    sp = sequence_parallel and tp > 1
    sp_div = tp if sp else 1
    gemms, gemm_flops, activation_width, expert_a2a = _block_gemms(
        model, profile, tokens=tokens, tp=tp, sp=sp, dtype=dtype, ep=ep, etp=etp,
        ep_span=ep_span, dispatcher=dispatcher)
    core_fwd, core_bwd, core_flops = _attention_core(
        model, profile, micro_batch=micro_batch, seq_len=seq_len, tp=tp, dtype=dtype,
        attention=attention)
    elementwise_fwd, elementwise_bwd = _elementwise_seconds(
        model, profile, tokens=tokens, tp=tp, sp_div=sp_div, dtype=dtype,
        activation_width=activation_width)
    forward = gemms + core_fwd + elementwise_fwd
    backward = 2 * gemms + core_bwd + elementwise_bwd

    # The training engine's collectives (its training steps and its inference passes, under
    # autograd, DTensor or Megatron) carry the ``train_collective`` correction; the generation
    # engine's (prefill, decode) are plain collectives (``collective``).
    tp_fwd = tp_fwd_training = tp_bwd = 0.0
    if tp > 1:
        tp_fwd = _tensor_parallel_seconds(model, profile, tokens=tokens, tp=tp, sp=sp,
                                          dtype=dtype, tp_crosses_nodes=tp_crosses_nodes,
                                          correction="collective")
        tp_fwd_training = _tensor_parallel_seconds(
            model, profile, tokens=tokens, tp=tp, sp=sp, dtype=dtype,
            tp_crosses_nodes=tp_crosses_nodes, correction="train_collective")
        tp_bwd = tp_fwd_training
    # MoE token dispatch and combine (two all-to-alls each way) ride with the layer's other
    # model-parallel communication: not overlapped with compute.
    share = model.moe_layers / model.layers
    tp_fwd += share * expert_a2a
    tp_fwd_training += share * expert_a2a
    tp_bwd += share * expert_a2a

    input_bytes = tokens * model.hidden * DTYPE_BYTES[dtype] / sp_div
    if recompute == "full":
        activations = input_bytes
    else:
        activations = tokens * _saved_bytes_per_token(
            model, profile, seq_len=seq_len, tp=tp, sp_div=sp_div, dtype=dtype,
            attention=attention, recompute=recompute, activation_width=activation_width)
    return LayerCost(
        forward_seconds=forward,
        backward_seconds=backward,
        attention_core_seconds=core_fwd,
        tp_forward_seconds=tp_fwd,
        tp_backward_seconds=tp_bwd,
        tp_training_forward_seconds=tp_fwd_training,
        activation_bytes=activations,
        input_bytes=input_bytes,
        forward_flops=gemm_flops + core_flops,
    )


def _block_gemms(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                 sp: bool, dtype: str, ep: int, etp: int, ep_span: Span | None,
                 dispatcher: str) -> tuple[float, float, float, float]:
    """The block's forward GEMMs (its backward is dgrad + wgrad of the same shapes):
    (seconds, flops, the MLP activation's width per rank, an MoE layer's all-to-all
    seconds). An MoE model's block is the mean over its dense and MoE layers."""
    h = model.hidden
    ffn = model.ffn_hidden
    swiglu = model.mlp == "swiglu"
    mlp_in_width = (2 if swiglu else 1) * ffn / tp
    attention_gemms, attention_flops = attention_projection_cost(
        model, profile, tokens=tokens, tp=tp, sequence_parallel=sp, dtype=dtype)
    dense_mlp = (gemm_seconds(profile, tokens, mlp_in_width, h, dtype)
                 + gemm_seconds(profile, tokens, h, ffn / tp, dtype))
    dense_mlp_flops = 2 * tokens * (h * mlp_in_width * tp + ffn * h) / tp
    moe = model.moe
    if moe is None:
        return (attention_gemms + dense_mlp, attention_flops + dense_mlp_flops, ffn / tp,
                0.0)
    moe_mlp, moe_flops, expert_a2a = moe_mlp_cost(
        model, profile, tokens=tokens, tp=tp, sequence_parallel=sp, dtype=dtype, ep=ep,
        etp=etp, ep_span=ep_span, dispatcher=dispatcher)
    share = model.moe_layers / model.layers
    gemms = attention_gemms + share * moe_mlp + (1 - share) * dense_mlp
    gemm_flops = attention_flops + share * moe_flops + (1 - share) * dense_mlp_flops
    # Every token's activation runs over its top_k experts' and the shared experts' widths.
    active_width = (moe.top_k * moe.expert_ffn_hidden
                    + moe.shared_experts * moe.shared_ffn) / tp
    return gemms, gemm_flops, share * active_width + (1 - share) * ffn / tp, expert_a2a


def _attention_core(model: ModelSpec, profile: DeviceProfile, *, micro_batch: int,
                    seq_len: float, tp: int, dtype: str,
                    attention: AttentionImpl) -> tuple[float, float, float]:
    """The attention core (scores, softmax, weighted sum): (forward seconds, backward
    seconds, forward flops). Flash attention runs the causal half in one kernel; the
    unfused core materialises the s x s scores."""
    b = DTYPE_BYTES[dtype]
    heads_local = model.heads / tp
    hd = model.head_dim_value
    pair_flops = model.attention_pair_flops() / tp
    if attention == "flash":
        core_flops = pair_flops * micro_batch * seq_len * seq_len * 0.5  # causal half
        core_fwd = attention_kernel_seconds(profile, core_flops, dtype)
        return core_fwd, FLASH_BACKWARD_FLOPS_RATIO * core_fwd, core_flops
    bmm_batch = micro_batch * heads_local
    # Scores over the query/key head width, the weighted sum over the value head width.
    v_hd = model.v_size // model.heads
    core_fwd = (gemm_seconds(profile, seq_len * bmm_batch, seq_len, hd, dtype)
                + gemm_seconds(profile, seq_len * bmm_batch, seq_len, v_hd, dtype))
    core_bwd = 2 * core_fwd
    core_flops = pair_flops * micro_batch * seq_len * seq_len
    score_elements = micro_batch * heads_local * seq_len * seq_len
    softmax_fwd_bytes = 2 * b * score_elements
    softmax_bwd_bytes = 3 * b * score_elements
    dropout_fwd_bytes = (2 * b + 1) * score_elements if model.dropout else 0.0
    dropout_bwd_bytes = (2 * b + 1) * score_elements if model.dropout else 0.0
    core_fwd += memory_seconds(profile, softmax_fwd_bytes + dropout_fwd_bytes,
                               kernels=2 if model.dropout else 1)
    core_bwd += memory_seconds(profile, softmax_bwd_bytes + dropout_bwd_bytes,
                               kernels=2 if model.dropout else 1)
    return core_fwd, core_bwd, core_flops


def _elementwise_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                         sp_div: int, dtype: str,
                         activation_width: float) -> tuple[float, float]:
    """Memory-bound elementwise kernels (norms, residual adds, dropout, activation, rotary),
    forward and backward."""
    b = DTYPE_BYTES[dtype]
    h = model.hidden
    swiglu = model.mlp == "swiglu"
    per_token = (
        2 * 2 * h * b / sp_div                                    # two norms: read + write
        + 2 * 3 * h * b / sp_div                                  # two residual adds
        + (2 * (2 * h * b + h) / sp_div if model.dropout else 0)  # two dropouts + masks
        + ((3 if swiglu else 2) * activation_width * b)          # activation function
        + (2 * rotary_width(model, tp) * b if model.learned_positions == 0 else 0)
        + (2 * 2 * latent_norm_width(model) * b / sp_div)        # MLA: two latent norms
    )
    elementwise_kernels = 4 + (2 if model.dropout else 0) + 1 + (
        1 if model.learned_positions == 0 else 0)
    return (memory_seconds(profile, tokens * per_token, kernels=elementwise_kernels),
            memory_seconds(profile, 2 * tokens * per_token, kernels=2 * elementwise_kernels))


def _tensor_parallel_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float,
                             tp: int, sp: bool, dtype: str, tp_crosses_nodes: bool,
                             correction: str) -> float:
    """Tensor parallelism's two collectives per direction (after attention and after the
    MLP): all-reduces, or under sequence parallelism all-gathers of what the column-parallel
    projections read (the hidden state, or for latent attention the latents and the rotary
    key) and reduce-scatters."""
    b = DTYPE_BYTES[dtype]
    full_bytes = tokens * model.hidden * b
    if sp:
        attention_gather_bytes = tokens * attention_gather_width(model) * b
        return (all_gather_seconds(profile, attention_gather_bytes, tp, tp_crosses_nodes,
                                   correction=correction)
                + all_gather_seconds(profile, full_bytes, tp, tp_crosses_nodes,
                                     correction=correction)
                + 2 * reduce_scatter_seconds(profile, full_bytes, tp, tp_crosses_nodes,
                                             correction=correction))
    return 2 * all_reduce_seconds(profile, full_bytes, tp, tp_crosses_nodes,
                                  correction=correction)


def _saved_bytes_per_token(model: ModelSpec, profile: DeviceProfile, *, seq_len: float,
                           tp: int, sp_div: int, dtype: str, attention: AttentionImpl,
                           recompute: str, activation_width: float) -> float:
    """Bytes one token's activations keep for the backward in a block without full
    recompute."""
    b = DTYPE_BYTES[dtype]
    h = model.hidden
    swiglu = model.mlp == "swiglu"
    heads_local = model.heads / tp
    per_token_saved = (
        2 * h * b / sp_div                       # norm-1 input and QKV input
        + saved_qkv_width(model, tp, sp_div) * b  # Q, K, V (and MLA's latents)
        + 2 * h * b / sp_div                     # norm-2 input and MLP input
        + (3 if swiglu else 2) * activation_width * b  # MLP: up (+ gate), activation out
        # MoE: the dispatched copies of each token (its experts' inputs) on the layers
        # that route, at the busiest expert's share.
        + (model.moe_layers / model.layers * model.moe.top_k * h * b / tp
           * profile.correction(MOE_IMBALANCE_CORRECTION) if model.moe else 0.0)
        + (2 * h / sp_div if model.dropout else 0)  # two dropout masks (1 byte)
    )
    if attention == "flash":
        return per_token_saved + (model.v_size * b / tp + 4 * heads_local)  # output, LSE
    per_token_saved += model.v_size * b / tp                     # out-proj input
    if recompute != "selective":
        score_per_token = heads_local * seq_len
        per_token_saved += score_per_token * (b + ((b + 1) if model.dropout else 0))
    return per_token_saved


def attention_projection_cost(model: ModelSpec, profile: DeviceProfile, *, tokens: float,
                              tp: int, sequence_parallel: bool, dtype: str
                              ) -> tuple[float, float]:
    """(forward seconds, forward FLOPs) of one layer's attention projections on one of ``tp``
    ranks for ``tokens`` tokens of its tensor-parallel group. Standard attention: the fused
    column-parallel QKV projection and the row-parallel output projection. Multi-head latent
    attention: the duplicated down projections to the query and key/value latents (on the
    rank's sequence shard under sequence parallelism, on every token otherwise: Megatron's
    MLA), the column-parallel up projections and the row-parallel output projection."""
    h = model.hidden
    mla = model.mla
    if mla is None:
        q, kv = model.q_size, model.kv_size
        seconds = (gemm_seconds(profile, tokens, (q + 2 * kv) / tp, h, dtype)
                   + gemm_seconds(profile, tokens, h, q / tp, dtype))
        return seconds, 2 * tokens * (h * (q + 2 * kv) + q * h) / tp
    down_tokens = tokens / tp if sequence_parallel else tokens
    shapes = [(down_tokens, mla.latent_width, h)]                      # key/value latent
    if mla.q_lora_rank:
        shapes += [(down_tokens, mla.q_lora_rank, h),                  # query latent
                   (tokens, model.q_size / tp, mla.q_lora_rank)]       # queries up
    else:
        shapes += [(tokens, model.q_size / tp, h)]                     # queries
    shapes += [(tokens, model.heads * (mla.qk_nope_head_dim + mla.v_head_dim) / tp,
                mla.kv_lora_rank),                                     # keys and values up
               (tokens, h, model.v_size / tp)]                         # output projection
    seconds = sum(gemm_seconds(profile, m, n, k, dtype) for m, n, k in shapes)
    return seconds, sum(2 * m * n * k for m, n, k in shapes)


def attention_gather_width(model: ModelSpec) -> int:
    """Elements per token the attention block all-gathers under sequence parallelism: the
    hidden state, or for latent attention the query latent (the hidden state without one),
    the key/value latent and the rotary key that the column-parallel projections read."""
    mla = model.mla
    if mla is None:
        return model.hidden
    return (mla.q_lora_rank or model.hidden) + mla.latent_width


def latent_norm_width(model: ModelSpec) -> int:
    """Elements per token of latent attention's two latent norms (0 without)."""
    return model.mla.q_lora_rank + model.mla.kv_lora_rank if model.mla is not None else 0


def rotary_width(model: ModelSpec, tp: int) -> float:
    """Elements per token rotated on one of ``tp`` ranks: the rank's query and key heads, or
    for latent attention the rotary parts of its query heads and the one shared rotary key."""
    if model.mla is None:
        return (model.q_size + model.kv_size) / tp
    return model.heads * model.mla.qk_rope_head_dim / tp + model.mla.qk_rope_head_dim


def saved_qkv_width(model: ModelSpec, tp: int, sp_div: int) -> float:
    """Elements per token the attention keeps for its backward on one of ``tp`` ranks: Q, K
    and V, and for latent attention also the latents before and after their norms and the
    rotary key (on the rank's sequence shard, ``sp_div``, under sequence parallelism)."""
    if model.mla is None:
        return (model.q_size + 2 * model.kv_size) / tp
    latents = 2 * latent_norm_width(model) + model.mla.qk_rope_head_dim
    return (2 * model.q_size + model.v_size) / tp + latents / sp_div


MOE_IMBALANCE_CORRECTION = "expert_imbalance"
"""The profile correction that scales the busiest expert's share of the routed tokens over the
mean (1.0, perfect balance, in the shipped profiles: no public measurement of the tokens per
expert under auxiliary-loss balancing was found; ``hybridflow calibrate --fit
expert_imbalance`` fits it on MoE runs)."""


def moe_mlp_cost(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                 sequence_parallel: bool, dtype: str, ep: int, etp: int,
                 ep_span: Span | None, dispatcher: str = "alltoall"
                 ) -> tuple[float, float, float]:
    """(forward GEMM seconds, forward FLOPs, all-to-all seconds of one direction's dispatch +
    combine) of one MoE layer's MLP on one GPU, for ``tokens`` tokens of its tensor-parallel
    group. The router is a GEMM over the GPU's tokens; each GPU holds experts / ep routed
    experts (each split over etp ranks) and computes them at their real per-expert batch:
    the routed token copies of the group (tokens x top_k) spread over the experts, scaled by
    the load imbalance of the busiest expert; shared experts are a dense MLP split by tp."""
    moe = model.moe
    assert moe is not None
    h = model.hidden
    b = DTYPE_BYTES[dtype]
    mats_in = 2 if model.mlp == "swiglu" else 1
    local_tokens = tokens / tp  # each GPU's share of its tensor-parallel group's tokens
    router = gemm_seconds(profile, tokens / (tp if sequence_parallel else 1), moe.experts, h,
                          dtype)
    # The ep x etp ranks exchange tokens so that each expert sees every copy routed to it.
    imbalance = profile.correction(MOE_IMBALANCE_CORRECTION)
    per_expert = local_tokens * moe.top_k * ep * etp / moe.experts * imbalance
    local_experts = moe.experts / ep
    width = moe.expert_ffn_hidden / etp
    experts = (gemm_seconds(profile, per_expert, mats_in * width, h, dtype, count=local_experts)
               + gemm_seconds(profile, per_expert, h, width, dtype, count=local_experts))
    flops = 2 * local_tokens * h * moe.experts + 2 * per_expert * local_experts * (
        mats_in + 1) * width * h
    if moe.shared_experts:
        shared_width = moe.shared_experts * moe.shared_ffn / tp
        experts += (gemm_seconds(profile, tokens, mats_in * shared_width, h, dtype)
                    + gemm_seconds(profile, tokens, h, shared_width, dtype))
        flops += 2 * tokens * (mats_in + 1) * shared_width * h
    a2a = 0.0
    group = ep * etp
    if group > 1:
        span = ep_span or Span()
        if dispatcher == "flex" and span.crosses_nodes:
            a2a = 2 * flex_dispatch_seconds(profile, moe, tokens=local_tokens,
                                            token_bytes=h * b, group=group, span=span)
        else:
            # Each rank sends its tokens' top_k copies (hidden wide) out and receives them.
            a2a = 2 * all_to_all_seconds(profile, local_tokens * moe.top_k * h * b, group,
                                         span=ep_span)
    return router + experts, flops, a2a


def remote_nodes_per_token(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of other nodes holding at least one of a token's ``top_k`` experts,
    the experts spread evenly over ``nodes`` and routing uniform: each other node is missed
    with probability C(E - E/n, k) / C(E, k)."""
    per_node = experts // nodes
    missed = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
    return (nodes - 1) * (1.0 - missed)


def flex_dispatch_seconds(profile: DeviceProfile, moe: MoESpec, *, tokens: float,
                          token_bytes: float, group: int, span: Span) -> float:
    """One direction of the deduplicated dispatch (Megatron's flex dispatcher with DeepEP /
    HybridEP): a rank's token goes once to every other node holding one of its experts, and
    its copies are spread to the experts' ranks inside the nodes over NVLink."""
    remote = remote_nodes_per_token(moe.experts, moe.top_k, span.nodes)
    inter = tokens * remote * token_bytes
    k = span.ranks_per_node
    intra = tokens * moe.top_k * token_bytes * (k - 1) / group * span.nodes
    # One message per peer: per other rank of the node, per other node.
    return exchange_seconds(profile, intra, inter, intra / max(1, k - 1),
                            inter / max(1, span.nodes - 1), span)


LOSS_BYTES_PER_VOCAB_ENTRY = 3 * 4
"""HBM bytes per token and vocabulary entry of a fused fp32 softmax / log-prob pass: read the
logits, write the probabilities, a few passes (3 x 4 bytes; a framework profile may say its
own, ``training.logprob_forward_bytes_per_vocab_entry``)."""


def head_forward_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                         dtype: str, value_head: bool, loss: bool,
                         loss_bytes_per_entry: float = LOSS_BYTES_PER_VOCAB_ENTRY) -> float:
    """Output projection (LM head or value head) plus, with ``loss``, the fp32 softmax /
    log-prob pass over the vocabulary shard (``loss_bytes_per_entry`` bytes of memory traffic
    per token and vocabulary entry)."""
    width = model.head_output_size(value_head=value_head) / (1 if value_head else tp)
    seconds = gemm_seconds(profile, tokens, width, model.hidden, dtype)
    if loss and not value_head:
        seconds += memory_seconds(profile, loss_bytes_per_entry * tokens * width, kernels=3)
    return seconds


def vocab_parallel_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float, tp: int,
                           dtype: str, value_head: bool, sequence_parallel: bool,
                           tp_crosses_nodes: bool = False) -> float:
    """Tensor-parallel collectives of the vocabulary-split layers in one forward pass of the
    training engine: the embedding's partial sums (all-reduce, or reduce-scatter under
    sequence parallelism) and, for a language-model head, the log-softmax over the split
    vocabulary (all-reduces of the row maxima, the sums of exponentials and the target
    token's logit, fp32 per token) as Megatron's vocab-parallel cross-entropy and DTensor's
    loss_parallel do."""
    if tp <= 1:
        return 0.0
    hidden = tokens * model.hidden * DTYPE_BYTES[dtype]
    seconds = (reduce_scatter_seconds if sequence_parallel else all_reduce_seconds)(
        profile, hidden, tp, tp_crosses_nodes, correction="train_collective")
    if not value_head:
        seconds += 3 * all_reduce_seconds(profile, tokens * 4, tp, tp_crosses_nodes,
                                          correction="train_collective")
    return seconds


def embedding_seconds(model: ModelSpec, profile: DeviceProfile, *, tokens: float,
                      dtype: str) -> float:
    """Embedding lookup: write one hidden vector per token."""
    return memory_seconds(profile, 2 * tokens * model.hidden * DTYPE_BYTES[dtype])


def stage_expert_param_count(model: ModelSpec, *, pp: int, ep: int = 1, etp: int = 1) -> float:
    """Routed-expert parameters on one GPU of a pipeline stage (part of
    ``stage_param_count``): the stage's layers' experts split over the ep x etp ranks."""
    return model.stage_expert_params(stage_layers(model.layers, pp)) / (ep * etp)


@lru_cache(maxsize=65536)
def stage_param_count(model: ModelSpec, *, tp: int, pp: int, value_head: bool, ep: int = 1,
                      etp: int = 1) -> float:
    """Parameters on one GPU of the most loaded pipeline stage (embedding on the first stage,
    final norm and output head on the last; a tied embedding is duplicated on the last stage
    when pp > 1). Tensor parallelism splits the matrices, the vocabulary and the
    column-parallel biases; every tensor-parallel rank holds its own copy of the norms, the
    row-parallel biases, learned positions and a value head (Megatron's and DTensor's
    layouts alike)."""
    # The heaviest stage's blocks (for MoE: a stage of MoE layers, the leading dense ones
    # being on the first stage). Its routed experts are split over the ep x etp ranks
    # (Megatron's expert parallel layout); the router and shared experts follow tensor
    # parallelism; norms (and latent attention's down projections) are whole on every rank.
    n = stage_layers(model.layers, pp)
    replicated = n * model.replicated_params_per_layer
    experts = model.stage_expert_params(n)
    layers = ((model.stage_layer_params(n) - replicated - experts) / tp
              + experts / (ep * etp) + replicated)
    embedding = model.vocab * model.hidden / tp + model.learned_positions * model.hidden
    if value_head:
        head = model.hidden + 1
    elif model.tied_embeddings:
        head = 0.0 if pp == 1 else model.vocab * model.hidden / tp
    else:
        head = model.lm_head_params / tp
    head += model.final_norm_params
    if pp == 1:
        return layers + embedding + head
    return layers + max(embedding, head)
