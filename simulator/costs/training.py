"""Training: seconds of one optimizer step and per-GPU memory, for Megatron-style 3D
parallelism (pp x tp x dp with 1F1B or interleaved pipelining, sequence parallelism, the
distributed optimizer) and for FSDP / ZeRO-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.context_parallel import layout_ring_seconds
from simulator.costs.memory import MemoryBreakdown
from simulator.costs.primitives import (
    Span,
    all_gather_seconds,
    all_reduce_seconds,
    group_crosses_nodes,
    group_span,
    memory_seconds,
    p2p_seconds,
    reduce_scatter_seconds,
)
from simulator.costs.transformer import (
    LOSS_BYTES_PER_VOCAB_ENTRY,
    AttentionImpl,
    LayerCost,
    embedding_seconds,
    head_forward_seconds,
    layer_cost,
    stage_expert_param_count,
    stage_param_count,
    vocab_parallel_seconds,
)
from simulator.costs.ulysses import ulysses_forward_seconds
from simulator.packing import PackedBatch
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import ParallelConfig, expert_replicas, stage_layers

TRAIN = "train_collective"
"""Correction key of the collectives inside a training step (gradient reduction, FSDP
gathers, tensor-parallel collectives under autograd): on a CPU they cost more than the bare
collectives the profiler measures (autograd and DTensor around them, ranks waiting for each
other); 1 on GPU profiles."""
MAIN_GRAD_BYTES = 4
"""Megatron accumulates and reduces gradients in fp32 when training in bf16
(Megatron-LM arguments.py: bf16 implies accumulate_allreduce_grads_in_fp32)."""
FP32_LOGITS_AND_GRADIENT_BYTES = 2 * 4
"""Bytes per token and vocabulary entry of a loss that holds fp32 logits and their fp32
gradient (or, forward only, fp32 logits and their log-softmax)."""
ADAM_STATE_BYTES = 12
"""fp32 master weights + Adam's two fp32 moments, per parameter (mixed-precision Adam)."""
ADAM_MOMENT_BYTES = 8
"""Adam's two fp32 moments, per parameter: all the optimizer holds when the weights are
fp32 already (no master copy)."""
FSDP_PARAM_BYTES = 4
"""FSDP2 keeps the sharded parameters in fp32 and casts to bf16 for compute."""
ADAM_STEP_BYTES_PER_PARAM = 36
"""Memory traffic of a fused mixed-precision Adam step per parameter: read/write fp32 master
weight, m and v (24), read the fp32 gradient (4), write the bf16 weight (2), plus the gradient
norm for clipping and zeroing the gradient (6)."""


