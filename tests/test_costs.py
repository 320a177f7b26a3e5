"""Cost-model formulas against hand-computed and published values."""

from __future__ import annotations

import math

import pytest

from profiles.device import load_profile
from simulator.costs.generation import generate, replica_lengths
from simulator.costs.inference import forward_pass
from simulator.costs.primitives import all_gather_seconds, all_reduce_seconds
from simulator.costs.training import model_flops_per_sequence, optimizer_memory, train_step
from simulator.costs.transformer import layer_cost
from simulator.costs.transition import transition, transition_volume_bytes
from simulator.specs.lengths import parse_lengths
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

A100 = load_profile("a100-80gb")
GB = 1e9


# --- 3D-HybridEngine transition (HybridFlow §5.4, Table 2) -----------------------------------

def test_hybrid_engine_volume_for_7b_trained_1_8_2_generating_tg2() -> None:
    # 7B actor (M = 14 GB in bf16), training p-t-d = 1-8-2 on 16 GPUs, generation t_g = 2.
    kw = {"train_shards": 8, "gen_shards": 2, "world": 16}
    assert transition_volume_bytes("micro_dp", 14 * GB, **kw) == pytest.approx(5.25 * GB)
    assert transition_volume_bytes("all_gpus", 14 * GB, **kw) == pytest.approx(13.125 * GB)
    assert transition_volume_bytes("train_group", 14 * GB, **kw) == pytest.approx(12.25 * GB)


def test_transition_peak_memory_and_redundancy() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    train = ParallelConfig(tp=8, pp=1, dp=2)
    gen = GenerationConfig(tp=2)
    m = model.param_count * 2
    hybrid = transition(model, A100, train, gen, scheme="micro_dp")
    naive = transition(model, A100, train, gen, scheme="all_gpus")
    assert hybrid.peak_param_bytes_per_gpu == pytest.approx(m / 2)
    assert hybrid.redundant_bytes_per_gpu == 0
    assert hybrid.group_size == 4  # d_g = 8 / 2 consecutive ranks, inside one node
    assert naive.peak_param_bytes_per_gpu == pytest.approx(m)
    assert naive.redundant_bytes_per_gpu == pytest.approx(m / 16)
    assert hybrid.seconds < naive.seconds  # intra-node and smaller


def test_no_transition_when_layouts_match() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    cost = transition(model, A100, ParallelConfig(tp=2, dp=4), GenerationConfig(tp=2))
    assert cost.bytes_received_per_gpu == 0 and cost.seconds == 0


def test_dtensor_fp32_refit_gathers_tp_first_then_the_whole_fp32_tensor_across_nodes() -> None:
    """NeMo-RL's DTensor refit: full_tensor() of fp32 shards on a (dp, tp) mesh gathers the
    tensor-parallel ranks first, so each GPU then receives (dp-1)/dp of every fp32 tensor over
    its own NIC; the hierarchical gather sends only each local rank's 1/k share between
    nodes, in bf16."""
    h100 = load_profile("h100-80gb")
    model = MODEL_PRESETS["llama3-70b"]
    train = ParallelConfig(tp=8, dp=8, sharding="fsdp")
    gen = GenerationConfig(tp=4)
    dtensor = transition(model, h100, train, gen, scheme="all_gpus", fsdp_gather="dtensor_fp32")
    hierarchical = transition(model, h100, train, gen, scheme="all_gpus")
    fp32_bytes = model.params() * 4
    assert dtensor.bytes_received_per_gpu == pytest.approx(63 / 64 * fp32_bytes)
    assert hierarchical.bytes_received_per_gpu == pytest.approx(63 / 64 * fp32_bytes / 2)
    nic_floor_seconds = 7 / 8 * fp32_bytes / h100.inter_node.bandwidth_bytes_per_s
    assert dtensor.seconds >= nic_floor_seconds
    assert dtensor.seconds <= 1.3 * nic_floor_seconds  # plus NVLink and per-call latency
    assert hierarchical.seconds < nic_floor_seconds / 3
    # Inside one node without tensor parallelism: the same all-gather, twice the bytes.
    one_node = ParallelConfig(tp=1, dp=8, sharding="fsdp")
    fp32 = transition(model, h100, one_node, GenerationConfig(tp=1), scheme="all_gpus",
                      fsdp_gather="dtensor_fp32")
    bf16 = transition(model, h100, one_node, GenerationConfig(tp=1), scheme="all_gpus")
    assert fp32.seconds == pytest.approx(2 * bf16.seconds, rel=0.1)
    # Megatron layouts and the other schemes do not gather through DTensor.
    megatron = ParallelConfig(tp=8, dp=8)
    assert transition(model, h100, megatron, gen, scheme="all_gpus",
                      fsdp_gather="dtensor_fp32") == transition(model, h100, megatron, gen,
                                                                 scheme="all_gpus")


