"""``hybridflow execute`` end to end with the Megatron-core backend on virtual GPUs (CPU shims
of tests/compat/megatron_cpu.py passed with ``--worker-setup``): PPO with Megatron training
for actor and critic and vLLM generation, and a pp = 2 plan with the distributed optimizer.
Each run is checked against the same iterations on the torch backend: both import the same
initial weights and see the same prompts, so their metrics agree to fp32 reduction order.
The runs are ``hybridflow execute`` in this process, on the test process's one Ray (``local_ray``,
tests/conftest.py: four virtual GPUs, the largest plan here is pp 2 x dp 2)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.test_cli import run as hybridflow

pytestmark = pytest.mark.usefixtures("local_ray")
SETUP = "tests.compat.megatron_cpu:install"
METRIC_TOLERANCE = 1e-4
"""Relative: fp32 metrics after two PPO iterations of updates at lr 1e-2 (seen: 2e-6 on
grad norms and value losses)."""
METRIC_ABSOLUTE = 1e-5
"""Absolute, for metrics near zero: the policy loss is a mean of nearly cancelling terms
(seen: 1.2e-6 apart on a loss of 6e-3 after pipeline stages reorder the sums)."""
COMPARED = ("actor_policy_loss", "actor_grad_norm", "actor_clip_fraction", "critic_value_loss",
            "critic_grad_norm", "response_tokens")


def _job(tmp_path: Path, gpus: int, backends: dict, model: str = "tiny-2l-hd32",
         dtype: str = "fp32") -> Path:
    """A PPO job; fp32 by default, so that two backends agree to reduction order."""
    job = tmp_path / f"job-{len(list(tmp_path.iterdir()))}.json"
    job.write_text(json.dumps({
        "algorithm": "ppo", "models": {"actor": model, "critic": model, "ref": model,
                                       "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": gpus}, "backends": backends,
        "workload": {"prompts_per_iteration": 8, "prompt_length": 5, "response_length": 5,
                     "mini_batches_per_epoch": 2, "train_micro_batch_size": 1,
                     "infer_micro_batch_size": 4, "dtype": dtype}}))
    return job


def _plan(tmp_path: Path, gpus: int, roles: dict) -> Path:
    plan = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
    plan.write_text(json.dumps({
        "format": "hybridflow-plan", "version": 1, "algorithm": "ppo",
        "sets": [{"roles": ["actor", "critic", "ref"], "gpus": gpus, "first_gpu": 0}],
        "roles": roles}))
    return plan


def _execute(plan: Path, job: Path, out: Path, setup: bool) -> list[dict]:
    command = ["execute", str(plan), "--config", str(job), "--steps", "2", "--out", str(out),
               "--reward-warmup", "0"]
    if setup:
        command += ["--worker-setup", SETUP]
    result = hybridflow(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _backends(out: Path) -> dict[str, str]:
    with open(out / "measurements.csv") as f:
        return {row["node"]: row["backend"] for row in csv.DictReader(f)}


def _same_metrics(got: list[dict], expected: list[dict]) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        for key in COMPARED:
            assert float(mine[key]) == pytest.approx(float(theirs[key]), rel=METRIC_TOLERANCE,
                                                     abs=METRIC_ABSOLUTE), key


def _layout(**parallel: object) -> dict:
    return {"sequence_parallel": False, "micro_batch_size": 1, **parallel}


@pytest.mark.parametrize(("generation", "model", "sequence_parallel"), [
    ("vllm", "tiny-2l-hd32", (False,)), ("native", "tiny-2l-hd32", (False, True)),
    ("native", "tiny-gpt-2l", (False,))])
def test_ppo_with_megatron_training_matches_the_torch_backend(
        generation: str, model: str, sequence_parallel: tuple[bool, ...],
        tmp_path: Path) -> None:
    """tp 2, generation tp 2: vLLM takes whole tensors; the native generator each rank's own
    shard (micro-DP groups of one rank). tiny-gpt-2l is GPT-style (LayerNorm, GELU, biases,
    learned positions). With sequence parallelism (Megatron only) the 11-token sequences are
    padded to 12 for the two ranks, values and log-probs cut back. The torch run is the
    reference of every Megatron run of its row (with and without sequence parallelism)."""
    par = _layout(tp=2, dp=1, sharding="none")
    roles = {"actor": {"parallel": par, "generation": {"tp": 2}},
             "critic": {"parallel": par}, "ref": {"parallel": par}}
    reference = _execute(_plan(tmp_path, 2, roles),
                         _job(tmp_path, 2, {"actor": {"generation": generation}}, model),
                         tmp_path / "torch", False)
    for sp in sequence_parallel:
        megatron_par = {**par, "sequence_parallel": sp}
        out = tmp_path / f"megatron-sp-{sp}"
        megatron = _execute(
            _plan(tmp_path, 2, {r: {**v, "parallel": megatron_par,
                                    "training_backend": "megatron"}
                                for r, v in roles.items()}),
            _job(tmp_path, 2, {"actor": {"training": "megatron", "generation": generation},
                               "critic": {"training": "megatron"}}, model), out, True)
        _same_metrics(megatron, reference)
        backend = _backends(out)
        assert backend["actor.generate"] == generation, sp
        assert backend["actor.train"] == backend["critic.train"] == "megatron", sp


def test_pipeline_plan_with_the_distributed_optimizer_matches_the_torch_backend(
        tmp_path: Path) -> None:
    """pp 2 x dp 2, distributed optimizer with Megatron's overlap defaults, generation tp 1
    (each micro-DP group gathers both pipeline stages) against torch tp 2 x dp 2 replicas: the
    same data-parallel split, so the same updates."""
    pipeline = {"actor": {"parallel": _layout(pp=2, tp=1, dp=2, sharding="optimizer"),
                          "generation": {"tp": 1}},
                "critic": {"parallel": _layout(pp=2, tp=1, dp=2, sharding="optimizer")},
                "ref": {"parallel": _layout(pp=2, tp=1, dp=2, sharding="none")}}
    replicas = {role: {**value, "parallel": _layout(tp=2, dp=2, sharding="none")}
                for role, value in pipeline.items()}
    got = _execute(_plan(tmp_path, 4, pipeline), _job(tmp_path, 4, {}), tmp_path / "pp", True)
    expected = _execute(_plan(tmp_path, 4, replicas), _job(tmp_path, 4, {}),
                        tmp_path / "replicas", False)
    _same_metrics(got, expected)
    assert _backends(tmp_path / "pp")["actor.train"] == "megatron"  # named by the plan
    # The micro-DP gather (t_g = 1 merges both stages): each rank receives the stage it does
    # not hold, so the most any rank receives is the first stage (embedding + layer 0).
    # The simulator's formula, (t*p - t_g*p_g) / (t_g*p_g * t*p) * M = M / 2, is the mean
    # over ranks for equal stages.
    from executor.model import build_model
    from simulator.specs.presets import MODEL_PRESETS

    model = build_model(MODEL_PRESETS["tiny-2l-hd32"])
    first_stage = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                      if n.startswith(("model.embed_tokens.", "model.layers.0.")))
    with open(tmp_path / "pp" / "measurements.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["node"] == "actor.transition"]
    assert len(rows) == 2
    assert all(float(r["bytes_received_per_gpu"]) == first_stage for r in rows)


def test_a_plan_made_by_plain_hybridflow_plan_executes(tmp_path: Path) -> None:
    """``hybridflow plan`` (framework hybridflow: the executor's torch and Megatron-core
    layouts) on a tiny PPO job of 2 CPU workers; its plan names a backend per role and
    ``execute`` runs it."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({
        "algorithm": "ppo", "framework": "hybridflow",
        "models": {"actor": "tiny-2l-hd32", "critic": "tiny-2l-hd32",
                                       "ref": "tiny-2l-hd32", "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu-2core-calibrated"},
        "workload": {"prompts_per_iteration": 8, "prompt_length": 5, "response_length": 5,
                     "mini_batches_per_epoch": 2, "dtype": "fp32"}}))
    report = tmp_path / "report"
    planned = hybridflow("plan", "--config", str(job), "--out", str(report))
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads((report / "plan.json").read_text())
    assert {rp["training_backend"] for rp in plan["roles"].values()} <= {"torch", "megatron"}
    _execute(report / "plan.json", job, tmp_path / "run", True)


