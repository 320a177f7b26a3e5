"""Mixture-of-experts cost mechanisms: expert GEMMs at their per-expert batch, the token
all-to-all over the expert-parallel group, expert weights sharded by ep, decode reading the
experts its batch touches, and the search over ep."""

from __future__ import annotations

import dataclasses

import pytest

from planner.search import Search, SearchOptions
from planner.space import SpaceOptions
from profiles.datafile import SpecError
from profiles.device import load_profile
from simulator.costs.generation import decode_step_model
from simulator.costs.primitives import Span, all_to_all_seconds
from simulator.costs.training import train_step
from simulator.costs.transformer import MOE_IMBALANCE_CORRECTION, layer_cost, stage_param_count
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

QWEN3_30B = MODEL_PRESETS["qwen3-30b-a3b"]
H100 = load_profile("h100-80gb")


def test_expert_weights_are_sharded_by_ep_and_the_rest_by_tp():
    one = stage_param_count(QWEN3_30B, tp=1, pp=1, value_head=False)
    eight = stage_param_count(QWEN3_30B, tp=1, pp=1, value_head=False, ep=8)
    assert one == pytest.approx(QWEN3_30B.param_count)
    assert one - eight == pytest.approx(QWEN3_30B.expert_params() * 7 / 8)


def test_all_to_all_is_free_alone_and_slower_across_nodes():
    assert all_to_all_seconds(H100, 1e8, 1) == 0.0
    inside = all_to_all_seconds(H100, 1e8, 8)
    across = all_to_all_seconds(H100, 1e8, 16, span=Span(ranks_per_node=8, nodes=2,
                                                          busy_ranks_per_node=8,
                                                          gpus_per_node=8))
    assert 0 < inside < across


def _layer(ep, **kw):
    return layer_cost(QWEN3_30B, kw.pop("profile", H100), micro_batch=1, seq_len=4096, tp=1,
                      sequence_parallel=False, dtype="bf16", ep=ep, **kw)


def test_moe_layer_prices_the_token_exchange_and_small_expert_gemms():
    alone, spread = _layer(1), _layer(8)
    # No exchange without expert parallelism; with it, dispatch and combine each way.
    assert alone.tp_forward_seconds == 0.0 < spread.tp_forward_seconds
    # The same active FLOPs per token as a dense MLP of top_k x expert width...
    dense = dataclasses.replace(QWEN3_30B, moe=None)
    dense_layer = layer_cost(dense, H100, micro_batch=1, seq_len=4096, tp=1,
                             sequence_parallel=False, dtype="bf16")
    assert spread.forward_flops == pytest.approx(dense_layer.forward_flops, rel=0.05)
    # ...but 128 small GEMMs (32 tokens each at ep 1) instead of one large one: slower.
    assert alone.forward_seconds > dense_layer.forward_seconds


def test_load_imbalance_correction_slows_the_experts():
    skewed = dataclasses.replace(H100, corrections={**H100.corrections,
                                                    MOE_IMBALANCE_CORRECTION: 1.5})
    assert _layer(8, profile=skewed).forward_seconds > _layer(8).forward_seconds


def test_training_step_compute_follows_active_parameters():
    par = ParallelConfig(tp=1, dp=8, ep=8, sharding="optimizer", micro_batch_size=1)
    moe = train_step(QWEN3_30B, H100, par, global_batch=64, seq_len=4096)
    dense = train_step(MODEL_PRESETS["qwen2.5-32b"], H100,
                       ParallelConfig(tp=1, dp=8, sharding="optimizer", micro_batch_size=1),
                       global_batch=64, seq_len=4096)
    assert moe.seconds < dense.seconds / 3  # 3.3B active against 32B
    # Memory follows the total: 30B of weights, experts split 8 ways.
    assert moe.memory.params == pytest.approx(
        stage_param_count(QWEN3_30B, tp=1, pp=1, value_head=False, ep=8) * 2)


def test_decode_reads_the_active_experts_at_batch_one_and_all_at_large_batches():
    step = decode_step_model(QWEN3_30B, GenerationConfig(tp=1), "bf16", 8)
    one, large = step.weight_bytes_read(1), step.weight_bytes_read(1024)
    # The input embedding is a lookup, not read whole per step.
    embedding = QWEN3_30B.embedding_params
    assert one == pytest.approx((QWEN3_30B.active_param_count - embedding) * 2, rel=0.02)
    assert large == pytest.approx((QWEN3_30B.param_count - embedding) * 2, rel=0.02)
    assert step.step_seconds(H100, "bf16", 256, 0) > step.step_seconds(H100, "bf16", 1, 0)