def test_nemo_rl_v03_megatron_refit_broadcasts_tp_complete_tensors_over_the_pipeline() -> None:
    """v0.3's gather_params: each tensor all-gathered over its tensor-parallel ranks, then
    broadcast whole from its stage to the others; stages sit tp x dp ranks apart (on other
    nodes here), so every GPU receives every other stage's whole tensors over its NIC."""
    from simulator.costs.primitives import broadcast_seconds, group_span

    h100 = load_profile("h100-80gb")
    model = MODEL_PRESETS["llama3-70b"]
    train = ParallelConfig(tp=4, pp=4, dp=4)  # 64 GPUs; a stage is 16 ranks, two nodes
    gen = GenerationConfig(tp=4)
    v03 = transition(model, h100, train, gen, scheme="train_group",
                     megatron_gather="tp_then_pp_broadcast")
    hierarchical = transition(model, h100, train, gen, scheme="train_group")
    assert v03.bytes_received_per_gpu == hierarchical.bytes_received_per_gpu
    model_bytes = model.params() * 2
    nic_floor_seconds = model_bytes / h100.inter_node.bandwidth_bytes_per_s
    assert nic_floor_seconds <= v03.seconds <= 1.3 * nic_floor_seconds
    assert hierarchical.seconds < nic_floor_seconds / 2
    # Without pipeline stages nothing is broadcast: the same gather inside the node.
    one_stage = ParallelConfig(tp=8, pp=1, dp=8)
    assert transition(model, h100, one_stage, gen, scheme="train_group",
                      megatron_gather="tp_then_pp_broadcast").seconds == pytest.approx(
        transition(model, h100, one_stage, gen, scheme="train_group").seconds, rel=0.05)
    # A broadcast delivers the whole message to every rank: inside a node at NVLink speed,
    # across nodes at the rank's NIC share.
    one_gb = 1e9
    across = broadcast_seconds(h100, one_gb, 4, span=group_span(4, 16, 8, busy_ranks_per_node=8))
    inside = broadcast_seconds(h100, one_gb, 4, span=group_span(4, 1, 8))
    assert across >= one_gb / h100.inter_node.bandwidth_bytes_per_s > inside
    assert broadcast_seconds(h100, one_gb, 1) == 0


def test_only_nemo_rl_v03_refits_megatron_weights_stage_by_stage() -> None:
    from profiles.framework import load_framework

    assert load_framework("nemo-rl-0.3").training.transition_megatron_gather \
        == "tp_then_pp_broadcast"
    for later in ("nemo-rl-0.5", "nemo-rl", "verl"):
        assert load_framework(later).training.transition_megatron_gather == "hierarchical"


def test_torch_fsdp_frameworks_refit_through_dtensor_fp32() -> None:
    """NeMo-RL's DTensor policy and verl's FSDP actor keep fp32 weights and gather them with
    full_tensor(); OpenRLHF's DeepSpeed ZeRO-3 gathers its bf16 parameters."""
    from profiles.framework import load_framework

    for name in ("nemo-rl", "nemo-rl-0.5", "nemo-rl-0.3", "verl"):
        assert load_framework(name).training.transition_fsdp_gather == "dtensor_fp32", name
    assert load_framework("openrlhf").training.transition_fsdp_gather == "hierarchical"


# --- training -----------------------------------------------------------------------------