@dataclass(frozen=True, slots=True)
class TrainingCost:
    """One optimizer step of one model."""

    seconds: float
    memory: MemoryBreakdown
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds by part: compute, tp_comm, pipeline_bubble, p2p, dp_comm, optimizer."""
    model_flops: float = 0.0
    """Model FLOPs of the step (Korthikanti et al. 2022 Eq. 7 convention: no recompute)."""
    micro_batches: int = 1
    """Micro-batches per data-parallel rank per step."""


def optimizer_state_bytes_per_param(dtype: str) -> int:
    """Optimizer bytes per parameter: fp32 master weights and moments in mixed precision,
    moments only when the model trains in fp32."""
    return ADAM_STATE_BYTES if DTYPE_BYTES[dtype] < 4 else ADAM_MOMENT_BYTES


def fsdp_local_param_count(model: ModelSpec, par: ParallelConfig, *, value_head: bool) -> float:
    """Parameters of one FSDP rank: its tensor-parallel share, split over the ranks of its
    FSDP group (every dp rank, or ``fsdp_size`` of them under hybrid sharding)."""
    return stage_param_count(model, tp=par.tp, pp=1, value_head=value_head, ep=par.ep,
                             etp=par.etp) / par.fsdp_shards


def optimizer_memory(model: ModelSpec, par: ParallelConfig, *, value_head: bool,
                     trainable: bool, dtype: str,
                     grad_bytes: int = MAIN_GRAD_BYTES) -> MemoryBreakdown:
    """Weights, gradients and optimizer states on one GPU (the resident part of a model).
    ``grad_bytes``: bytes per element of a Megatron-style layout's gradient buffer (fp32 main
    gradients by default; the training dtype when the framework reduces in it). FSDP keeps
    fp32 gradient shards."""
    b = DTYPE_BYTES[dtype]
    if par.sharding == "fsdp":
        local = fsdp_local_param_count(model, par, value_head=value_head)
        # Working copies: the gathered weights of the current and the prefetched layer.
        working = 2 * model.params_per_layer / par.tp * b
        if not trainable:
            return MemoryBreakdown(params=local * b + working)
        return MemoryBreakdown(params=local * FSDP_PARAM_BYTES + working,
                               grads=local * MAIN_GRAD_BYTES,
                               optimizer=local * (ADAM_STATE_BYTES - FSDP_PARAM_BYTES))
    local = stage_param_count(model, tp=par.tp, pp=par.pp, value_head=value_head, ep=par.ep,
                              etp=par.etp)
    if not trainable:
        return MemoryBreakdown(params=local * b)
    return MemoryBreakdown(params=local * b, grads=local * grad_bytes,
                           optimizer=optimizer_sharded_params(model, par, value_head=value_head)
                           * optimizer_state_bytes_per_param(dtype))


def optimizer_sharded_params(model: ModelSpec, par: ParallelConfig, *,
                             value_head: bool) -> float:
    """Parameters whose optimizer states one GPU keeps (Megatron layouts): with the
    distributed optimizer the dense part is split over the dp replicas and the routed experts
    over their own replicas, expert_dp = tp * dp / (ep * etp) (Megatron's expert data-parallel
    group); without it, all of the GPU's parameters."""
    local = stage_param_count(model, tp=par.tp, pp=par.pp, value_head=value_head, ep=par.ep,
                              etp=par.etp)
    if par.sharding != "optimizer":
        return local
    experts = stage_expert_param_count(model, pp=par.pp, ep=par.ep, etp=par.etp)
    return (local - experts) / par.dp + experts / par.expert_dp


def data_parallel_span(par: ParallelConfig, gpus_per_node: int) -> Span:
    """Where a data-parallel group sits: ranks ``tp`` apart (Megatron's order puts tensor
    parallelism innermost), and every rank of the node reduces at the same moment (each
    model-parallel rank has its own data-parallel group)."""
    return _replica_span(par.tp, par.dp, par.pp, gpus_per_node)


def _replica_span(tp: int, dp: int, pp: int, gpus_per_node: int) -> Span:
    """``data_parallel_span`` from the layout's shape."""
    return group_span(dp, tp, gpus_per_node, busy_ranks_per_node=tp * dp * pp)


def fsdp_group_span(par: ParallelConfig, gpus_per_node: int) -> Span:
    """Where one FSDP group sits: ``fsdp_shards`` consecutive data-parallel ranks (``tp``
    apart), every rank of the node gathering at the same moment."""
    return group_span(par.fsdp_shards, par.tp, gpus_per_node,
                      busy_ranks_per_node=par.tp * par.dp * par.pp)


def fsdp_replica_span(par: ParallelConfig, gpus_per_node: int) -> Span:
    """Where one rank's hybrid-sharding replicas sit: ``fsdp_replicas`` ranks, one per FSDP
    group, ``tp * fsdp_shards`` apart."""
    return group_span(par.fsdp_replicas, par.tp * par.fsdp_shards, gpus_per_node,
                      busy_ranks_per_node=par.tp * par.dp * par.pp)


def expert_parallel_span(par: ParallelConfig, gpus_per_node: int) -> Span:
    """Where an expert-parallel group sits: ep x etp consecutive ranks of a stage (Megatron
    builds the expert groups from the tp x dp ranks with the expert tensor ranks innermost),
    every rank of the node exchanging tokens at the same moment."""
    return group_span(par.ep * par.etp, 1, gpus_per_node,
                      busy_ranks_per_node=par.tp * par.dp * par.pp)


def model_flops_per_sequence(model: ModelSpec, seq_len: float, *, value_head: bool) -> float:
    """Forward + backward model FLOPs of one sequence (3x forward; no recompute)."""
    per_token = model.matmul_flops_per_token(value_head=value_head)
    per_token += model.attention_flops_per_token(seq_len)
    return 3.0 * per_token * seq_len