@pytest.mark.parametrize(("par", "key"), [
    (ParallelConfig(dp=8, ep=3), "ep"),
    (ParallelConfig(dp=2, ep=4), "ep"),
    (ParallelConfig(dp=8, ep=8, sharding="fsdp"), "ep"),
    (ParallelConfig(dp=8, etp=5), "etp"),
])
def test_expert_layouts_megatron_cannot_form_are_refused(par, key):
    with pytest.raises(SpecError) as info:
        par.check_model(QWEN3_30B, gpus_per_node=8, key="actor")
    assert f"actor.{key}" in str(info.value)


def test_dense_models_refuse_expert_parallelism():
    with pytest.raises(SpecError, match="dense"):
        ParallelConfig(dp=8, ep=2).check_model(MODEL_PRESETS["qwen2.5-7b"], gpus_per_node=8)
    with pytest.raises(SpecError, match=r"parallel\.actor\.ep"):
        job_from_mapping({"algorithm": "grpo",
                          "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b",
                                     "reward": "rule"},
                          "cluster": {"nodes": 1, "gpus_per_node": 8},
                          "workload": {"samples_per_prompt": 4},
                          "parallel": {"actor": {"ep": 2}}})


def _moe_job(**parallel):
    return job_from_mapping({
        "algorithm": "grpo",
        "models": {"actor": "qwen3-30b-a3b", "ref": "qwen3-30b-a3b", "reward": "rule"},
        "cluster": {"nodes": 4, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 512, "samples_per_prompt": 8,
                     "prompt_length": 1024, "response_length": 2048},
        "parallel": parallel})


def test_search_chooses_expert_parallelism_and_honours_a_pin():
    result = Search(_moe_job(), SearchOptions(space=SpaceOptions(backend="megatron"))).run(top_k=3)
    best = result.ranking[0].to_plan(_moe_job())
    assert best.roles["actor"].parallel.ep > 1
    pinned_job = _moe_job(actor={"ep": 2})
    pinned = Search(pinned_job, SearchOptions(space=SpaceOptions(backend="megatron"))).run(top_k=3)
    assert all(c.to_plan(pinned_job).roles["actor"].parallel.ep == 2 for c in pinned.ranking)


def test_flex_dispatch_sends_a_token_once_per_remote_node():
    from simulator.costs.transformer import flex_dispatch_seconds, remote_nodes_per_token

    # 8 experts on 2 nodes, top 2: the other node is missed with C(4,2)/C(8,2) = 6/28.
    assert remote_nodes_per_token(8, 2, 2) == pytest.approx(1 - 6 / 28)
    assert remote_nodes_per_token(128, 8, 1) == 0.0
    span = Span(ranks_per_node=8, nodes=2, busy_ranks_per_node=8, gpus_per_node=8)
    tokens, token_bytes = 4096, 2 * QWEN3_30B.hidden
    flex = flex_dispatch_seconds(H100, QWEN3_30B.moe, tokens=tokens, token_bytes=token_bytes,
                                 group=16, span=span)
    copies = all_to_all_seconds(H100, tokens * QWEN3_30B.moe.top_k * token_bytes, 16,
                                span=span)
    assert 0 < flex < copies  # top 8 of 128: ~1 copy crosses instead of ~4
    par = ParallelConfig(dp=16, ep=16, sharding="optimizer", moe_dispatcher="flex")
    plain = dataclasses.replace(par, moe_dispatcher="alltoall")
    assert train_step(QWEN3_30B, H100, par, global_batch=64, seq_len=4096).seconds < \
        train_step(QWEN3_30B, H100, plain, global_batch=64, seq_len=4096).seconds