def test_activation_memory_matches_korthikanti_formula() -> None:
    # Korthikanti et al. 2022 Eq. 1: per layer s*b*h*(34 + 5*a*s/h) bytes without parallelism;
    # Eq. 5 (selective recompute + sequence parallelism): 34*s*b*h / t.
    model = MODEL_PRESETS["gpt-22b"]
    s, b, h, a = 2048, 1, model.hidden, model.heads
    full = layer_cost(model, A100, micro_batch=b, seq_len=s, tp=1, sequence_parallel=False,
                      dtype="bf16", attention="unfused", recompute="none")
    assert full.activation_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    sel = layer_cost(model, A100, micro_batch=b, seq_len=s, tp=8, sequence_parallel=True,
                     dtype="bf16", attention="unfused", recompute="selective")
    assert sel.activation_bytes == pytest.approx(34 * s * b * h / 8)
    tp_only = layer_cost(model, A100, micro_batch=b, seq_len=s, tp=8, sequence_parallel=False,
                         dtype="bf16", attention="unfused", recompute="none")
    # Eq. 2 (tensor parallelism without sequence parallelism): s*b*h*(10 + 24/t + 5as/(ht)).
    expected = s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert tp_only.activation_bytes == pytest.approx(expected)


def test_model_flops_reproduce_published_mfu() -> None:
    # Korthikanti Table 5: 175B, batch 64, 13.75 s on 64 A100s -> 51.4% MFU (Eq. 7, 312 TFLOP/s).
    model = MODEL_PRESETS["gpt-175b"]
    flops = 64 * model_flops_per_sequence(model, 2048, value_head=False)
    assert flops / (13.75 * 64 * 312e12) == pytest.approx(0.514, abs=0.002)


@pytest.mark.parametrize(("sharding", "bytes_per_param"), [("none", 18), ("optimizer", 6 + 12 / 4)])
def test_mixed_precision_adam_bytes_per_parameter(sharding: str, bytes_per_param: float) -> None:
    # Megatron: 18 bytes/param; with the distributed optimizer 6 + 12/d (Megatron-LM docs).
    model = MODEL_PRESETS["llama2-7b"]
    par = ParallelConfig(tp=1, dp=4, sharding=sharding)
    memory = optimizer_memory(model, par, value_head=False, trainable=True, dtype="bf16")
    assert memory.total / model.param_count == pytest.approx(bytes_per_param)


def test_fsdp_shards_everything() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    small = optimizer_memory(model, ParallelConfig(dp=8, sharding="fsdp"), value_head=False,
                             trainable=True, dtype="bf16")
    large = optimizer_memory(model, ParallelConfig(dp=16, sharding="fsdp"), value_head=False,
                             trainable=True, dtype="bf16")
    assert large.optimizer == pytest.approx(small.optimizer / 2)
    assert small.total < 18 * model.param_count / 8 * 1.1


def test_pipeline_bubble_follows_1f1b() -> None:
    model = MODEL_PRESETS["llama2-13b"]
    step = {m: train_step(model, A100, ParallelConfig(tp=8, pp=4, dp=1),
                          global_batch=m, seq_len=2048) for m in (4, 64)}
    for m, cost in step.items():
        stages = cost.breakdown["compute"] + cost.breakdown["tp_comm"]
        per_micro = stages / m
        # Bubble ~ (p - 1) stage-steps: its share falls from (p-1)/(m+p-1) as m grows.
        assert cost.breakdown["pipeline_bubble"] == pytest.approx(3 * per_micro, rel=0.1)
    interleaved = train_step(model, A100, ParallelConfig(tp=8, pp=4, vpp=2, dp=1),
                             global_batch=4, seq_len=2048)
    assert interleaved.breakdown["pipeline_bubble"] < step[4].breakdown["pipeline_bubble"]


def test_recompute_trades_time_for_memory() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    costs = {r: train_step(model, A100, ParallelConfig(tp=2, dp=4, recompute=r),
                           global_batch=32, seq_len=4096) for r in ("none", "selective", "full")}
    assert costs["none"].seconds <= costs["selective"].seconds < costs["full"].seconds
    assert costs["none"].memory.activations >= costs["selective"].memory.activations \
        > costs["full"].memory.activations


def test_data_parallel_adds_gradient_reduction() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    one = train_step(model, A100, ParallelConfig(tp=8, dp=1), global_batch=16, seq_len=1024)
    two = train_step(model, A100, ParallelConfig(tp=8, dp=2, overlap_grad_reduce=False),
                     global_batch=32, seq_len=1024, gpus_per_node=8)
    assert one.breakdown["dp_comm"] == 0
    assert two.breakdown["dp_comm"] > 0  # crosses nodes: dp group of 2 with tp 8


