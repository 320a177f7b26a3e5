"""Hybrid sharding (HSDP: FSDP in groups of ranks, each group one copy; verl's fsdp_size) is
priced as its mechanisms: states split over the group, per-layer gathers and reduce-scatters
inside it, and each layer's gradient shard all-reduced across the groups."""

from __future__ import annotations

import pytest

from planner.space import SpaceOptions, role_configs
from profiles.datafile import SpecError
from profiles.device import load_profile
from simulator.costs.inference import forward_pass
from simulator.costs.primitives import all_reduce_seconds
from simulator.costs.training import (
    MAIN_GRAD_BYTES,
    fsdp_replica_span,
    optimizer_memory,
    train_step,
)
from simulator.costs.transition import transition
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

H100 = load_profile("h100-80gb")
MODEL = MODEL_PRESETS["qwen2.5-7b"]


def fsdp(dp: int, group: int = 0, **extra) -> ParallelConfig:
    return ParallelConfig(tp=1, dp=dp, sharding="fsdp", sequence_parallel=False,
                          fsdp_size=group, **extra)


def test_states_are_split_over_the_group_not_every_rank() -> None:
    hybrid = optimizer_memory(MODEL, fsdp(32, 8), value_head=False, trainable=True,
                              dtype="bf16")
    one_group = optimizer_memory(MODEL, fsdp(8), value_head=False, trainable=True,
                                 dtype="bf16")
    every_rank = optimizer_memory(MODEL, fsdp(32), value_head=False, trainable=True,
                                  dtype="bf16")
    assert hybrid == one_group
    assert hybrid.total > every_rank.total
    assert fsdp(32, 8).weight_shards == 8 and fsdp(32, 8).fsdp_replicas == 4


def test_a_step_adds_the_cross_group_all_reduce_of_each_layers_gradient_shard() -> None:
    # Four groups of eight ranks (a node each) take four times one group's batch: each rank
    # computes, gathers and reduce-scatters exactly what one group alone would, and in
    # addition all-reduces each layer's gradient shard with its three peers in the other
    # nodes (no overlap here, so the costs add).
    alone = train_step(MODEL, H100, fsdp(8, overlap_param_gather=False), global_batch=64,
                       seq_len=2048)
    hybrid = train_step(MODEL, H100, fsdp(32, 8, overlap_param_gather=False),
                        global_batch=256, seq_len=2048)
    shard = MODEL.params_per_layer * MAIN_GRAD_BYTES / 8
    per_layer = all_reduce_seconds(H100, shard, 4, span=fsdp_replica_span(fsdp(32, 8), 8),
                                   correction="train_collective")
    assert per_layer > 0
    added = hybrid.breakdown["fsdp_comm_exposed"] - alone.breakdown["fsdp_comm_exposed"]
    assert added == pytest.approx(hybrid.micro_batches * MODEL.layers * per_layer)
    assert hybrid.memory == alone.memory


def test_gathers_stay_inside_the_group() -> None:
    # Forward passes and the transition to the rollout engine gather each tensor over the
    # group that shares one copy: as one node's FSDP, not as all 32 ranks'.
    for_group = forward_pass(MODEL, H100, fsdp(8), sequences=64, seq_len=2048,
                             micro_batch=2)
    hybrid = forward_pass(MODEL, H100, fsdp(32, 8), sequences=256, seq_len=2048,
                          micro_batch=2)
    every_rank = forward_pass(MODEL, H100, fsdp(32), sequences=256, seq_len=2048,
                              micro_batch=2)
    assert hybrid.seconds == pytest.approx(for_group.seconds)
    assert hybrid.seconds < every_rank.seconds
    gen = GenerationConfig(tp=1)
    switch = transition(MODEL, H100, fsdp(32, 8), gen, scheme="all_gpus")
    assert switch.seconds == pytest.approx(
        transition(MODEL, H100, fsdp(8), gen, scheme="all_gpus").seconds)
    assert switch.group_size == 8


@pytest.mark.parametrize(("fields", "message"), [
    ({"dp": 32, "fsdp_size": 8}, "need sharding: fsdp"),
    ({"dp": 32, "sharding": "fsdp", "fsdp_size": 6}, "must divide dp=32"),
    ({"dp": 32, "sharding": "fsdp", "fsdp_size": 1}, "shards nothing"),
])
def test_impossible_groups_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        ParallelConfig(**fields)
    assert info.value.key == "fsdp_size"


def job(framework: str, nodes: int, parallel: dict | None = None):
    data = {"name": "hsdp", "algorithm": "grpo", "framework": framework,
            "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b", "reward": "rule"},
            "cluster": {"nodes": nodes, "gpus_per_node": 8, "device": "h100-80gb"},
            "workload": {"prompts_per_iteration": 512, "samples_per_prompt": 8,
                         "prompt_length": 1024, "response_length": 1024}}
    if parallel:
        data["parallel"] = parallel
    return job_from_mapping(data)


def groups(configs) -> set[int]:
    return {c.parallel.fsdp_size for c in configs if c.parallel.sharding == "fsdp"}


def test_verls_space_has_groups_of_a_node() -> None:
    options = SpaceOptions(micro_batches=(1,))
    assert groups(role_configs(job("verl", 8), "actor", 64, options)) == {0, 8}
    # One node: nothing to split.
    assert groups(role_configs(job("verl", 1), "actor", 8, options)) == {0}
    # A pin is the only size tried.
    pinned = job("verl", 8, {"actor": {"fsdp_size": 16}})
    assert groups(role_configs(pinned, "actor", 64, options)) == {16}
    # OpenRLHF's DeepSpeed ZeRO has no hybrid sharding.
    assert groups(role_configs(job("openrlhf", 8), "actor", 64, options)) <= {0}


def test_a_pin_that_is_not_fsdp_is_refused_by_name() -> None:
    with pytest.raises(SpecError, match="belong to FSDP") as info:
        job("verl", 8, {"actor": {"sharding": "optimizer", "fsdp_size": 8}})
    assert info.value.key.endswith("actor.fsdp_size")
