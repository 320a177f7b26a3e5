"""Megatron context parallelism (cp; verl's and Megatron's context_parallel_size): a sequence's
tokens are split over cp ranks, which pass keys and values around a ring in every attention
layer, hidden behind attention where it is long enough."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner.space import SpaceOptions, role_configs
from profiles.datafile import SpecError
from profiles.device import load_profile
from simulator.costs.context_parallel import context_parallel_seconds, ring_step_bytes
from simulator.costs.primitives import p2p_seconds
from simulator.costs.training import train_step
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

H100 = load_profile("h100-80gb")
MODEL = MODEL_PRESETS["qwen2.5-7b"]


def megatron(cp: int, **extra) -> ParallelConfig:
    return ParallelConfig(tp=2, dp=8, cp=cp, sharding="optimizer", recompute="none",
                          **extra)


def test_the_ring_is_hidden_behind_long_attention_and_exposed_behind_short() -> None:
    step = p2p_seconds(H100, ring_step_bytes(MODEL, tokens=8192, tp=2, dtype="bf16"), False)
    assert step > 0
    long_attention = context_parallel_seconds(
        MODEL, H100, tokens=8192, tp=2, cp=4, dtype="bf16", attention_seconds=10 * 4 * step,
        crosses_nodes=False, gpus_per_node=8, busy_ranks_per_node=8)
    assert long_attention == (0.0, 0.0)
    no_attention = context_parallel_seconds(
        MODEL, H100, tokens=8192, tp=2, cp=4, dtype="bf16", attention_seconds=0.0,
        crosses_nodes=False, gpus_per_node=8, busy_ranks_per_node=8)
    assert no_attention == pytest.approx((3 * step, 3 * 2 * step))


def test_a_rank_holds_one_cp_th_of_each_sequence() -> None:
    # 32k-token sequences, two per data shard: cp 4 gives each rank a quarter of the tokens,
    # so a quarter of the activations, and the gradients reduce over all dp ranks.
    one = train_step(MODEL, H100, megatron(1, micro_batch_size=1), global_batch=16,
                     seq_len=32768)
    four = train_step(MODEL, H100, megatron(4, micro_batch_size=1), global_batch=4,
                      seq_len=32768)
    assert four.memory.activations < 0.3 * one.memory.activations
    assert four.memory.params == one.memory.params
    assert four.micro_batches == one.micro_batches == 2
    assert four.breakdown["dp_comm"] == pytest.approx(one.breakdown["dp_comm"])
    assert four.breakdown["tp_comm"] > 0.25 * one.breakdown["tp_comm"]  # the ring adds


def test_openrlhfs_ring_attention_all_gathers_every_layer_unhidden() -> None:
    from simulator.costs.context_parallel import (
        KV_HEADS_PER_GATHER,
        all_gather_kv_seconds,
        busiest_attention_share,
    )
    from simulator.costs.primitives import all_gather_seconds, reduce_scatter_seconds

    # Contiguous slices of one sequence: the slice at its end attends to all of it.
    assert busiest_attention_share(1, 4) == pytest.approx(1.75)
    assert busiest_attention_share(2, 4) == pytest.approx(1.5)
    assert busiest_attention_share(8, 4) == 1.0 and busiest_attention_share(1, 1) == 1.0
    # One KV head per call: qwen2.5-7b has 4 KV heads, 2 per rank under tp 2.
    forward, backward = all_gather_kv_seconds(
        MODEL, H100, tokens=4096, tp=2, cp=4, dtype="bf16", attention_seconds=0.0,
        sequences_per_micro_batch=8, crosses_nodes=False)
    head_bytes = 4 * 4096 * MODEL.kv_size / MODEL.kv_heads * KV_HEADS_PER_GATHER * 2
    gather = all_gather_seconds(H100, head_bytes, 4)
    assert forward == pytest.approx(2 * 2 * gather)  # 2 calls x (keys, values)
    assert backward == pytest.approx(2 * 2 * (gather + reduce_scatter_seconds(H100,
                                                                              head_bytes, 4)))
    # Nothing hides it, and one sequence per micro-batch adds the busiest slice's attention.
    uneven, _ = all_gather_kv_seconds(
        MODEL, H100, tokens=4096, tp=2, cp=4, dtype="bf16", attention_seconds=1.0,
        sequences_per_micro_batch=1, crosses_nodes=False)
    assert uneven == pytest.approx(forward + 0.75)


def test_a_zero3_layout_takes_ring_attention_but_not_with_hybrid_sharding() -> None:
    assert ParallelConfig(dp=8, cp=4, sharding="fsdp").data_shards == 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"dp": 8, "cp": 3}, "must divide dp=8"),
    ({"dp": 8, "cp": 2, "sharding": "fsdp", "fsdp_size": 4}, "hybrid sharding"),
    ({"dp": 8, "cp": 2, "ulysses": 2}, "one kind of sequence parallelism"),
])
def test_impossible_layouts_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        ParallelConfig(**fields)
    assert info.value.key == "cp"


SUMS = Path(__file__).resolve().parents[1] / "planner" / "examples" / "your-data" / "sums.py"


def long_job(prompt: int = 2048, response: int = 30720, **pins):
    return job_from_mapping({
        "name": "long", "algorithm": "grpo", "framework": "verl",
        "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b", "reward": "rule"},
        "reward_function": {"path": str(SUMS)},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 32, "samples_per_prompt": 8,
                     "prompt_length": prompt, "response_length": response},
        **({"parallel": {"actor": pins}} if pins else {})})


def sizes(configs) -> set[int]:
    return {c.parallel.cp for c in configs}


def test_verls_megatron_engine_searches_cp_for_long_sequences_only() -> None:
    options = SpaceOptions(micro_batches=(1,), backend="megatron")
    assert sizes(role_configs(long_job(), "actor", 16, options)) == {1, 2, 4, 8}
    assert sizes(role_configs(long_job(512, 1024), "actor", 16, options)) == {1}
    # FSDP layouts never take cp (verl's FSDP engine has Ulysses instead).
    fsdp = role_configs(long_job(), "actor", 16, SpaceOptions(micro_batches=(1,),
                                                               backend="fsdp"))
    assert sizes(fsdp) == {1}
    pinned = long_job(cp=2)
    assert sizes(role_configs(pinned, "actor", 16, options)) == {2}


def test_frameworks_without_megatrons_ring_say_so_when_translating() -> None:
    from planner.export import Translation, export_files
    from simulator.plan import ColocatedSet, Plan, RolePlan
    from simulator.specs.parallel import GenerationConfig

    ring = ParallelConfig(tp=1, dp=16, cp=2, sharding="optimizer", sequence_parallel=False)
    plan = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=16),),
                roles={"actor": RolePlan(parallel=ring, generation=GenerationConfig(tp=1)),
                       "ref": RolePlan(parallel=replace(ring, sharding="none"))})
    # OpenRLHF splits sequences too, with all-gathers instead of the ring the price assumed.
    translation = Translation(target="openrlhf", exact=False)
    files = export_files(plan, long_job(), "openrlhf", translation=translation)
    assert "--ds.ring_attn_size=2" in files["openrlhf_args.txt"].splitlines()
    assert [n for n in translation.notes
            if n.startswith("roles.actor.parallel.cp") and "all-gathers" in n]
    # NeMo-RL's Megatron policy writes it.
    files = export_files(plan, long_job(), "nemo-rl",
                         translation=Translation(target="nemo-rl", exact=False))
    assert "policy.megatron_cfg.context_parallel_size=2" in files["nemo_rl_overrides.txt"]
