"""The actor's train -> generate transition: regather the training shards into the generation
layout. Three schemes, as in HybridFlow §5.4 / Table 2 (M = actor weight bytes):

- ``all_gpus`` (DeepSpeed-Chat): all-gather across all N_a GPUs, volume (N_a-1)/N_a * M per
  GPU, peak parameter memory M.
- ``train_group`` (HybridFlow-V): all-gather within the training TP x PP group, volume
  (tp-1)/(tp) * M, peak M.
- ``micro_dp`` (3D-HybridEngine): all-gather within micro-DP groups, volume
  (tp - t_g p_g) / (t_g p_g t p) * M, peak M / (t_g p_g), zero redundancy.

The generate -> train direction frees the generation weights and moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from profiles.device import DTYPE_BYTES, DeviceProfile
from profiles.framework import FsdpGather, MegatronGather
from simulator.costs.primitives import Span, all_gather_seconds, broadcast_seconds, group_span
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig

Scheme = Literal["all_gpus", "train_group", "micro_dp"]
SCHEMES: tuple[Scheme, ...] = ("all_gpus", "train_group", "micro_dp")


@dataclass(frozen=True, slots=True)
class TransitionCost:
    scheme: Scheme
    seconds: float
    bytes_received_per_gpu: float
    """All-gather volume each GPU receives."""
    peak_param_bytes_per_gpu: float
    """Parameter memory per GPU at the peak of the transition."""
    redundant_bytes_per_gpu: float
    """Training weights that must be kept beside the generation weights."""
    group_size: int
    """GPUs in each all-gather group."""


def weight_tensors(model: ModelSpec, *, replicated: bool = True,
                   part: str = "all") -> dict[int, int]:
    """The model's weight tensors by size: {elements: how many tensors}; without
    ``replicated`` only those tensor parallelism splits (norm weights are whole on every
    tensor-parallel rank). ``part``: ``all``, ``experts`` (an MoE model's routed experts, which
    expert parallelism lays out) or ``dense`` (everything else)."""
    sizes: dict[int, int] = {}

    def add(elements: int, count: int) -> None:
        if count > 0:
            sizes[elements] = sizes.get(elements, 0) + count

    h, q, kv, ffn = model.hidden, model.q_size, model.kv_size, model.ffn_hidden
    mats = 3 if model.mlp == "swiglu" else 2
    moe = model.moe
    mla = model.mla
    if moe is not None and part in ("all", "experts"):
        add(h * moe.expert_ffn_hidden, mats * moe.experts * model.moe_layers)
    if part == "experts":
        return sizes
    if mla is None:
        add(h * q, 2 * model.layers)          # q and o projections
        add(h * kv, 2 * model.layers)         # k and v projections
    else:
        add(mla.kv_lora_rank * model.heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            model.layers)                                            # keys and values up
        add(model.v_size * h, model.layers)                          # output projection
        add((mla.q_lora_rank or h) * q, model.layers)                # queries (up)
        if replicated:  # duplicated on every tensor-parallel rank, with the latents' norms
            add(h * mla.latent_width, model.layers)
            if mla.q_lora_rank:
                add(h * mla.q_lora_rank, model.layers)
                add(mla.q_lora_rank, model.layers)
            add(mla.kv_lora_rank, model.layers)
    add(h * ffn, mats * (model.layers - model.moe_layers))  # dense MLPs
    if moe is not None:
        add(h * moe.experts, model.moe_layers)  # routers
        add(h * moe.shared_ffn, mats * moe.shared_experts * model.moe_layers)
    if replicated:
        add(h, 2 * model.layers + 1)      # norms
    add(model.embedding_params, 1)
    if model.lm_head_params:
        add(model.lm_head_params, 1)
    return sizes


def transition_volume_bytes(scheme: Scheme, model_bytes: float, *, train_shards: int,
                            gen_shards: int, world: int) -> float:
    """Per-GPU all-gather volume (bytes) for ``scheme``; ``train_shards`` = t*p (FSDP: the
    world size), ``gen_shards`` = t_g*p_g."""
    if scheme == "all_gpus":
        return (world - 1) / world * model_bytes
    if scheme == "train_group":
        return (train_shards - 1) / train_shards * model_bytes
    return (train_shards - gen_shards) / (gen_shards * train_shards) * model_bytes


def micro_dp_span(train: ParallelConfig, gen: GenerationConfig, gpus_per_node: int) -> Span:
    """Where a micro-DP group of the 3D-HybridEngine sits (HybridFlow §5.3), with Megatron's
    rank order (tensor parallelism innermost, then data, then pipeline stages outermost).

    The group gathers t/t_g consecutive tensor-parallel ranks of each of p/p_g pipeline stages;
    those stages are t*d ranks apart, so when generation merges pipeline stages (p_g < p) the
    group reaches into other stages, usually on other nodes. Every rank gathers at the same
    moment, sharing its node's NICs. FSDP (no pipeline) shards over consecutive ranks."""
    if train.sharding == "fsdp":
        group = max(1, train.weight_shards // gen.model_parallel_size)
        return group_span(group, 1, gpus_per_node, busy_ranks_per_node=train.world_size)
    tp_part = max(1, train.tp // gen.tp)
    pp_part = max(1, train.pp // gen.pp)
    stage = train.tp * train.dp
    if pp_part == 1:
        return group_span(tp_part, 1, gpus_per_node, busy_ranks_per_node=train.world_size)
    stages_per_node = max(1, gpus_per_node // stage)
    per_node = min(tp_part, gpus_per_node) * min(pp_part, stages_per_node)
    nodes = -(-pp_part // stages_per_node) * max(1, -(-tp_part // gpus_per_node))
    busy = max(per_node, min(train.world_size, gpus_per_node))
    return Span(ranks_per_node=per_node, nodes=nodes, busy_ranks_per_node=busy,
                gpus_per_node=gpus_per_node)


def dtensor_full_tensor_seconds(model: ModelSpec, profile: DeviceProfile,
                                train: ParallelConfig, *, gpus_per_node: int) -> float:
    """Seconds to gather every weight tensor whole on every GPU of an FSDP (DTensor) layout by
    ``full_tensor()`` of its fp32 shards, tensor by tensor. On a (data, tensor)-parallel mesh
    torch's redistribute gathers the innermost mesh dimension first ("we first traverse from
    inner placement to outer placement", torch/distributed/tensor/_redistribute.py, torch
    2.5-2.7): a tensor that tensor parallelism splits is gathered over its tp ranks (inside a
    node), then over the data-parallel ranks, tp ranks apart, as the tp-complete tensor; one
    it leaves whole (a norm) over the data-parallel ranks only. Without tensor parallelism, one
    all-gather over the sharding group."""
    shards, tp = train.weight_shards, train.tp
    busy = train.world_size
    fp32 = DTYPE_BYTES["fp32"]
    every = weight_tensors(model)
    if tp <= 1:
        span = group_span(shards, 1, gpus_per_node, busy_ranks_per_node=busy)
        return sum(count * all_gather_seconds(profile, elements * fp32, shards, span=span)
                   for elements, count in every.items())
    dp = max(1, shards // tp)
    tp_span = group_span(tp, 1, gpus_per_node, busy_ranks_per_node=busy)
    dp_span = group_span(dp, tp, gpus_per_node, busy_ranks_per_node=busy)
    split = weight_tensors(model, replicated=False)
    seconds = 0.0
    for elements, count in every.items():
        whole_bytes = elements * fp32
        across_dp = all_gather_seconds(profile, whole_bytes, dp, span=dp_span)
        split_count = split.get(elements, 0)
        seconds += split_count * (all_gather_seconds(profile, whole_bytes / dp, tp, span=tp_span)
                                  + across_dp)
        seconds += (count - split_count) * across_dp
    return seconds


def tp_then_pp_broadcast_seconds(model: ModelSpec, profile: DeviceProfile,
                                 train: ParallelConfig, *, dtype: str,
                                 gpus_per_node: int) -> float:
    """Seconds to gather every dense weight tensor of a Megatron layout whole on every GPU of
    its tensor x pipeline group, tensor by tensor, as NeMo-RL v0.3's refit does
    (nemo_rl/models/megatron/refit_utils.py gather_params at v0.3.0: an all-gather over the
    tensor-parallel ranks, L114, then a broadcast from the owning stage over the pipeline
    group, L127, for every key): the tensor-parallel ranks of a stage sit side by side, its
    pipeline peers tp x dp ranks apart. A tensor tensor parallelism leaves whole (a norm) is
    only broadcast."""
    size = DTYPE_BYTES[dtype]
    busy = train.world_size
    tp_span = group_span(train.tp, 1, gpus_per_node, busy_ranks_per_node=busy)
    pp_span = group_span(train.pp, train.tp * train.dp, gpus_per_node, busy_ranks_per_node=busy)
    seconds = sum(count * broadcast_seconds(profile, elements * size, train.pp, span=pp_span)
                  for elements, count in weight_tensors(model, part="dense").items())
    return seconds + sum(
        count * all_gather_seconds(profile, elements * size, train.tp, span=tp_span)
        for elements, count in weight_tensors(model, replicated=False, part="dense").items())


def transition(model: ModelSpec, profile: DeviceProfile, train: ParallelConfig,
               gen: GenerationConfig, *, scheme: Scheme = "micro_dp", dtype: str = "bf16",
               gpus_per_node: int = 8, fsdp_gather: FsdpGather = "hierarchical",
               megatron_gather: MegatronGather = "hierarchical") -> TransitionCost:
    """Cost of one train -> generate transition of the actor under ``scheme``. An MoE model's
    routed experts are gathered on their own: sharded over ep x etp (x pp) in training and over
    max(tp, ep) (x pp) in generation. ``fsdp_gather``: how an FSDP layout gathers each tensor
    under ``all_gpus`` (``TrainingSettings.transition_fsdp_gather``); ``megatron_gather``: how
    a Megatron layout gathers its dense tensors under ``train_group``
    (``TrainingSettings.transition_megatron_gather``)."""
    weights = model.params() * DTYPE_BYTES[dtype]
    if scheme == "all_gpus" and train.sharding == "fsdp" and fsdp_gather == "dtensor_fp32":
        shards = train.weight_shards
        return TransitionCost(
            scheme=scheme,
            seconds=dtensor_full_tensor_seconds(model, profile, train,
                                                gpus_per_node=gpus_per_node),
            bytes_received_per_gpu=(shards - 1) / shards * model.params() * DTYPE_BYTES["fp32"],
            peak_param_bytes_per_gpu=weights, redundant_bytes_per_gpu=weights / shards,
            group_size=shards)
    expert_weights = model.expert_params() * DTYPE_BYTES[dtype]
    dense_weights = weights - expert_weights
    train_shards = train.weight_shards
    # A tensor gathered "on every GPU" is gathered over the GPUs sharing one copy of it: all of
    # them, or one hybrid-sharding group (the other groups hold the same shards).
    world = train_shards if train.sharding == "fsdp" else train.world_size
    gen_shards = gen.model_parallel_size
    volume = transition_volume_bytes(scheme, dense_weights, train_shards=train_shards,
                                     gen_shards=gen_shards, world=world)
    expert_train = train_shards if train.sharding == "fsdp" else train.ep * train.etp * train.pp
    expert_gen = max(gen.tp, gen.ep) * gen.pp
    expert_volume = max(0.0, transition_volume_bytes(
        scheme, expert_weights, train_shards=expert_train, gen_shards=expert_gen, world=world))
    volume = max(0.0, volume) + expert_volume
    if scheme == "all_gpus":
        group = world
        span = group_span(group, 1, gpus_per_node, busy_ranks_per_node=train.world_size)
        peak = weights
        redundant = weights / world
    elif scheme == "train_group":
        group = train_shards
        # The whole tensor x pipeline group: what a micro-DP group is for a one-GPU engine.
        span = micro_dp_span(train, GenerationConfig(tp=1, pp=1), gpus_per_node)
        peak = weights
        redundant = weights / train_shards
    else:
        group = max(1, train_shards // gen_shards)
        span = micro_dp_span(train, gen, gpus_per_node)
        peak = weights / gen_shards
        redundant = 0.0
    seconds = 0.0
    dense_volume = volume - expert_volume
    if scheme == "train_group" and train.sharding != "fsdp" \
            and megatron_gather == "tp_then_pp_broadcast":
        seconds = tp_then_pp_broadcast_seconds(model, profile, train, dtype=dtype,
                                               gpus_per_node=gpus_per_node)
    elif dense_volume > 0 and group > 1:
        # One all-gather per weight tensor (engines gather tensor by tensor), each moving its
        # share of the volume: gathering V over a group of n outputs V / ((n-1)/n) bytes.
        fraction = dense_volume / dense_weights
        # Tensors tensor parallelism leaves whole (norms) are already complete on every rank
        # unless FSDP or merged pipeline stages split them too.
        pipeline_merged = train.pp != (gen.pp if scheme == "micro_dp" else 1)
        whole_everywhere = train.sharding != "fsdp" and not pipeline_merged
        tensors = weight_tensors(model, replicated=not whole_everywhere, part="dense")
        seconds = sum(count * all_gather_seconds(
            profile, elements * DTYPE_BYTES[dtype] * fraction * group / (group - 1), group,
            span=span) for elements, count in tensors.items())
    if expert_volume > 0:
        # The experts gather over the ranks that split them in training (each expert
        # whole on one of ep ranks, or cut over etp), consecutive in Megatron's order.
        expert_group = {"all_gpus": world, "train_group": expert_train}.get(
            scheme, max(2, expert_train // expert_gen))
        expert_span = group_span(expert_group, 1, gpus_per_node,
                                 busy_ranks_per_node=train.world_size)
        fraction = expert_volume / expert_weights
        seconds += sum(count * all_gather_seconds(
            profile, elements * DTYPE_BYTES[dtype] * fraction * expert_group
            / (expert_group - 1), expert_group, span=expert_span)
            for elements, count in weight_tensors(model, part="experts").items())
    return TransitionCost(scheme=scheme, seconds=seconds, bytes_received_per_gpu=volume,
                          peak_param_bytes_per_gpu=peak, redundant_bytes_per_gpu=redundant,
                          group_size=group)


def compare_schemes(model: ModelSpec, profile: DeviceProfile, train: ParallelConfig,
                    gen: GenerationConfig, *, dtype: str = "bf16", gpus_per_node: int = 8,
                    fsdp_gather: FsdpGather = "hierarchical",
                    megatron_gather: MegatronGather = "hierarchical",
                    ) -> dict[str, TransitionCost]:
    """All three schemes side by side."""
    return {s: transition(model, profile, train, gen, scheme=s, dtype=dtype,
                          gpus_per_node=gpus_per_node, fsdp_gather=fsdp_gather,
                          megatron_gather=megatron_gather)
            for s in SCHEMES}