# --- inference and generation ------------------------------------------------------------------

def test_forward_pass_is_about_a_third_of_training() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    par = ParallelConfig(tp=2, dp=4, recompute="none")
    infer = forward_pass(model, A100, par, sequences=64, seq_len=2048, micro_batch=2)
    train = train_step(model, A100, par, global_batch=64, seq_len=2048)
    assert 0.25 < infer.seconds / train.seconds < 0.45


# Llama-2-7B by hand: 32 layers, hidden 4096, MLP 11008 (SwiGLU), vocab 32000, untied head.
LLAMA2_7B_LINEAR_PER_LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008  # q, k, v, o + gate, up, down
LLAMA2_7B_DECODE_WEIGHT_BYTES = 2 * (32 * LLAMA2_7B_LINEAR_PER_LAYER + 4096 * 32000)  # bf16
LLAMA2_7B_KV_BYTES_PER_TOKEN = 2 * 32 * 4096 * 2  # K and V, every layer, bf16
A100_STREAM_BYTES_PER_S = 2.039e12 * 0.87  # a100-80gb.yaml: HBM peak x streaming efficiency
A100_LAUNCH_SECONDS = 5e-6  # a100-80gb.yaml: kernel_launch_seconds


def test_decode_step_matches_a_hand_calculation() -> None:
    """Batch 1: memory-bound, every step reads the weights once and the KV cache so far, and
    launches 10 kernels per layer. 64 steps after a 128-token prompt: the cache holds
    129 ... 192 tokens, 160.5 on average (the KV read is linear in it, so the mean is exact)."""
    model = MODEL_PRESETS["llama2-7b"]
    assert LLAMA2_7B_DECODE_WEIGHT_BYTES == 13_214_154_752
    cost = generate(model, A100, GenerationConfig(tp=1), lengths=(64,), prompt_len=128,
                    kv_budget_bytes=40 * GB)
    per_step = ((LLAMA2_7B_DECODE_WEIGHT_BYTES + 160.5 * LLAMA2_7B_KV_BYTES_PER_TOKEN)
                / A100_STREAM_BYTES_PER_S + 32 * 10 * A100_LAUNCH_SECONDS)
    assert cost.decode_steps == 64
    assert cost.decode_seconds == pytest.approx(64 * per_step, rel=1e-6)
    assert per_step == pytest.approx(0.009097, rel=1e-3)  # 7.5 ms of HBM + 1.6 ms of launches
    assert cost.memory.kv_cache == (128 + 64) * LLAMA2_7B_KV_BYTES_PER_TOKEN
    # Tensor parallelism halves the bytes per GPU (KV heads split too); launches stay.
    tp2 = generate(model, A100, GenerationConfig(tp=2), lengths=(64,), prompt_len=128,
                   kv_budget_bytes=40 * GB)
    tp2_memory = (LLAMA2_7B_DECODE_WEIGHT_BYTES + 160.5 * LLAMA2_7B_KV_BYTES_PER_TOKEN) / 2 \
        / A100_STREAM_BYTES_PER_S
    assert tp2.decode_seconds > 64 * (tp2_memory + 32 * 10 * A100_LAUNCH_SECONDS)


def test_kv_capacity_limits_running_batch_and_is_reported() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    gen = GenerationConfig(tp=1, max_num_seqs=1024)
    budget = 1024 * 2 * 0.5 * 2**20 * 32  # room for 32 sequences of 2048 tokens
    cost = generate(model, A100, gen, lengths=(1024,) * 128, prompt_len=1024,
                    kv_budget_bytes=budget)
    assert cost.max_running == 32
    assert cost.decode_steps == 4 * 1024  # four waves
    tiny = generate(model, A100, gen, lengths=(1024,), prompt_len=1024,
                    kv_budget_bytes=0.5 * GB)
    assert not tiny.feasible and math.isinf(tiny.seconds)
    assert "KV cache for one 2048-token sequence needs 1.00 GiB" in tiny.reason


