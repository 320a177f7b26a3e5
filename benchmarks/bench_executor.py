"""Executor overheads (``make bench``): Ray's round-trip floor, the controller's dispatch cost
per call, the share of an iteration spent outside the workers' compute, and the actor's
train -> generate transition, 3D-HybridEngine vs naive. Prints; never asserts."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import ray
import torch

from executor.batch import Batch
from executor.controller import RoleHandle, WorkerGroup
from executor.protocols import RankLayout
from executor.run import ExecutionOptions, role_configs
from executor.session import execute
from executor.task import SortDigits
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROOT = Path(__file__).resolve().parents[1]


def tiny_job(algorithm: str, gpus: int, model: str = "tiny-2l"):
    models = {"actor": model, "ref": model, "reward": "rule"}
    if algorithm == "ppo":
        models = {"actor": model, "critic": model, "ref": model, "reward": model}
    return job_from_mapping({
        "algorithm": algorithm, "models": models,
        "cluster": {"nodes": 1, "gpus_per_node": gpus},
        "workload": {"prompts_per_iteration": 32, "prompt_length": 5, "response_length": 5,
                     "samples_per_prompt": 8 if algorithm == "grpo" else 1,
                     "mini_batches_per_epoch": 2, "train_micro_batch_size": 64,
                     "infer_micro_batch_size": 64}})


def actor_plan(job, tp: int, gen_tp: int) -> Plan:
    par = ParallelConfig(tp=tp, dp=1, micro_batch_size=64, sequence_parallel=False)
    return Plan(algorithm=job.algorithm, sets=(ColocatedSet(roles=("actor", "ref"), gpus=tp),),
                roles={"actor": RolePlan(parallel=par, generation=GenerationConfig(tp=gen_tp)),
                       "ref": RolePlan(parallel=par)})


def dispatch_overhead() -> dict[str, float]:
    job = tiny_job("grpo", 2)
    plan = actor_plan(job, 2, 1)
    config = role_configs(job, plan, ExecutionOptions())["ref"]
    group = WorkerGroup(ray, 0, ColocatedSet(roles=("ref",), gpus=2))
    try:
        group.build(config)
        pings = []
        for _ in range(300):
            start = time.perf_counter()
            ray.get([w.ping.remote() for w in group.workers])
            pings.append(time.perf_counter() - start)
        records: list = []
        handle = RoleHandle(group, "ref", RankLayout(world=2, dp=1, tp=2), records.append, {})
        prompts = SortDigits().sample(2, torch.Generator().manual_seed(0))
        batch = Batch({"input_ids": torch.cat([prompts, prompts[:, :4]], 1),
                       "response_mask": torch.ones(2, 4)}, {"prompt_length": 5})
        for _ in range(200):
            handle.echo(batch).result()
        overhead = [r.wall_seconds - r.compute_seconds for r in records[20:]]
        records.clear()
        for _ in range(50):
            handle.log_probs(batch).result()
        forward = [r.wall_seconds - r.compute_seconds for r in records[10:]]
    finally:
        group.shutdown()
    return {"ray round trip to 2 workers (ms, median)": 1000 * statistics.median(pings),
            "controller dispatch + collect, empty call (ms, median)":
                1000 * statistics.median(overhead),
            "controller dispatch + collect, 2-sequence forward (ms, median)":
                1000 * statistics.median(forward)}


def iteration_share() -> dict[str, float]:
    out = {}
    for algorithm, gpus in (("grpo", 2), ("ppo", 2)):
        job = tiny_job(algorithm, gpus)
        roles = tuple(job.gpu_roles)
        par = ParallelConfig(tp=1, dp=gpus, sharding="fsdp", micro_batch_size=64)
        frozen = ParallelConfig(tp=1, dp=gpus, micro_batch_size=64)
        plan = Plan(algorithm=algorithm, sets=(ColocatedSet(roles=roles, gpus=gpus),),
                    roles={r: RolePlan(parallel=par if r in job.dataflow.trained_roles
                                       else frozen,
                                       generation=GenerationConfig() if r == "actor" else None)
                           for r in roles})
        with tempfile.TemporaryDirectory() as tmp:
            execute(job, plan, ExecutionOptions(steps=12, out=Path(tmp), reward_warmup_steps=2))
            rows = pd.read_csv(Path(tmp) / "measurements.csv")
        rows = rows[rows["iteration"] >= 2]  # skip warm-up iterations
        shares, walls = [], []
        for _, group in rows.groupby("iteration"):
            wall = float(group[group["node"] == "iteration"]["wall_seconds"].iloc[0])
            # Generation rows exclude the actor's transition, which has its own row.
            stages = group[group["node"] != "iteration"]
            compute = float(stages["compute_seconds"].sum())
            shares.append(max(0.0, wall - compute) / wall)
            walls.append(wall)
        out[f"{algorithm.upper()} colocated on {gpus} GPUs: iteration seconds (mean)"] = \
            statistics.mean(walls)
        out[f"{algorithm.upper()} colocated on {gpus} GPUs: share outside workers' compute"] = \
            statistics.mean(shares)
    return out


def transitions() -> list[dict[str, float]]:
    rows = []
    for tp, gen_tp in ((2, 1), (4, 1), (4, 2)):
        for mode in ("micro_dp", "naive"):
            job = tiny_job("grpo", tp, model="tiny-4l")
            plan = actor_plan(job, tp, gen_tp)
            config = role_configs(job, plan, ExecutionOptions(transition=mode))["actor"]
            group = WorkerGroup(ray, 0, ColocatedSet(roles=("actor",), gpus=tp))
            try:
                group.build(config)
                records: list = []
                handle = RoleHandle(group, "actor", RankLayout(world=tp, dp=1, tp=tp,
                                                               gen_tp=gen_tp),
                                    records.append, {})
                prompts = SortDigits().sample(8, torch.Generator().manual_seed(0))
                for i in range(12):
                    handle.generate(Batch({"prompts": prompts}, {"iteration": i})).result()
                infos = [i["transition"] for r in records[2:] for i in r.infos]
            finally:
                group.shutdown()
            rows.append({"tp": tp, "gen_tp": gen_tp, "mode": mode,
                         "seconds_median": statistics.median(i["seconds"] for i in infos),
                         "bytes_received_per_gpu": max(i["bytes_received_per_gpu"]
                                                       for i in infos),
                         "peak_param_bytes_per_gpu": max(i["peak_param_bytes_per_gpu"]
                                                         for i in infos)})
    return rows


def main() -> None:
    ray.init(num_gpus=4, num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    try:
        print("Executor benchmark (local Ray, virtual GPUs, gloo, one torch thread per worker)\n")
        for name, value in {**dispatch_overhead(), **iteration_share()}.items():
            print(f"  {name:<62} {value:10.3f}")
        print("\nActor train -> generate transition (tiny-4l, fp32):")
        print(pd.DataFrame(transitions()).to_string(index=False))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