@lru_cache(maxsize=65536)
def train_step(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
               global_batch: int, seq_len: float, dtype: str = "bf16",
               value_head: bool = False, gpus_per_node: int = 8,
               attention: AttentionImpl = "flash",
               grad_bytes: int = MAIN_GRAD_BYTES,
               packed: PackedBatch | None = None,
               logprob_bytes: tuple[float, float] = (LOSS_BYTES_PER_VOCAB_ENTRY,
                                                     2 * LOSS_BYTES_PER_VOCAB_ENTRY),
               logits_bytes_per_entry: float = FP32_LOGITS_AND_GRADIENT_BYTES,
               cp_exchange: str = "ring") -> TrainingCost:
    """One optimizer step on ``global_batch`` sequences of ``seq_len`` tokens
    (``grad_bytes``: as in ``optimizer_memory``); with ``packed``, the busiest data-parallel
    rank's packed micro-batches instead of ``micro_batch_size`` sequences each;
    ``logprob_bytes``: memory traffic of the loss's log-probs per token and vocabulary entry,
    forward and backward; ``logits_bytes_per_entry``: bytes the loss holds per token and
    vocabulary entry; ``cp_exchange``: how context-parallel ranks exchange keys and values,
    ``layout_ring_seconds``)."""
    mbs, seq_len, micro_batches = _micro_batching(par, global_batch, seq_len, packed)
    tp_cross = group_crosses_nodes(par.tp, 1, gpus_per_node)
    layer = layer_cost(model, profile, micro_batch=mbs, seq_len=seq_len, tp=par.tp,
                       sequence_parallel=par.sequence_parallel, dtype=dtype,
                       attention=attention, recompute=par.recompute,
                       tp_crosses_nodes=tp_cross, ep=par.ep, etp=par.etp,
                       ep_span=expert_parallel_span(par, gpus_per_node),
                       dispatcher=par.moe_dispatcher)
    layers_per_stage = stage_layers(model.layers, par.pp)
    tokens = mbs * seq_len

    # The profile's fitted compute correction scales kernels only: collectives carry their
    # own correction and fixed per-call costs none.
    compute_scale = profile.correction("train_compute")
    forward = layer.forward_seconds * compute_scale
    backward = layer.backward_seconds * compute_scale
    recompute_extra = {"none": 0.0, "selective": layer.attention_core_seconds * compute_scale,
                       "full": forward + layer.tp_training_forward_seconds}[par.recompute]
    body_compute, body_tp = _stage_body_seconds(
        model, profile, par, layer, layers_per_stage=layers_per_stage, forward=forward,
        backward=backward, recompute_extra=recompute_extra, tokens=tokens, mbs=mbs,
        dtype=dtype, compute_scale=compute_scale, gpus_per_node=gpus_per_node,
        cp_exchange=cp_exchange)
    first_extra, last_extra = _stage_end_seconds(
        model, profile, par, tokens=tokens, dtype=dtype, value_head=value_head,
        compute_scale=compute_scale, logprob_bytes=logprob_bytes, tp_cross=tp_cross)
    fsdp_exposed = _fsdp_exposed_seconds(
        model, profile, par, layer, forward=forward, backward=backward,
        recompute_extra=recompute_extra, dtype=dtype, gpus_per_node=gpus_per_node)

    stage_time = body_compute + body_tp + fsdp_exposed
    pipeline, bubble = _pipeline_seconds(par, micro_batches, stage_time, first_extra,
                                         last_extra)
    p2p_total = _pipeline_p2p_seconds(model, profile, par, tokens=tokens, dtype=dtype,
                                      micro_batches=micro_batches,
                                      gpus_per_node=gpus_per_node)
    dp_comm = _gradient_reduction_seconds(
        model, profile, par, value_head=value_head, grad_bytes=grad_bytes, dtype=dtype,
        gpus_per_node=gpus_per_node,
        backward_window=layers_per_stage * (backward + recompute_extra))

    optimizer_seconds = _optimizer_step_seconds(model, profile, par, value_head=value_head)

    seconds = (pipeline + p2p_total + dp_comm + optimizer_seconds
               + profile.overheads.iteration_seconds)
    memory = _training_memory(model, par, layer, value_head=value_head, dtype=dtype,
                              grad_bytes=grad_bytes, micro_batches=micro_batches,
                              layers_per_stage=layers_per_stage, tokens=tokens,
                              logits_bytes_per_entry=logits_bytes_per_entry)
    flops = global_batch * model_flops_per_sequence(model, seq_len, value_head=value_head)
    return TrainingCost(
        seconds=seconds,
        memory=memory,
        breakdown={
            "compute": micro_batches * (body_compute + max(first_extra, last_extra)),
            "tp_comm": micro_batches * body_tp,
            "fsdp_comm_exposed": micro_batches * fsdp_exposed,
            "pipeline_bubble": bubble,
            "p2p": p2p_total,
            "dp_comm": dp_comm,
            "optimizer": optimizer_seconds,
        },
        model_flops=flops,
        micro_batches=micro_batches,
    )