def test_long_tail_decides_generation_time() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    gen = GenerationConfig(tp=1)
    tail = parse_lengths({"distribution": "lognormal", "median": 300, "sigma": 1.0,
                          "max": 4096}, "r")
    lengths = replica_lengths(tail, 256, 4)
    assert max(lengths) == tail.max_tokens  # the replica simulated holds the longest response
    cost = generate(model, A100, gen, lengths=lengths, prompt_len=256, kv_budget_bytes=40 * GB)
    assert cost.decode_steps >= tail.max_tokens
    mean = round(sum(lengths) / len(lengths))
    same_tokens = generate(model, A100, gen, lengths=(mean,) * len(lengths), prompt_len=256,
                           kv_budget_bytes=40 * GB)
    assert cost.seconds > 1.5 * same_tokens.seconds


# --- collectives ------------------------------------------------------------------------------

def test_collectives_scale_with_group_and_size() -> None:
    assert all_reduce_seconds(A100, 1e9, 1) == 0
    small, large = (all_reduce_seconds(A100, s, 8) for s in (1e6, 1e9))
    assert 0 < small < large
    # All-reduce moves twice what all-gather moves.
    assert all_reduce_seconds(A100, 1e9, 8) == pytest.approx(2 * all_gather_seconds(A100, 1e9, 8))
    assert all_gather_seconds(A100, 1e9, 16, crosses_nodes=True) > all_gather_seconds(A100, 1e9,
                                                                                      8)


# --- network topology: collectives priced by where their ranks sit ---------------------------

def test_collectives_share_the_nodes_nics_worked_example() -> None:
    """README's worked example: a 13B model, Megatron tp 8 x dp 4 on 4 nodes of 8 A100s.
    Each data-parallel group has one rank per node (ranks 8 apart) and all eight groups of a
    node reduce at once. Reduce-scatter of 6.5 GB of fp32 gradients per rank over 4 nodes: each
    rank sends 3/4 of it; a DGX gives every rank its own 200 Gb/s NIC (25 GB/s x 0.86, the
    nccl-tests fraction), one NIC per node is shared by 8 ranks (3.125 GB/s x 0.86)."""
    from simulator.costs.primitives import group_span, reduce_scatter_seconds
    from simulator.specs.cluster import ClusterSpec

    grads = 6.5e9
    span = group_span(4, 8, 8, busy_ranks_per_node=32)
    assert (span.ranks_per_node, span.nodes, span.busy_ranks_per_node) == (1, 4, 8)
    dgx = reduce_scatter_seconds(A100, grads, 4, span=span)
    wire = 3 / 4 * grads
    assert dgx == pytest.approx(wire / (25e9 * 0.86) + 3 * 20e-6, rel=1e-9)
    one_nic = ClusterSpec.from_value({"nodes": 4, "network": {"nics_per_node": 1,
                                                              "nic_bandwidth_gbps": 200}})
    shared = reduce_scatter_seconds(one_nic.profile(), grads, 4, span=span)
    assert shared == pytest.approx(wire / (25e9 / 8 * 0.86) + 3 * 20e-6, rel=1e-9)
    # tp 1: the data-parallel group has 8 ranks per node; the hierarchical algorithm
    # reduces inside the node first and sends 1/8 of the bytes between nodes.
    flat = group_span(32, 1, 8, busy_ranks_per_node=32)
    assert (flat.ranks_per_node, flat.nodes) == (8, 4)
    assert reduce_scatter_seconds(one_nic.profile(), grads, 32, span=flat) < shared / 4


def test_training_data_parallel_time_follows_the_network() -> None:
    model = MODEL_PRESETS["llama2-13b"]
    from simulator.specs.cluster import ClusterSpec

    par = ParallelConfig(tp=8, dp=4, sharding="optimizer", overlap_grad_reduce=False)
    dgx = train_step(model, A100, par, global_batch=64, seq_len=2048)
    one_nic = ClusterSpec.from_value({"nodes": 4, "network": {"nics_per_node": 1,
                                                              "nic_bandwidth_gbps": 200}})
    shared = train_step(model, one_nic.profile(), par, global_batch=64, seq_len=2048)
    assert shared.breakdown["dp_comm"] == pytest.approx(8 * dgx.breakdown["dp_comm"], rel=0.01)
    assert shared.breakdown["compute"] == dgx.breakdown["compute"]


