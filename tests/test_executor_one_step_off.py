"""One-step-off plans on a local Ray cluster with virtual GPUs (CPU only, gloo): generation on
a rollout set of its own, one batch ahead of training, the trainer's weights synced to it
after every update through a process group spanning both sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from executor.run import ExecutionOptions  # noqa: E402
from executor.session import RunSession  # noqa: E402
from simulator.plan import ColocatedSet, Plan, RolePlan, RolloutSet  # noqa: E402
from simulator.specs.job import JobSpec, job_from_mapping  # noqa: E402
from simulator.specs.parallel import GenerationConfig, ParallelConfig  # noqa: E402
from tests.conftest import ROOT, SESSION_RAY_GPUS  # noqa: E402

GPUS = SESSION_RAY_GPUS




def grpo_job(**workload: object) -> JobSpec:
    work = {"prompts_per_iteration": 32, "prompt_length": 5, "response_length": 5,
            "samples_per_prompt": 8, "mini_batches_per_epoch": 2,
            "train_micro_batch_size": 64, "infer_micro_batch_size": 64, **workload}
    return job_from_mapping({"algorithm": "grpo", "mode": "one_step_off",
                             "models": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"},
                             "cluster": {"nodes": 1, "gpus_per_node": GPUS}, "workload": work})


def one_step_off_plan(rollout_gpus: int, mode: str = "one_step_off") -> Plan:
    """The learning test's placement (actor FSDP dp 2 with the reference on 2 GPUs) plus a
    rollout set of ``rollout_gpus`` generation replicas."""
    def par(sharding: str) -> ParallelConfig:
        return ParallelConfig(dp=2, sharding=sharding, micro_batch_size=8,
                              sequence_parallel=False)

    return Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=2),),
                roles={"actor": RolePlan(parallel=par("fsdp"), generation=GenerationConfig()),
                       "ref": RolePlan(parallel=par("none"))},
                mode=mode, max_staleness=1,
                rollout=RolloutSet(gpus=rollout_gpus, first_gpu=2))


class CheckedSession(RunSession):
    """A run that, after every iteration (whose last step is the weight sync), reads the
    trainer's whole weights and every rollout rank's, and keeps the names that differ."""

    differences: list[list[str]]

    def iterate(self, iteration: int) -> bool:
        done = super().iterate(iteration)
        ray, groups = self.workers.ray, self.workers.groups
        trainer, rollout = groups[0], groups[-1]
        # Every trainer rank takes part in gathering the FSDP shards; rank 0's copy is read.
        trained = ray.get([w.call.remote("actor", "whole_weights", None)
                                for w in trainer.workers])[0][0]
        rollouts = [got for got, _ in ray.get(
            [w.call.remote("rollout", "whole_weights", None) for w in rollout.workers])]
        self.differences.append(sorted(
            name for got in rollouts for name in trained
            if name not in got or not torch.equal(trained[name], got[name])))
        return done


def test_one_step_off_grpo_learns_with_synced_weights_and_overlapped_generation(
        local_ray: object, tmp_path: Path) -> None:
    """The GRPO learning set-up of tests/test_executor_ray.py (32 prompts x 8 samples, seed
    0) as a one-step-off plan: its 2 training GPUs plus a rollout set of 2 generation
    replicas, 30 iterations. It must learn: a gain in the mean rule reward, first 10
    iterations against the last 10, of at least 0.1 (half the smallest of seeds 0-4 at 40
    iterations on 2026-11-28: 0.445, 0.342, 0.340, 0.246, 0.450); after every sync both
    rollout ranks hold exactly the trainer's weights (in the compute dtype); and in every
    iteration the next batch's generation starts, on the rollout set, before the update ends
    (synchronously it could only start after).

    Sized by a rule written before the data (2026-12-03): the fewest of 20, 30 and 40
    iterations at which every seed 0-4 gains 1.5 times the margin (0.15), the margin kept.
    Gains by seed on this project's 2-core machine, at 20 / 30 / 40 iterations: 0.170 /
    0.391 / 0.239, 0.173 / 0.262 / 0.342, 0.112 / 0.302 / 0.367, 0.085 / 0.230 / 0.295,
    0.181 / 0.425 / 0.431 (seed 0: 0.048 -> 0.439 by iteration 30); 20 fails at seeds 2
    and 3. A 30-iteration run is the first 30 of a 40-iteration one (seed 3's scores the
    same to the digit)."""
    steps = 30
    job, plan = grpo_job(), one_step_off_plan(rollout_gpus=2)
    session = CheckedSession(job, plan, ExecutionOptions(steps=steps, seed=0,
                                                         out=tmp_path / "run",
                                                         reward_warmup_steps=0))
    session.differences = []
    result = session.run()
    scores = [m["rule_score"] for m in result.metrics]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last > first + 0.1, (first, last)
    assert session.differences == [[]] * steps, session.differences

    rows = pd.read_csv(tmp_path / "run" / "measurements.csv")
    generate = rows[rows["node"] == "actor.generate"]
    assert set(generate["set"]) == {"rollout"} and set(generate["gpus"]) == {2}
    # Iteration 0 generates batches 0 and 1, every later one the next batch; the last none.
    assert generate.groupby("iteration").size().to_dict() == {
        0: 2, **{i: 1 for i in range(1, steps - 1)}}
    train = rows[rows["node"] == "actor.train"].set_index("iteration")
    for i in range(steps - 1):
        # Synchronously, batch i + 1 could only start after update i ended.
        ahead = generate[generate["iteration"] == i]["start_seconds"].max()
        assert ahead < train.loc[i, "end_seconds"], (i, ahead, train.loc[i].to_dict())
    sync = rows[rows["node"] == "actor.weight_sync"]
    assert list(sync["iteration"]) == list(range(steps)) and set(sync["operation"]) == {"sync"}
    assert (sync["bytes_received_per_gpu"] > 0).all() and (sync["wall_seconds"] > 0).all()
    old = rows[rows["node"] == "actor.old_log_prob"]
    assert set(old["set"]) == {"actor,ref"} and len(old) == steps
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    # Batch 0 comes from the trainer's weights; every later one from one update before.
    mismatch = metrics["rollout_log_prob_mismatch"]
    assert mismatch.iloc[0] < 1e-2 and (mismatch.iloc[1:] > mismatch.iloc[0]).all()
    # The next batch's generation, collected after the update, counts its time up to its
    # end, not the wait for the update (which would read as controller overhead).
    assert generate["dispatch_seconds"].median() < train["compute_seconds"].median(), (
        generate["dispatch_seconds"].describe(), train["compute_seconds"].describe())
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["mode"] == "one_step_off"

    # The run feeds back like a synchronous one: accuracy predicts its weight sync, its
    # generation of the next batch (with that batch's lengths) and its steady-state step.
    from planner.calibration import accuracy, load_run
    from profiles.device import load_profile

    measured = accuracy([load_run(tmp_path / "run")], load_profile("cpu-2core-calibrated"))
    nodes = {r["node"] for r in measured["rows"]}
    assert {"actor.weight_sync", "actor.generate", "actor.old_log_prob", "actor.train",
            "iteration"} <= nodes, nodes
    assert all(r["predicted_seconds"] > 0 for r in measured["rows"])
    print("one_step_off accuracy:", {k: round(v, 1) for k, v in measured.items()
                                     if k.endswith("_pct")},
          {k: round(v["median_abs_error_pct"], 1) for k, v in measured["per_stage"].items()})


def test_execute_refuses_an_async_plan_in_one_line(tmp_path: Path) -> None:
    plan = one_step_off_plan(rollout_gpus=2, mode="async")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan.to_value(), "job": grpo_job().to_value()}))
    result = subprocess.run(
        [sys.executable, "-m", "planner", "execute", str(plan_file), "--steps", "1",
         "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "mode" in lines[0] and "async" in lines[0], lines
    assert not (tmp_path / "run").exists()