def _micro_batching(par: ParallelConfig, global_batch: int, seq_len: float,
                    packed: PackedBatch | None) -> tuple[float, float, int]:
    """(sequences per micro-batch on one rank, tokens per sequence, micro-batches per step):
    ``micro_batch_size`` sequences each, or the busiest rank's packed micro-batches; Ulysses
    and context parallelism split a micro-batch's sequences over sp (cp) ranks, each
    computing 1 / sp (1 / cp) of it."""
    mbs: float = par.micro_batch_size
    micro_batches = max(1, math.ceil(global_batch / (par.data_shards * mbs)))
    if packed is not None:
        mbs, seq_len = packed.sequences_per_micro_batch, packed.tokens_per_sequence
        micro_batches = packed.micro_batches
    mbs /= par.ulysses * par.cp
    return mbs, seq_len, micro_batches


def _stage_body_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig,
                        layer: LayerCost, *, layers_per_stage: float, forward: float,
                        backward: float, recompute_extra: float, tokens: float, mbs: float,
                        dtype: str, compute_scale: float, gpus_per_node: int,
                        cp_exchange: str) -> tuple[float, float]:
    """(compute, communication) seconds of one micro-batch through one pipeline stage's
    transformer blocks: forward, backward and recompute kernels; tensor-parallel
    collectives; Ulysses' all-to-alls (the forward's two, the backward's two, and the
    forward's again under full recompute); context parallelism's ring exchange forward and
    backward (and the forward's again when recompute repeats attention)."""
    body_compute = layers_per_stage * (forward + backward + recompute_extra)
    body_tp = layers_per_stage * (layer.tp_training_forward_seconds
                                  + layer.tp_backward_seconds)
    ulysses, ring_forward, ring_backward = _sequence_split_seconds(
        model, profile, par, layer, tokens=tokens, mbs=mbs, dtype=dtype,
        compute_scale=compute_scale, gpus_per_node=gpus_per_node, cp_exchange=cp_exchange)
    body_tp += layers_per_stage * ulysses * (3 if par.recompute == "full" else 2)
    body_tp += layers_per_stage * (ring_forward * (1 if par.recompute == "none" else 2)
                                   + ring_backward)
    return body_compute, body_tp


def _optimizer_step_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                            value_head: bool) -> float:
    """Adam's update over the parameters this rank's optimizer holds (its FSDP shard, or the
    optimizer states' shard), as memory traffic in four kernels."""
    optimizer_params = optimizer_sharded_params(model, par, value_head=value_head)
    if par.sharding == "fsdp":
        optimizer_params = fsdp_local_param_count(model, par, value_head=value_head)
    return memory_seconds(profile, optimizer_params * ADAM_STEP_BYTES_PER_PARAM, kernels=4)


