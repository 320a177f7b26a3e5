"""The Megatron-core backend on this CPU machine, through the test-only shims of
tests/compat/megatron_cpu.py (megatron-core 0.16.1). Every layout starts from the same
Hugging Face-named weights of the torch model."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.engines import megatron_workers
from tests.rank_pool import run_ranks

LOG_PROB_TOLERANCE = 1e-5
"""fp32: the layouts reduce in different orders (seen: 5e-7)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("preset", "tp", "pp"), [
    ("tiny-4l", 1, 1), ("tiny-4l", 2, 1), ("tiny-4l", 1, 2), ("tiny-4l", 2, 2),
    # GPT-style: LayerNorm, GELU, biases, learned positions.
    ("tiny-gpt-2l", 1, 1), ("tiny-gpt-2l", 2, 2)])
def test_layouts_compute_the_torch_models_log_probs_and_export_its_weights(
        preset: str, tp: int, pp: int, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_ranks(megatron_workers.log_probs_and_round_trip,
              (tp * pp, free_port(), tp, pp, str(out), preset), tp * pp)
    result = json.loads(out.read_text())
    assert result["max_log_prob_error"] < LOG_PROB_TOLERANCE
    assert result["round_trip_exact"] and result["missing"] == []


@pytest.mark.parametrize(("tp", "pp", "value_head"), [(2, 2, False), (2, 1, True)])
def test_left_padded_prompts_compute_what_the_torch_model_computes_with_its_mask(
        tp: int, pp: int, value_head: bool, tmp_path: Path) -> None:
    """Issue 31 defect 3: jobs with prompt data (left-padded prompts) run on Megatron, whose
    schedule moves each row's pads to its end; every position that predicts a real token
    matches the torch model under its padding mask."""
    out = tmp_path / "result.json"
    run_ranks(megatron_workers.left_padded_log_probs,
              (tp * pp, free_port(), tp, pp, str(out), value_head), tp * pp)
    result = json.loads(out.read_text())
    assert result["shape_equal"] and result["pads_zero"]
    assert result["max_error"] < LOG_PROB_TOLERANCE


TRAINING_LAYOUTS = {
    "tp2": (2, 1, 1, "none", 2), "pp2": (1, 2, 1, "none", 2), "tp2xpp2": (2, 2, 1, "none", 4),
    "dp2-distributed-optimizer": (1, 1, 1, "optimizer", 2), "pp2-vpp2": (1, 2, 2, "none", 2),
    "tp2-sequence-parallel": (2, 1, 1, "none", 2, True),
    "tp2xpp2-sequence-parallel": (2, 2, 1, "none", 4, True),
    # Activation recompute (issue 31 defect 3): the same losses, the memory traded for time.
    "tp2-recompute-full": (2, 1, 1, "none", 2, False, "full"),
    "pp2-recompute-none": (1, 2, 1, "none", 2, False, "none"),
}
RECOMPUTE_SETTINGS = {
    "selective": ["selective", None, ["core_attn"]],
    "full": ["full", "uniform", ["core_attn"]],
    "none": [None, None, ["core_attn"]],
}
"""Megatron's (recompute_granularity, recompute_method, recompute_modules) per plan setting
(recompute_modules defaults to core_attn and is read only when the granularity is
selective)."""
LOSS_TOLERANCE = 1e-4
"""fp32 losses of 3 Adam steps at lr 1e-3: the layouts reduce in different orders, and Adam's
first steps (update ~ sign of the gradient) amplify those last-bit differences (seen: 3e-5)."""


def train(tmp_path: Path, tp: int, pp: int, vpp: int, sharding: str, world: int,
          sequence_parallel: bool = False, recompute: str = "selective") -> dict:
    out = tmp_path / (f"tp{tp}-pp{pp}-vpp{vpp}-{sharding}-{world}-{sequence_parallel}-"
                      f"{recompute}.json")
    run_ranks(megatron_workers.training_losses,
              (world, free_port(), tp, pp, vpp, sharding, str(out), sequence_parallel,
               recompute), world)
    import torch

    result = json.loads(out.read_text())
    result["weights"] = torch.load(str(out) + ".pt")
    result["recompute"] = json.loads(Path(str(out) + ".recompute").read_text())
    assert result["recompute"] == RECOMPUTE_SETTINGS[recompute]
    return result


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return train(tmp_path_factory.mktemp("tp1"), 1, 1, 1, "none", 1)


@pytest.mark.parametrize("layout", list(TRAINING_LAYOUTS))
def test_training_layouts_give_the_losses_of_one_gpu(layout: str, single: dict,
                                                     tmp_path: Path) -> None:
    import torch

    result = train(tmp_path, *TRAINING_LAYOUTS[layout])
    assert result["losses"] == pytest.approx(single["losses"], abs=LOSS_TOLERANCE)
    assert single["losses"][-1] < single["losses"][0]  # it learns
    # Megatron counts tensor-parallel duplicates and shards once in the gradient norm.
    assert result["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    for name, tensor in single["weights"].items():
        assert torch.allclose(result["weights"][name], tensor, atol=1e-4), name


def test_the_last_stages_result_is_broadcast_from_a_device_buffer(monkeypatch) -> None:
    """Issue 31 defect 3: with pp > 1 every other stage receives the last stage's log-probs
    into a buffer on the worker's device (NCCL sends GPU tensors only), in fp32 on both sides;
    it was a CPU tensor."""
    import types

    import torch
    from megatron.core import parallel_state as ps

    import executor.device as device
    from executor.backends.megatron import MegatronTrainer

    sent = []
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: "pp-group")
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_last_rank", lambda: 1)
    monkeypatch.setattr(device, "worker_device", lambda: torch.device("meta"))
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda t, src, group: sent.append((t.device.type, t.dtype, src, group)))
    owner = types.SimpleNamespace(par=types.SimpleNamespace(pp=2))
    received = MegatronTrainer._broadcast_from_last_stage(owner, None, (3, 5))
    assert received.shape == (3, 5)
    assert sent == [("meta", torch.float32, 1, "pp-group")]
