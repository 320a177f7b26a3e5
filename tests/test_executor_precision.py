"""Precision of the torch backend and the memory contract: in the workload's dtype the
executor holds exactly the bytes the simulator's memory model counts for the same layout
(weights, fp32 main gradients, fp32 master weights and Adam moments), and computes
log-probabilities and values in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.costs.training import optimizer_memory
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS
from tests import trainer_workers
from tests.rank_pool import run_ranks


def run(layout: dict, tmp_path: Path) -> list[dict]:
    world = layout["tp"] * layout["dp"]
    out = tmp_path / "result.json"
    run_ranks(trainer_workers.train_and_measure,
              (world, trainer_workers.fresh_rendezvous(tmp_path), layout, str(out)), world)
    return json.loads(out.read_text())


LAYOUTS = {
    # name: (model, tp, dp, sharding, value_head, trainable)
    "actor-fsdp-dp2": ("tiny-2l", 1, 2, "fsdp", False, True),
    "actor-tp2": ("tiny-2l", 2, 1, "none", False, True),
    "critic-tp2xdp2-replicas": ("tiny-2l", 2, 2, "none", True, True),
    "actor-tp2xdp2-fsdp": ("tiny-2l", 2, 2, "fsdp", False, True),
    "reference-fsdp-dp2": ("tiny-2l", 1, 2, "fsdp", False, False),
    "reference-tp2": ("tiny-2l", 2, 1, "none", False, False),
    # GPT-style: tied embeddings (one tensor for embedding and head), biases, LayerNorm,
    # learned positions (replicated under tensor parallelism).
    "gpt-actor-fsdp-dp2": ("tiny-gpt-2l", 1, 2, "fsdp", False, True),
    "gpt-actor-tp2": ("tiny-gpt-2l", 2, 1, "none", False, True),
    # fp32: no master copies, the weights are the optimizer's.
    "fp32-actor-tp2": ("tiny-2l", 2, 1, "none", False, True),
    "fp32-critic-fsdp-dp2": ("tiny-2l", 1, 2, "fsdp", True, True),
    # Hybrid sharding: two groups of two ranks, each group holding one copy.
    "actor-hsdp-dp4-groups-of-2": ("tiny-2l", 1, 4, "fsdp", False, True),
}
FSDP_SIZES = {"actor-hsdp-dp4-groups-of-2": 2}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_executor_state_bytes_are_the_simulators_breakdown(name: str, tmp_path: Path) -> None:
    preset, tp, dp, sharding, value_head, trainable = LAYOUTS[name]
    dtype = "fp32" if name.startswith("fp32") else "bf16"
    fsdp_size = FSDP_SIZES.get(name, 0)
    layout = {"preset": preset, "tp": tp, "dp": dp, "sharding": sharding,
              "value_head": value_head, "trainable": trainable, "dtype": dtype,
              "fsdp_size": fsdp_size}
    ranks = run(layout, tmp_path)
    spec = MODEL_PRESETS[preset]
    par = ParallelConfig(tp=tp, dp=dp, sharding=sharding, sequence_parallel=False,
                         fsdp_size=fsdp_size)
    predicted = optimizer_memory(spec, par, value_head=value_head, trainable=trainable,
                                 dtype=dtype)
    if sharding == "fsdp":
        # The simulator adds the two layers FSDP gathers while computing (not resident).
        working = 2 * spec.params_per_layer / tp * (2 if dtype == "bf16" else 4)
        predicted_params = predicted.params - working
    else:
        predicted_params = predicted.params
    # Per GPU on average over the ranks (FSDP pads a tensor whose first dimension does not
    # split evenly over dp: the value head's single row lives on one rank).
    def mean(stage: str, kind: str) -> float:
        return sum(r[stage][kind] for r in ranks) / len(ranks)

    assert mean("trained", "params") == pytest.approx(predicted_params)
    assert mean("trained", "optimizer") == pytest.approx(predicted.optimizer)
    # FSDP frees its gradients after the step (the simulator counts them while training);
    # the other layouts keep their fp32 main gradients, as Megatron does.
    assert mean("trained", "grads") == pytest.approx(0.0 if sharding == "fsdp"
                                                     else predicted.grads)
    assert mean("built", "params") == pytest.approx(predicted_params)
    for r in ranks:
        assert r["output_dtype"] == "torch.float32"
        if dtype == "fp32":
            assert r["weight_dtypes"] == ["torch.float32"]
        elif not trainable or sharding != "fsdp":
            assert r["weight_dtypes"] == ["torch.bfloat16"]
        else:
            assert r["weight_dtypes"] == ["torch.float32"]  # FSDP2's fp32 shards
        if trainable and not value_head:
            assert r["losses"][1] < r["losses"][0]


def test_hybrid_sharding_trains_as_plain_fsdp(tmp_path: Path) -> None:
    # Groups of two ranks that each hold a copy, their gradient shards all-reduced across the
    # groups, take the same steps as one FSDP group of all four ranks (fp32: only the order
    # of the sums differs).
    base = {"preset": "tiny-2l", "value_head": False, "trainable": True, "dtype": "fp32",
            "sharding": "fsdp", "tp": 1, "dp": 4}
    plain = run(base, tmp_path)
    hybrid = run({**base, "fsdp_size": 2}, tmp_path)
    assert hybrid[0]["trained"]["params"] == pytest.approx(2 * plain[0]["trained"]["params"])
    for a, b in zip(plain, hybrid, strict=True):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
        assert [x for row in b["inferred"] for x in row] == pytest.approx(
            [x for row in a["inferred"] for x in row], rel=1e-4, abs=1e-5)


def test_bf16_layouts_agree_with_one_gpu(tmp_path: Path) -> None:
    # The vocabulary-parallel log-softmax and bf16 weights: a tp2 layout computes one GPU's
    # log-probs to bf16 accuracy, and both learn.
    base = {"preset": "tiny-2l", "value_head": False, "trainable": True, "dtype": "bf16",
            "sharding": "none"}
    one = run({**base, "tp": 1, "dp": 1}, tmp_path)[0]
    two = run({**base, "tp": 2, "dp": 1}, tmp_path)[0]
    flat_one = [x for row in one["inferred"] for x in row]
    flat_two = [x for row in two["inferred"] for x in row]
    assert max(abs(a - b) for a, b in zip(flat_one, flat_two, strict=True)) < 0.05
    assert two["losses"] == pytest.approx(one["losses"], rel=0.02)


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_offloading_training_states_around_generation_changes_nothing(
        sharding: str, tmp_path: Path) -> None:
    # On this CPU the host is the device, so the move itself is not observable; what is: the
    # bytes offloaded are the optimizer states and gradients, and training after the round
    # trip is bit for bit the training without it.
    base = {"preset": "tiny-2l", "value_head": False, "trainable": True, "dtype": "bf16",
            "sharding": sharding, "tp": 1, "dp": 2}
    plain = run(base, tmp_path)
    offloaded = run({**base, "offload": True}, tmp_path)
    for a, b in zip(plain, offloaded, strict=True):
        assert a["losses"] == b["losses"]
        assert b["offloaded"]["moved"] == b["offloaded"]["expected"] > 0