def _sequence_split_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig,
                            layer: LayerCost, *, tokens: float, mbs: float, dtype: str,
                            compute_scale: float, gpus_per_node: int, cp_exchange: str,
                            ) -> tuple[float, float, float]:
    """One layer's communication for a sequence split over ranks, per micro-batch: Ulysses'
    forward all-to-alls, and the context-parallel ring's exchange (forward, backward) beyond
    what attention hides."""
    ulysses = ulysses_forward_seconds(model, profile, tokens=tokens, tp=par.tp, sp=par.ulysses,
                                      dtype=dtype, gpus_per_node=gpus_per_node,
                                      busy_ranks_per_node=par.world_size)
    ring_forward, ring_backward = layout_ring_seconds(
        model, profile, par, tokens=tokens, dtype=dtype,
        attention_seconds=layer.attention_core_seconds * compute_scale,
        gpus_per_node=gpus_per_node, exchange=cp_exchange,
        sequences_per_micro_batch=mbs * par.ulysses * par.cp)
    return ulysses, ring_forward, ring_backward


def _stage_end_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                       tokens: float, dtype: str, value_head: bool, compute_scale: float,
                       logprob_bytes: tuple[float, float], tp_cross: bool,
                       ) -> tuple[float, float]:
    """(first stage's extra seconds, last stage's) per micro-batch: the embedding, and the
    output head with its loss; one stage holds both when pp = 1."""
    return _stage_end_seconds_of(model, profile, tp=par.tp, pipelined=par.pp > 1,
                                 sequence_parallel=par.sequence_parallel, tokens=tokens,
                                 dtype=dtype, value_head=value_head,
                                 compute_scale=compute_scale, logprob_bytes=logprob_bytes,
                                 tp_cross=tp_cross)


@lru_cache(maxsize=65536)
def _stage_end_seconds_of(model: ModelSpec, profile: DeviceProfile, *, tp: int, pipelined: bool,
                          sequence_parallel: bool, tokens: float, dtype: str,
                          value_head: bool, compute_scale: float,
                          logprob_bytes: tuple[float, float], tp_cross: bool,
                          ) -> tuple[float, float]:
    """``_stage_end_seconds`` from the layout fields it reads (the search asks it for every
    micro-batch and recompute mode of a layout: cached)."""
    # First stage: embedding; last stage: output head with loss (forward + 2x backward).
    first_extra = 3 * embedding_seconds(model, profile, tokens=tokens, dtype=dtype) \
        * compute_scale
    # The head's GEMM forward and its two backward GEMMs, with the loss's log-prob traffic.
    loss_forward, loss_backward = logprob_bytes
    last_extra = (head_forward_seconds(model, profile, tokens=tokens, tp=tp, dtype=dtype,
                                       value_head=value_head, loss=True,
                                       loss_bytes_per_entry=loss_forward)
                  + 2 * head_forward_seconds(model, profile, tokens=tokens, tp=tp,
                                             dtype=dtype, value_head=value_head, loss=True,
                                             loss_bytes_per_entry=loss_backward / 2)
                  ) * compute_scale
    # The vocabulary-split embedding and log-softmax collectives of the forward pass (their
    # backward needs none).
    vocab_comm = vocab_parallel_seconds(model, profile, tokens=tokens, tp=tp, dtype=dtype,
                                        value_head=value_head,
                                        sequence_parallel=sequence_parallel,
                                        tp_crosses_nodes=tp_cross)
    first_extra += vocab_comm / (2 if pipelined else 1)
    last_extra += vocab_comm / 2 if pipelined else 0.0
    if not pipelined:
        return first_extra + last_extra, 0.0
    return first_extra, last_extra


