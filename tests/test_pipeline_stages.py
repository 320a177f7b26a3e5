"""Pipeline stages of unequal layer counts (DeepSeek-V3's 61 layers, Qwen3-235B's 94): the
heaviest stage paces the pipeline and sets its memory, interleaving still needs equal chunks,
the search offers such sizes and the verl export writes Megatron's first/last stage sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from planner.space import SpaceOptions, pipeline_sizes, role_configs
from profiles.datafile import SpecError
from profiles.device import load_profile
from simulator.costs.training import train_step
from simulator.costs.transformer import stage_param_count
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import (
    GenerationConfig,
    ParallelConfig,
    outer_stage_layers,
    stage_layers,
)
from simulator.specs.presets import MODEL_PRESETS

H100 = load_profile("h100-80gb")
LLAMA = MODEL_PRESETS["llama3-8b"]  # 32 layers


def test_the_heaviest_stage_holds_the_rounded_up_share():
    assert stage_layers(61, 8) == 8 and stage_layers(64, 8) == 8 and stage_layers(94, 16) == 6
    # Megatron's first/last stage sizes around middle stages of 8: 8 + 6 x 8 + 5 = 61.
    assert outer_stage_layers(61, 8) == (8, 5)
    assert outer_stage_layers(64, 8) is None       # even
    assert outer_stage_layers(61, 32) is None      # 30 middle stages of 2 leave 1 layer


def test_an_uneven_stage_costs_what_the_heaviest_stage_costs():
    def step(layers, pp):
        model = dataclasses.replace(LLAMA, layers=layers)
        par = ParallelConfig(tp=1, pp=pp, dp=8, sharding="optimizer", micro_batch_size=1)
        return train_step(model, H100, par, global_batch=256, seq_len=2048)

    # 30 layers on 4 stages run at the pace of 8-layer stages: as 32 layers do, more slowly
    # than 28 (7 per stage).
    uneven, even_up, even_down = step(30, 4), step(32, 4), step(28, 4)
    assert uneven.seconds == pytest.approx(even_up.seconds, rel=0.02)
    assert uneven.seconds > even_down.seconds
    # Memory: the heaviest stage's parameters.
    assert stage_param_count(dataclasses.replace(LLAMA, layers=30), tp=1, pp=4,
                             value_head=False) == stage_param_count(LLAMA, tp=1, pp=4,
                                                                    value_head=False)


@pytest.mark.parametrize(("par", "key", "message"), [
    (dict(pp=62), "actor.pp", "more stages than the 61 layers"),
    (dict(pp=8, vpp=2), "actor.vpp", "interleaved stages hold equal chunks"),
])
def test_impossible_stage_counts_are_refused(par, key, message):
    config = ParallelConfig(tp=8, dp=1, **par)
    with pytest.raises(SpecError, match=message) as info:
        config.check_model(MODEL_PRESETS["deepseek-v3"], gpus_per_node=8, key="actor")
    assert key in str(info.value)


def test_uneven_stages_are_accepted_in_pins_and_generation():
    ParallelConfig(tp=8, pp=8, dp=1, ep=8).check_model(MODEL_PRESETS["deepseek-v3"],
                                                       gpus_per_node=8)
    GenerationConfig(tp=8, pp=4).check_shape(MODEL_PRESETS["deepseek-v3"], gpus_per_node=8)
    data = {
        "algorithm": "grpo", "models": {"actor": "qwen3-235b-a22b", "ref": "qwen3-235b-a22b",
                                        "reward": "rule"},
        "cluster": {"nodes": 8, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 8,
                     "prompt_length": 256, "response_length": 512},
        "parallel": {"actor": {"pp": 8, "generation_pp": 2}}}
    assert job_from_mapping(data).parallel["actor"].pp == 8
    with pytest.raises(SpecError, match="generation_pp=95 is more stages") as info:
        job_from_mapping({**data, "parallel": {"actor": {"generation_pp": 95}}})
    assert "parallel.actor.generation_pp" in str(info.value)


def test_uneven_pipelines_where_the_framework_cuts_them():
    # 32 stages of 61 layers would leave Megatron's first or last stage empty.
    assert pipeline_sizes(61) == [1, 2, 4, 8, 16, 61]
    assert pipeline_sizes(32) == [1, 2, 4, 8, 16, 32]
    job = job_from_mapping({
        "algorithm": "grpo", "models": {"actor": "deepseek-v3", "ref": "deepseek-v3",
                                        "reward": "rule"},
        "cluster": {"nodes": 64, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 8,
                     "prompt_length": 256, "response_length": 512}})
    simulated = {c.parallel.pp for c in role_configs(
        job, "actor", 512, SpaceOptions(backend="simulated"))}
    assert {8, 16} <= simulated
    # verl's Megatron engine takes Megatron's first/last stage sizes; the executor's Megatron
    # path cuts equal stages only.
    verl = {c.parallel.pp for c in role_configs(
        job, "actor", 512, SpaceOptions(backend="megatron"))}
    assert {8, 16} <= verl
    executable = {c.parallel.pp for c in role_configs(
        replace(job, framework="hybridflow"), "actor", 512, SpaceOptions(backend="megatron"))}
    assert executable <= {1, 61}