def test_megatron_roles_run_in_bf16_and_hold_the_simulators_state_bytes(
        tmp_path: Path) -> None:
    """The job's bf16 on the Megatron backend: bf16 weights, fp32 main gradients and fp32
    master weights + Adam moments in the optimizer, the bytes the simulator's memory model
    counts for the same layout (tp 2; the reference does not train: weights only)."""
    from simulator.costs.training import optimizer_memory
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    par = _layout(tp=2, dp=1, sharding="none")
    roles = {"actor": {"parallel": par, "generation": {"tp": 2}, "training_backend": "megatron"},
             "critic": {"parallel": par, "training_backend": "megatron"},
             "ref": {"parallel": par, "training_backend": "megatron"}}
    metrics = _execute(_plan(tmp_path, 2, roles),
                       _job(tmp_path, 2, {}, dtype="bf16"), tmp_path / "run", True)
    assert all(float(m["actor_grad_norm"]) > 0 for m in metrics)
    with open(tmp_path / "run" / "measurements.csv") as f:
        rows = list(csv.DictReader(f))
    spec = MODEL_PRESETS["tiny-2l-hd32"]
    layout = ParallelConfig(tp=2, dp=1, sharding="none", sequence_parallel=False)
    for node, role, trainable in (("actor.train", "actor", True),
                                  ("critic.train", "critic", True),
                                  ("ref.infer", "ref", False)):
        predicted = optimizer_memory(spec, layout, value_head=role == "critic",
                                     trainable=trainable, dtype="bf16")
        measured = [r for r in rows if r["node"] == node and r["role"] == role][-1]
        assert float(measured["params_bytes"]) == predicted.params, node
        assert float(measured["grads_bytes"]) == predicted.grads, node
        assert float(measured["optimizer_bytes"]) == predicted.optimizer, node