def test_expert_parallel_serving_spreads_experts_over_replicas():
    from simulator.costs.generation import generation_weight_bytes

    tp4 = GenerationConfig(tp=4)
    ep32 = GenerationConfig(tp=4, ep=32)
    experts = QWEN3_30B.expert_params() * 2
    assert generation_weight_bytes(QWEN3_30B, tp4, "bf16") - generation_weight_bytes(
        QWEN3_30B, ep32, "bf16") == pytest.approx(experts / 4 - experts / 32)
    plain, spread = (decode_step_model(QWEN3_30B, g, "bf16", 8) for g in (tp4, ep32))
    # The replicas' tokens all reach a GPU's experts: at batch 8 per replica, 64 tokens.
    assert spread.weight_bytes_read(8) < plain.weight_bytes_read(8)
    assert spread.expert_batch_multiplier == 8
    # The exchange across 4 nodes in every MoE layer costs more than the smaller read saves.
    assert spread.step_seconds(H100, "bf16", 64, 0) > plain.step_seconds(H100, "bf16", 64, 0)
    with pytest.raises(SpecError, match="multiple of tp"):
        GenerationConfig(tp=4, ep=6)
    with pytest.raises(SpecError, match="does not divide the 128 experts"):
        GenerationConfig(tp=1, ep=3).check_experts(QWEN3_30B, 3)
    with pytest.raises(SpecError, match="dense"):
        GenerationConfig(tp=1, ep=2).check_experts(MODEL_PRESETS["qwen2.5-7b"], 8)


def test_a_large_moe_job_fits_only_with_experts_spread_wide():
    from planner.planning import plan_job

    job = job_from_mapping({
        "algorithm": "grpo",
        "models": {"actor": "qwen3-235b-a22b", "ref": "qwen3-235b-a22b", "reward": "rule"},
        "cluster": {"nodes": 16, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 256, "samples_per_prompt": 8,
                     "prompt_length": 1024, "response_length": 2048}})
    result = plan_job(job, SearchOptions(space=SpaceOptions(backend="megatron")))
    assert result.best is not None
    actor = result.best.plan.roles["actor"]
    # Each GPU holds the experts of one of ep ranks of one of pp stages: spread over more
    # than a node's GPUs, in training and in serving.
    assert actor.parallel.ep * actor.parallel.pp > 8 and actor.generation.ep > 8


def test_decode_runs_routed_experts_as_small_gemms():
    step = decode_step_model(MODEL_PRESETS["mixtral-8x7b"], GenerationConfig(tp=2), "fp16", 8)
    assert 0 < step.expert_flops_per_token_per_gpu < step.matmul_flops_per_token_per_gpu
    as_dense = dataclasses.replace(step, expert_flops_per_token_per_gpu=0.0)
    a100 = load_profile("a100-80gb")
    # The same FLOPs cut into 8 experts' GEMMs run at a lower fraction of peak once the step
    # is compute-bound (at small batches it reads weights either way).
    assert step.step_seconds(a100, "fp16", 1024, 0) > as_dense.step_seconds(a100, "fp16", 1024, 0)
    assert step.step_seconds(a100, "fp16", 1, 0) == as_dense.step_seconds(a100, "fp16", 1, 0)


def test_expert_optimizer_states_and_gradients_split_over_expert_replicas():
    from simulator.costs.training import optimizer_memory

    # dp 16, ep 16: each expert shard has no replica (expert_dp 1), so its optimizer states
    # stay whole on its GPU; the dense part splits over the 16 replicas.
    par = ParallelConfig(dp=16, ep=16, sharding="optimizer")
    assert par.expert_dp == 1
    memory = optimizer_memory(QWEN3_30B, par, value_head=False, trainable=True, dtype="bf16")
    experts = QWEN3_30B.expert_params() / 16
    dense = QWEN3_30B.param_count - QWEN3_30B.expert_params()
    assert memory.optimizer == pytest.approx((dense / 16 + experts) * 12)  # fp32 master + 2 moments


def test_transition_and_weight_sync_move_every_expert():
    from simulator.costs.transition import transition, weight_tensors
    from simulator.costs.weight_sync import weight_sync

    total = sum(e * n for e, n in weight_tensors(QWEN3_30B).items())
    assert total == pytest.approx(QWEN3_30B.param_count, rel=1e-4)  # norms aside
    train = ParallelConfig(dp=32, ep=8, sharding="optimizer", sequence_parallel=False)
    cost = transition(QWEN3_30B, H100, train, GenerationConfig(tp=2), scheme="micro_dp")
    # Each GPU holds all dense weights and 1/8 of the experts; its tp-2 engine needs half of
    # each expert: it gathers 1/2 - 1/8 of them.
    assert cost.bytes_received_per_gpu == pytest.approx(QWEN3_30B.expert_params() * 2 * 3 / 8)
    assert cost.seconds > 0
    sync = weight_sync(QWEN3_30B, H100, H100, train, rollout_gpus=8, dtype="bf16",
                       crosses_nodes=True, gpus_per_node=8)
    assert sync.bytes_sent == pytest.approx(QWEN3_30B.param_count * 2, rel=1e-4)