def test_a_node_groups_wired_profile_is_one_object_per_device_and_network() -> None:
    """The search asks a cluster for its device profile tens of thousands of times, and the
    cost models cache on the profile: one group gives one object however often it is asked
    (and a resized cluster of the same wiring the same one), while another network or
    shorthand bandwidth gives its own link."""
    from simulator.specs.cluster import ClusterSpec

    one_nic = {"nodes": 4, "network": {"nics_per_node": 1, "nic_bandwidth_gbps": 200}}
    first = ClusterSpec.from_value(one_nic).profile()
    assert ClusterSpec.from_value(one_nic).profile() is first
    assert ClusterSpec.from_value({**one_nic, "nodes": 2}).profile() is first
    assert (first.nics_per_node, first.inter_node.bandwidth_bytes_per_s) == (1, 25e9)
    per_gpu = ClusterSpec.from_value({"nodes": 4, "inter_node_bandwidth_gbps": 100}).profile()
    assert (per_gpu.nics_per_node, per_gpu.inter_node.bandwidth_bytes_per_s) == (8, 12.5e9)
    assert ClusterSpec.from_value({"nodes": 4}).profile() is A100


def test_micro_dp_groups_reach_other_pipeline_stages() -> None:
    """Training pp 2 x tp 4 x dp 2 on two nodes (a stage per node), generation tp 4, pp 1: a
    micro-DP group joins the same tensor-parallel rank of both stages, 8 ranks apart, so its
    all-gather crosses nodes (it was priced as two neighbours on one node)."""
    from simulator.costs.transition import micro_dp_span

    train = ParallelConfig(tp=4, pp=2, dp=2)
    across = micro_dp_span(train, GenerationConfig(tp=4, pp=1), 8)
    assert across.crosses_nodes and across.ranks_per_node == 1 and across.nodes == 2
    within = micro_dp_span(train, GenerationConfig(tp=2, pp=2), 8)
    assert not within.crosses_nodes and within.ranks_per_node == 2
    model = MODEL_PRESETS["llama2-13b"]
    crossing = transition(model, A100, train, GenerationConfig(tp=4, pp=1))
    local = transition(model, A100, ParallelConfig(tp=8, pp=1, dp=2),
                       GenerationConfig(tp=4, pp=1))
    # Same group size (2) and the same bytes per GPU, but one crosses nodes.
    assert crossing.group_size == local.group_size == 2
    assert crossing.bytes_received_per_gpu == pytest.approx(local.bytes_received_per_gpu)
    assert crossing.seconds > 2 * local.seconds


def test_tensor_parallel_ranks_each_hold_the_replicated_parameters() -> None:
    # Norms, row-parallel biases and learned positions are whole on every tp rank; the rest
    # is split: two ranks together hold the model plus one extra copy of the replicated part.
    from simulator.costs.transformer import stage_param_count

    for name in ("llama2-7b", "tiny-gpt-2l"):
        model = MODEL_PRESETS[name]
        one = stage_param_count(model, tp=1, pp=1, value_head=False)
        two = stage_param_count(model, tp=2, pp=1, value_head=False)
        replicated = (model.layers * model.replicated_params_per_layer
                      + model.final_norm_params + model.learned_positions * model.hidden)
        assert one == model.param_count
        assert 2 * two == pytest.approx(model.param_count + replicated)


def test_fp32_training_keeps_no_master_weights() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    par = ParallelConfig(tp=1, dp=1)
    fp32 = optimizer_memory(model, par, value_head=False, trainable=True, dtype="fp32")
    bf16 = optimizer_memory(model, par, value_head=False, trainable=True, dtype="bf16")
    assert fp32.optimizer == pytest.approx(8 * model.param_count)
    assert bf16.optimizer == pytest.approx(12 * model.param_count)
    assert fp32.params == pytest.approx(2 * bf16.params)


def test_memory_breakdowns_add_and_subtract_every_kind() -> None:
    from dataclasses import fields

    from simulator.costs.memory import MemoryBreakdown

    for i, f in enumerate(fields(MemoryBreakdown)):
        one = MemoryBreakdown(**{f.name: float(i + 1)})
        assert getattr(one + one, f.name) == 2 * (i + 1)
        assert getattr(one + one - one, f.name) == i + 1
        assert (one + one).total == 2 * (i + 1)