def test_a_resumed_megatron_run_ends_with_the_uninterrupted_runs_weights(
        tmp_path: Path) -> None:
    """Checkpoints of the Megatron backend (torch DCP through its inner torch optimizers),
    with the distributed optimizer sharding the fp32 masters and Adam states over dp 2 and
    bf16 weights: 2 iterations, a resume to 4, and the actor's weights bit for bit as 4
    iterations in one go, with the same losses."""
    from safetensors.torch import load_file

    layout = _layout(tp=1, dp=2, sharding="optimizer")
    roles = {"actor": {"parallel": layout, "generation": {"tp": 1},
                       "training_backend": "megatron"},
             "critic": {"parallel": layout, "training_backend": "megatron"},
             "ref": {"parallel": _layout(tp=1, dp=2, sharding="none"),
                     "training_backend": "megatron"}}
    plan, job = _plan(tmp_path, 2, roles), _job(tmp_path, 2, {}, dtype="bf16")

    def run(*extra: str) -> None:
        result = hybridflow("execute", str(plan), "--config", str(job), "--reward-warmup", "0",
                            "--seed", "7", "--worker-setup", SETUP, *extra)
        assert result.returncode == 0, result.stderr[-3000:]

    run("--steps", "4", "--out", str(tmp_path / "whole"), "--save-hf", str(tmp_path / "a"))
    run("--steps", "2", "--out", str(tmp_path / "half"), "--checkpoint-every", "2",
        "--save-hf", str(tmp_path / "b"))
    shards = sorted(p.name for p in (tmp_path / "half" / "checkpoints" / "iter_000002" /
                                     "actor").iterdir())
    assert shards.count("__0_0.distcp") == 1 and "__1_0.distcp" in shards  # one per rank
    resumed = hybridflow("execute", "--resume", str(tmp_path / "half"), "--steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), \
        load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    with open(tmp_path / "whole" / "metrics.csv") as f:
        whole = list(csv.DictReader(f))
    with open(tmp_path / "half" / "metrics.csv") as f:
        half = list(csv.DictReader(f))
    assert [m["iteration"] for m in half] == ["0", "1", "2", "3"]
    for mine, theirs in zip(half, whole, strict=True):
        for key in COMPARED:
            assert mine[key] == theirs[key], key


def test_grpo_on_prompt_data_with_megatron_training_matches_the_torch_backend(
        tmp_path: Path) -> None:
    """Issue 31 defect 3: a job with its own prompt data (prompts of different lengths,
    left-padded) trains on Megatron (tp 2 x pp 2 is the CPU's limit of two workers: tp 2),
    each row run right-padded, and its metrics are the torch backend's on the same prompts."""
    from tests.dataset_fixtures import addition_rows, make_tokenizer, write_jsonl

    write_jsonl(tmp_path / "train.jsonl", addition_rows(4))
    # A reward that varies between a prompt's samples, so GRPO's advantages are not zero.
    (tmp_path / "score.py").write_text(
        "def compute_score(prompt, response, row):\n    return float(len(response.split()))\n")
    tokenizer = make_tokenizer(tmp_path / "tokenizer")

    def run(backend: str) -> list[dict]:
        job = tmp_path / f"job-{backend}.json"
        job.write_text(json.dumps({
            "algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l",
                                            "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "backends": {"actor": {"training": backend}, "ref": {"training": backend}},
            "workload": {"samples_per_prompt": 2, "prompts_per_iteration": 2,
                         "mini_batches_per_epoch": 1, "prompt_length": 16,
                         "response_length": 4, "dtype": "fp32"},
            "reward_function": {"path": str(tmp_path / "score.py")},
            "data": {"train_files": str(tmp_path / "train.jsonl"),
                     "tokenizer": str(tokenizer)}}))
        layout = _layout(tp=2, dp=1, sharding="none")
        plan = tmp_path / f"plan-{backend}.json"
        plan.write_text(json.dumps({
            "format": "hybridflow-plan", "version": 1, "algorithm": "grpo",
            "sets": [{"roles": ["actor", "ref"], "gpus": 2, "first_gpu": 0}],
            "roles": {"actor": {"parallel": layout, "generation": {"tp": 2},
                                "training_backend": backend},
                      "ref": {"parallel": layout, "training_backend": backend}}}))
        return _execute(plan, job, tmp_path / backend, backend == "megatron")

    megatron, reference = run("megatron"), run("torch")
    assert _backends(tmp_path / "megatron")["actor.train"] == "megatron"
    assert any(float(m["actor_grad_norm"]) > 0 for m in reference)
    for mine, theirs in zip(megatron, reference, strict=True):
        for key in ("actor_policy_loss", "actor_grad_norm", "response_tokens"):
            assert float(mine[key]) == pytest.approx(float(theirs[key]), rel=METRIC_TOLERANCE,
                                                     abs=METRIC_ABSOLUTE), key
