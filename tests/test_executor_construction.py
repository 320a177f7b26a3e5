"""How the torch backend builds a role: modules on the meta device, sharded, then only the
rank's shards allocated and filled from one whole tensor at a time (seeded, or read from a
local Hugging Face checkpoint); and the CLI's per-role checkpoints, checked before any
worker starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from executor.model import build_model
from simulator.costs.training import optimizer_memory
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS
from tests import trainer_workers
from tests.rank_pool import run_ranks


def write_checkpoint(directory: Path, preset: str, seed: int) -> Path:
    """A Hugging Face-named safetensors checkpoint of ``preset`` in two files."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in build_model(MODEL_PRESETS[preset], seed=seed)
             .state_dict().items() if k != "lm_head.weight" or
             not MODEL_PRESETS[preset].tied_embeddings}
    names = sorted(state)
    save_file({k: state[k] for k in names[:len(names) // 2]},
              str(directory / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[len(names) // 2:]},
              str(directory / "model-00002-of-00002.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


@pytest.mark.parametrize(("preset", "tp", "dp", "sharding"), [
    ("tiny-2l", 2, 1, "none"), ("tiny-2l", 1, 2, "fsdp"), ("tiny-2l", 2, 2, "fsdp"),
    ("tiny-gpt-2l", 2, 1, "none")])
def test_ranks_build_on_meta_and_load_only_their_shards(preset: str, tp: int, dp: int,
                                                        sharding: str, tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt", preset, seed=7)
    layout = {"preset": preset, "tp": tp, "dp": dp, "sharding": sharding,
              "checkpoint": str(checkpoint)}
    out = tmp_path / "result.json"
    run_ranks(trainer_workers.build_and_report,
              (tp * dp, trainer_workers.fresh_rendezvous(tmp_path), layout, str(out)), tp * dp)
    ranks = json.loads(out.read_text())
    spec = MODEL_PRESETS[preset]
    predicted = optimizer_memory(spec, ParallelConfig(tp=tp, dp=dp, sharding=sharding,
                                                      sequence_parallel=False),
                                 value_head=False, trainable=False, dtype="fp32")
    working = 2 * spec.params_per_layer / tp * 4 if sharding == "fsdp" else 0.0
    for rank in ranks:
        assert set(rank["created_on"]) == {"meta"}  # no module was built with real weights
        assert rank["most_whole_tensors_alive"] == 1  # one whole tensor at a time
        assert max(rank["errors"].values()) == 0.0  # the checkpoint's values, in place
    mean_params = sum(r["state"]["params"] for r in ranks) / len(ranks)
    assert mean_params == pytest.approx(predicted.params - working)  # shards only


def test_seeded_initial_weights_do_not_depend_on_the_layout(tmp_path: Path) -> None:
    layout = {"preset": "tiny-2l", "tp": 2, "dp": 1, "sharding": "none"}
    out = tmp_path / "result.json"
    run_ranks(trainer_workers.build_and_report,
              (2, trainer_workers.fresh_rendezvous(tmp_path), layout, str(out)), 2)
    assert all(max(r["errors"].values()) == 0.0 for r in json.loads(out.read_text()))


def _execute(args: list[str]) -> subprocess.CompletedProcess:
    """``hybridflow execute ARGS`` in this process (as ``python -m planner`` runs it): a
    refused run never reaches Ray, and a child process per case only added its start-up."""
    from tests.test_cli import run

    return run("execute", *args)


def test_cli_checkpoints_are_checked_before_any_worker_starts(
        grpo_two_gpu_files: tuple[Path, Path], tmp_path: Path) -> None:
    plan, job = grpo_two_gpu_files
    other_style = write_checkpoint(tmp_path / "gpt", "tiny-gpt-2l", seed=0)
    wider = write_checkpoint(tmp_path / "wider", "tiny-2l-hd32", seed=0)
    cases = [
        (["--checkpoint", "critic=" + str(tmp_path)], "--checkpoint critic",
         "not a model of this job"),
        (["--checkpoint", "actor=" + str(tmp_path / "missing")], "--checkpoint actor",
         "is not a directory"),
        (["--checkpoint", "actor=" + str(tmp_path)], "--checkpoint actor",
         "no *.safetensors files"),
        (["--checkpoint", "actor=" + str(other_style)], "--checkpoint actor",
         "lacks model.layers.0.mlp.gate_proj.weight"),
        (["--checkpoint", "actor=" + str(wider)], "--checkpoint actor",
         "the model expects"),
        (["--checkpoint", "actor"], "--checkpoint", "expected ROLE=DIR"),
    ]
    for extra, key, problem in cases:
        result = _execute([str(plan), "--config", str(job), "--steps", "1",
                           "--out", str(tmp_path / "run"), *extra])
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and problem in lines[0], result.stderr
        assert "Traceback" not in result.stderr