def _fsdp_exposed_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig,
                          layer: LayerCost, *, forward: float, backward: float,
                          recompute_extra: float, dtype: str, gpus_per_node: int) -> float:
    """FSDP's per-layer all-gathers and reduce-scatters (and, hybrid-sharded, the
    all-reduce over replicas) a micro-batch does not hide behind compute, plus its fixed
    per-unit costs; 0 without FSDP."""
    if par.sharding != "fsdp" or par.dp <= 1:
        return 0.0
    b = DTYPE_BYTES[dtype]
    shard_span = fsdp_group_span(par, gpus_per_node)
    layer_weights = model.params_per_layer / par.tp * b
    layer_grads = model.params_per_layer / par.tp * MAIN_GRAD_BYTES
    gather = all_gather_seconds(profile, layer_weights, par.fsdp_shards, span=shard_span,
                                correction=TRAIN)
    scatter = reduce_scatter_seconds(profile, layer_grads, par.fsdp_shards,
                                     span=shard_span, correction=TRAIN)
    # Hybrid sharding: each layer's reduce-scattered gradient shard is then all-reduced
    # over the groups that hold the same shard (FSDP2's all-reduce over the replicate
    # dimension of its 2-D mesh, after the reduce-scatter).
    replicate = all_reduce_seconds(profile, layer_grads / par.fsdp_shards,
                                   par.fsdp_replicas,
                                   span=fsdp_replica_span(par, gpus_per_node),
                                   correction=TRAIN) if par.fsdp_replicas > 1 else 0.0
    fwd_comm = gather
    bwd_comm = gather + scatter + replicate
    fwd_compute = forward + layer.tp_training_forward_seconds
    bwd_compute = backward + layer.tp_backward_seconds + recompute_extra
    # On a CPU the collectives run on the cores that compute: nothing overlaps.
    if par.overlap_param_gather and profile.kind == "gpu":
        # Prefetching hides a layer's communication behind the previous layer's compute.
        per_layer_exposed = (max(0.0, fwd_comm - fwd_compute)
                             + max(0.0, bwd_comm - bwd_compute))
        exposed = model.layers * per_layer_exposed + fwd_comm + bwd_comm
    else:
        exposed = model.layers * (fwd_comm + bwd_comm)
    return exposed + 2 * model.layers * profile.overheads.fsdp_unit_seconds


def _pipeline_seconds(par: ParallelConfig, micro_batches: int, stage_time: float,
                      first_extra: float, last_extra: float) -> tuple[float, float]:
    """(seconds of the micro-batches through the pipeline, of which the bubble)."""
    slowest_stage = stage_time + max(first_extra, last_extra)
    if par.pp == 1:
        return micro_batches * slowest_stage, 0.0
    if par.vpp > 1:
        # Interleaved 1F1B: the bubble shrinks by the number of virtual stages.
        bubble = (par.pp - 1) * stage_time / par.vpp + first_extra + last_extra
    else:
        # 1F1B: (m - 1) steps at the pace of the slowest stage, plus one pass through all.
        bubble = (par.pp - 1) * stage_time + first_extra + last_extra - max(first_extra,
                                                                             last_extra)
    return micro_batches * slowest_stage + bubble, bubble


def _pipeline_p2p_seconds(model: ModelSpec, profile: DeviceProfile, par: ParallelConfig, *,
                          tokens: float, dtype: str, micro_batches: int,
                          gpus_per_node: int) -> float:
    """Activations and their gradients between pipeline stages, every micro-batch."""
    if par.pp <= 1:
        return 0.0
    world_cross = par.world_size > gpus_per_node
    sp_div = par.tp if par.sequence_parallel and par.tp > 1 else 1
    # Megatron's scatter/gather optimisation sends 1/tp of the activation per rank; every
    # rank of a stage sends at once, sharing its node's NICs.
    message = tokens * model.hidden * DTYPE_BYTES[dtype] / max(sp_div, par.tp)
    one = p2p_seconds(profile, message, world_cross, busy_ranks_per_node=par.tp * par.dp,
                      gpus_per_node=gpus_per_node)
    return 2 * one * (micro_batches + par.pp - 1) * par.vpp


def _gradient_reduction_seconds(model: ModelSpec, profile: DeviceProfile,
                                par: ParallelConfig, *, value_head: bool, grad_bytes: int,
                                dtype: str, gpus_per_node: int,
                                backward_window: float) -> float:
    """Gradient reduction over data-parallel replicas (FSDP already reduce-scattered), less
    what overlaps the backward (``backward_window`` seconds) on GPUs; and the tied
    embedding's all-reduce between the first and last stage."""
    dp_comm = 0.0
    if par.sharding != "fsdp":
        dp_comm = _replica_reduction_seconds(
            model, profile, tp=par.tp, pp=par.pp, dp=par.dp, ep=par.ep, etp=par.etp,
            sharded_optimizer=par.sharding == "optimizer", value_head=value_head,
            grad_bytes=grad_bytes, dtype=dtype, gpus_per_node=gpus_per_node)
        if par.overlap_grad_reduce and profile.kind == "gpu":
            dp_comm = max(0.0, dp_comm - backward_window)
    if par.pp > 1 and model.tied_embeddings and not value_head:
        # Tied embedding gradients are all-reduced between the first and last stage.
        dp_comm += all_reduce_seconds(profile, model.vocab * model.hidden / par.tp
                                      * grad_bytes, 2, par.world_size > gpus_per_node)
    return dp_comm


