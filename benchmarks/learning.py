"""Does RL learn through the executor? ``python benchmarks/learning.py`` runs the two learning
set-ups the tests check (tests/test_executor_ray.py) and prints the figures the README quotes:

- GRPO, tiny-2l actor and reference on 2 virtual GPUs (actor FSDP dp 2), rule reward, 32
  prompts x 8 samples, 60 iterations, seed 0: mean rule reward over the first and last 10.
- Safe-RLHF, rule reward and rule cost (writing the digit 4 costs 1), 32 prompts, actor + ref
  on one GPU and the critic on another, 120 iterations, seed 0, with the constraint
  (threshold 0.1) and without (lambda fixed at 0): reward over the first 10 iterations, and
  reward and cost over iterations 80-119.

About two and a half minutes here. Prints; never asserts (the tests do).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import ray

from executor.algorithms import RLConfig
from executor.run import ExecutionOptions
from executor.session import execute
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import JobSpec, job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROOT = Path(__file__).resolve().parents[1]


def _job(algorithm: str, models: dict[str, str], gpus: int, **workload: object) -> JobSpec:
    work = {"prompts_per_iteration": 32, "prompt_length": 5, "response_length": 5,
            "mini_batches_per_epoch": 2, **workload}
    return job_from_mapping({"algorithm": algorithm, "models": models,
                             "cluster": {"nodes": 1, "gpus_per_node": gpus},
                             "workload": work})


def _plan(algorithm: str, sets: list[tuple[tuple[str, ...], int]],
          layouts: dict[str, tuple[int, str]]) -> Plan:
    first, colocated = 0, []
    for roles, gpus in sets:
        colocated.append(ColocatedSet(roles=roles, gpus=gpus, first_gpu=first))
        first += gpus
    return Plan(algorithm=algorithm, sets=tuple(colocated), roles={
        role: RolePlan(parallel=ParallelConfig(dp=dp, sharding=sharding, micro_batch_size=8,
                                               sequence_parallel=False),
                       generation=GenerationConfig() if role == "actor" else None)
        for role, (dp, sharding) in layouts.items()})


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            grpo = _job("grpo", {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"}, 2,
                        samples_per_prompt=8, train_micro_batch_size=64,
                        infer_micro_batch_size=64)
            plan = _plan("grpo", [(("actor", "ref"), 2)],
                         {"actor": (2, "fsdp"), "ref": (2, "none")})
            metrics = execute(grpo, plan, ExecutionOptions(
                steps=60, seed=0, out=Path(tmp) / "grpo", reward_warmup_steps=2)).metrics
            scores = [m["rule_score"] for m in metrics]
            print(f"GRPO (60 iterations): mean rule reward, iterations 0-9 "
                  f"{_mean(scores[:10]):.3f}, 50-59 {_mean(scores[-10:]):.3f}")
            print("  per 5 iterations: " + " ".join(
                f"{_mean(scores[i:i + 5]):.2f}" for i in range(0, len(scores), 5)))
            sys.stdout.flush()
            models = {"actor": "tiny-2l", "critic": "tiny-2l", "ref": "tiny-2l",
                      "reward": "rule", "cost": "rule"}
            safe = _job("safe-rlhf", models, 2, train_micro_batch_size=16,
                        infer_micro_batch_size=32)
            plan = _plan("safe-rlhf", [(("actor", "ref"), 1), (("critic",), 1)],
                         {r: (1, "none") for r in ("actor", "ref", "critic")})
            for name, rl in (("constrained (cost_threshold 0.1)", RLConfig(cost_threshold=0.1)),
                             ("unconstrained (lambda_init 0)", RLConfig(lambda_init=0.0))):
                metrics = execute(safe, plan, ExecutionOptions(
                    steps=120, seed=0, out=Path(tmp) / name.split()[0], reward_warmup_steps=2,
                    rl=rl)).metrics
                late = metrics[80:]
                print(f"Safe-RLHF {name}: reward iterations 0-9 "
                      f"{_mean([m['rule_score'] for m in metrics[:10]]):.3f}; iterations "
                      f"80-119 reward {_mean([m['rule_score'] for m in late]):.3f}, cost "
                      f"{_mean([m['rule_cost'] for m in late]):.3f}")
                sys.stdout.flush()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
