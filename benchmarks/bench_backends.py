"""The cost of each executor backend against torch / native on the same tiny plan:
``python benchmarks/bench_backends.py`` (needs ``make engines``).

GRPO with a tiny-2l-hd32 actor and reference on 2 virtual GPUs (actor tp 2, generation tp 2),
8 prompts x 4 samples of 5 + 5 tokens, 8 iterations, the first 3 left out (engine start-up
and first-call warm-up). Prints the median iteration and stage seconds per (training,
generation) backend pair; never asserts. On a machine without GPUs Megatron-core runs through
the test-only CPU shims (``--worker-setup tests.compat.megatron_cpu:install``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd
import ray

from executor.run import ExecutionOptions
from executor.session import execute
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
SKIP = 3


PAIRS = (("torch", "native"), ("torch", "vllm"), ("megatron", "native"), ("megatron", "vllm"))


def run(training: str, generation: str, out: Path) -> pd.DataFrame:
    job = job_from_mapping({
        "algorithm": "grpo",
        "models": {"actor": "tiny-2l-hd32", "ref": "tiny-2l-hd32", "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "backends": {"actor": {"training": training, "generation": generation},
                     "ref": {"training": training}},
        "workload": {"prompts_per_iteration": 8, "samples_per_prompt": 4, "prompt_length": 5,
                     "response_length": 5, "mini_batches_per_epoch": 2,
                     "train_micro_batch_size": 8, "infer_micro_batch_size": 16}})
    par = ParallelConfig(tp=2, dp=1, sequence_parallel=False, micro_batch_size=8)
    plan = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=2),),
                roles={"actor": RolePlan(parallel=par, generation=GenerationConfig(tp=2)),
                       "ref": RolePlan(parallel=par)})
    import torch

    setup = "tests.compat.megatron_cpu:install" if training == "megatron" and \
        not torch.cuda.is_available() else None
    execute(job, plan, ExecutionOptions(steps=STEPS, seed=0, out=out, reward_warmup_steps=0,
                                        worker_setup=setup))
    return pd.read_csv(out / "measurements.csv")


def main() -> None:
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    try:
        print(f"{'training':<9} {'generation':<11} {'iteration s':>12} {'generate s':>11} "
              f"{'transition s':>13} {'infer s':>8} {'train s':>8}")
        with tempfile.TemporaryDirectory() as tmp:
            for training, generation in PAIRS:
                rows = run(training, generation, Path(tmp) / f"{training}-{generation}")
                rows = rows[rows["iteration"] >= SKIP]

                def median(node: str, frame: pd.DataFrame = rows) -> float:
                    key = "wall_seconds" if node == "iteration" else "compute_seconds"
                    return statistics.median(frame[frame["node"] == node][key])

                print(f"{training:<9} {generation:<11} {median('iteration'):>12.3f} "
                      f"{median('actor.generate'):>11.3f} {median('actor.transition'):>13.4f} "
                      f"{median('ref.infer'):>8.3f} {median('actor.train'):>8.3f}", flush=True)
    finally:
        ray.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