@lru_cache(maxsize=65536)
def _replica_reduction_seconds(model: ModelSpec, profile: DeviceProfile, *, tp: int, pp: int,
                               dp: int, ep: int, etp: int, sharded_optimizer: bool,
                               value_head: bool, grad_bytes: int, dtype: str,
                               gpus_per_node: int) -> float:
    """Seconds of reducing a stage's gradients over its data-parallel replicas (the
    distributed optimizer reduce-scatters them and all-gathers the updated parameters), with
    no overlap: it reads the layout's shape only, so every micro-batch and recompute mode of
    a layout shares it (cached)."""
    b = DTYPE_BYTES[dtype]
    dp_comm = 0.0
    local_params = stage_param_count(model, tp=tp, pp=pp, value_head=value_head, ep=ep,
                                     etp=etp)
    # Dense parameters reduce over the dp replicas, routed experts over theirs
    # (expert_dp ranks spaced ep * etp apart).
    expert_params = stage_expert_param_count(model, pp=pp, ep=ep, etp=etp)
    expert_dp = expert_replicas(tp=tp, dp=dp, ep=ep, etp=etp)
    groups = ((local_params - expert_params, dp, _replica_span(tp, dp, pp, gpus_per_node)),
              (expert_params, expert_dp,
               group_span(expert_dp, ep * etp, gpus_per_node,
                          busy_ranks_per_node=tp * dp * pp)))
    for params, group, span in groups:
        if group <= 1 or params <= 0:
            continue
        if sharded_optimizer:
            dp_comm += (reduce_scatter_seconds(profile, params * grad_bytes, group, span=span,
                                               correction=TRAIN)
                        + all_gather_seconds(profile, params * b, group, span=span,
                                             correction=TRAIN))
        else:
            dp_comm += all_reduce_seconds(profile, params * grad_bytes, group, span=span,
                                          correction=TRAIN)
    return dp_comm


def _training_memory(model: ModelSpec, par: ParallelConfig, layer: LayerCost, *,
                     value_head: bool, dtype: str, grad_bytes: int, micro_batches: int,
                     layers_per_stage: int, tokens: float,
                     logits_bytes_per_entry: float) -> MemoryBreakdown:
    """Resident states plus the activations in flight on the most loaded stage."""
    resident = optimizer_memory(model, par, value_head=value_head, trainable=True, dtype=dtype,
                                grad_bytes=grad_bytes)
    in_flight = min(par.pp, micro_batches)
    interleave = 1 + (par.pp - 1) / (par.pp * par.vpp) if par.vpp > 1 else 1.0
    first_stage_acts = layers_per_stage * layer.activation_bytes * in_flight * interleave
    vocab_local = model.head_output_size(value_head=value_head) / (
        1 if value_head else par.tp)
    logits = logits_bytes_per_entry * tokens * vocab_local
    last_stage_acts = layers_per_stage * layer.activation_bytes + logits
    activations = first_stage_acts if par.pp > 1 else first_stage_acts + logits
    activations = max(activations, last_stage_acts)
    return MemoryBreakdown(params=resident.params, grads=resident.grads,
                           optimizer=resident.optimizer, activations=activations)


def mfu(cost: TrainingCost, profile: DeviceProfile, gpus: int, dtype: str = "bf16") -> float:
    """Model FLOPs utilisation: model FLOPs / (seconds x GPUs x peak)."""
    return cost.model_flops / (cost.seconds * gpus * profile.peak_flops(dtype))


STEP_PART_CACHES = (_stage_end_seconds_of, _replica_reduction_seconds)
"""The caches beneath ``train_step``'s own: a benchmark that times a cold search clears them
with it."""
