"""``make accuracy``: how well the simulator predicts real executor runs on this machine.

Runs the executor on a grid of plans of one tiny-model ReMax job (colocate, split and
standalone placements; 1 to 3 virtual GPUs; data, fully sharded and tensor parallelism;
generation tensor parallelism with and without a micro-DP transition), calibrates the CPU
profile on some of the runs and reports the error on the others (held out). The last line of
output is the JSON of ``hybridflow accuracy`` for the held-out runs.

Every set uses at most two processes and sets that run at the same time use at most two in
total: the machine has two cores, and the simulator (like a GPU cluster) assumes that devices
do not slow each other down.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import ray

from executor.run import ExecutionOptions
from executor.session import execute
from planner.calibration import accuracy, calibrate, load_run
from profiles.datafile import SpecError
from profiles.device import load_profile, write_profile_file
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.job import JobSpec, job_from_mapping
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "cpu-2core"
ROLES = ("actor", "ref", "reward")
FIT = ("fsdp_unit_seconds", "shared_host_slowdown", "train_compute", "infer_compute",
       "prefill_compute", "decode", "collective", "train_collective")
"""Parameters fitted by default (the controller's call cost is measured, not fitted). A
parameter that ends at its lower bound in two consecutive fits is left out and keeps the base
profile's measured value (a rule written down before comparing): the fixed per-decode-step and
per-operation costs first, then (2026-11-27, both fits of that day) the per-kernel launch and
per-iteration costs, which the measured per-call cost and the FSDP per-unit cost carry in
these runs; a parameter the runs do not need only adds variance to the held-out error."""


def job() -> JobSpec:
    return job_from_mapping({
        "name": "remax-sort-digits-tiny", "algorithm": "remax",
        "models": {r: "tiny-4l" for r in ROLES},
        "cluster": {"nodes": 1, "gpus_per_node": 4, "device": PROFILE},
        "workload": {"prompts_per_iteration": 32, "prompt_length": 5, "response_length": 5,
                     "mini_batches_per_epoch": 2, "dtype": "fp32"}})


def plan(sets: list[tuple[tuple[str, ...], int]],
         layouts: dict[str, tuple[int, int, str, int]], gen_tp: int = 1) -> Plan:
    first, colocated = 0, []
    for roles, gpus in sets:
        colocated.append(ColocatedSet(roles=roles, gpus=gpus, first_gpu=first))
        first += gpus
    return Plan(algorithm="remax", sets=tuple(colocated), roles={
        role: RolePlan(parallel=ParallelConfig(tp=tp, dp=dp, sharding=sharding,
                                               micro_batch_size=micro, sequence_parallel=False),
                       generation=GenerationConfig(tp=gen_tp) if role == "actor" else None)
        for role, (tp, dp, sharding, micro) in layouts.items()})


def grid() -> dict[str, tuple[Plan, str]]:
    """Plan name -> (plan, 'fit' or 'held-out'). The fitted runs vary the micro-batch,
    sharding, data and tensor parallelism and the generation's tensor parallelism so that
    per-step, per-micro-batch and communication costs can be told apart and every mechanism
    the held-out runs use is seen in the fit; the held-out runs combine them differently."""
    def same(tp: int, dp: int, sharding: str, micro: int) -> dict:
        return {r: (tp, dp, sharding, micro) for r in ROLES}

    actor_fsdp = {"actor": (1, 2, "fsdp", 16), "ref": (1, 2, "none", 16),
                  "reward": (1, 2, "none", 16)}
    return {
        "colocate-1gpu": (plan([(ROLES, 1)], same(1, 1, "none", 16)), "fit"),
        "colocate-1gpu-mb4": (plan([(ROLES, 1)], same(1, 1, "none", 4)), "fit"),
        "colocate-2gpu-fsdp": (plan([(ROLES, 2)], actor_fsdp), "fit"),
        "colocate-2gpu-tp2": (plan([(ROLES, 2)], same(2, 1, "none", 16)), "fit"),
        "split-1+1": (plan([(("actor", "ref"), 1), (("reward",), 1)],
                           same(1, 1, "none", 16)), "fit"),
        "colocate-2gpu-ddp-mb16": (plan([(ROLES, 2)], same(1, 2, "none", 16)), "fit"),
        "colocate-2gpu-tp2-gen2-mb4": (plan([(ROLES, 2)], same(2, 1, "none", 4), gen_tp=2),
                                       "fit"),
        "standalone-1+1+1": (plan([((r,), 1) for r in ROLES], same(1, 1, "none", 16)),
                             "held-out"),
        "colocate-1gpu-mb8": (plan([(ROLES, 1)], same(1, 1, "none", 8)), "held-out"),
        "colocate-2gpu-ddp": (plan([(ROLES, 2)], same(1, 2, "none", 8)), "held-out"),
        "colocate-2gpu-fsdp-all": (plan([(ROLES, 2)], same(1, 2, "fsdp", 8)), "held-out"),
        "colocate-2gpu-tp2-gen2": (plan([(ROLES, 2)], same(2, 1, "none", 16), gen_tp=2),
                                   "held-out"),
    }


def calibration_predictions(profile) -> dict[str, float]:
    """Seconds per iteration ``profile`` predicts for each plan of the grid (the job's
    device replaced by ``profile``): recorded in the shipped profile's provenance when it is
    installed, and predicted again by tests/test_shipped_calibration.py."""
    from profiles.device import register_profile
    from simulator.engine import simulate_estimated
    from simulator.plan import job_as_planned
    from simulator.predict import estimate_plan

    base = job()
    device = register_profile(profile)
    # An executor run is this project's executor's behaviour (calibration.iteration_job).
    the_job = replace(base, framework="hybridflow", cluster=replace(base.cluster, node_groups=tuple(
        replace(g, device=device) for g in base.cluster.node_groups)))
    out = {}
    for name, (p, _) in grid().items():
        planned = job_as_planned(the_job, p)
        out[name] = simulate_estimated(planned, p, estimate_plan(planned, p)).iteration_seconds
    return out


def run_name(plan_name: str, repeat: int) -> str:
    return f"{plan_name}-r{repeat}"


def finished(run_dir: Path) -> bool:
    """A run directory holding a complete run (its meta.json written at the end, not after an
    interruption)."""
    meta = run_dir / "meta.json"
    if not meta.exists():
        return False
    try:
        return "interrupted" not in json.loads(meta.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "accuracy")
    # 20 iterations of which the first 4 warm up (allocator, caches, Ray's first calls), and 5
    # runs of each plan: on this shared 2-core machine one plan's runs spread up to 35%, and a
    # median of 5 medians of 16 iterations is what holds still from one invocation to the next.
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4,
                        help="leading iterations of each run left out (start-up)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs per plan, in interleaved rounds; a plan's time is the "
                             "median over its runs of each run's median iteration")
    parser.add_argument("--reuse", action="store_true",
                        help="use the runs already in --out and run nothing")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new set: an earlier set in --out is moved aside to "
                             "OUT-<time> (default: continue it, running only the runs it lacks)")
    parser.add_argument("--fit", default=",".join(FIT),
                        help="comma-separated parameters to fit (default: %(default)s)")
    parser.add_argument("--install", action="store_true",
                        help="also write the calibrated profile over the shipped "
                             f"profiles/devices/{PROFILE}-calibrated.yaml")
    args = parser.parse_args()
    plans = grid()
    the_job = job()
    if args.fresh and args.out.exists():
        aside = args.out.with_name(f"{args.out.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        args.out.rename(aside)
        print(f"the earlier set is kept in {aside}", file=sys.stderr)
    if not args.reuse:
        ray.init(num_gpus=3, num_cpus=5, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
        try:
            # Rounds, not one plan after another: a slow spell of this shared machine then
            # touches one run of several plans instead of every run of one plan. Within a
            # round fitted and held-out plans alternate, and every other round runs backwards,
            # so that a drift of the machine's speed does not separate the two groups.
            fitted = [n for n, (_, use) in plans.items() if use == "fit"]
            held_out = [n for n, (_, use) in plans.items() if use == "held-out"]
            order = [n for pair in itertools.zip_longest(fitted, held_out) for n in pair if n]
            for repeat in range(args.repeats):
                for name in order if repeat % 2 == 0 else order[::-1]:
                    p = plans[name][0]
                    out = args.out / run_name(name, repeat)
                    if finished(out):
                        print(f"kept {run_name(name, repeat):<28} (an earlier run; --fresh to "
                              "start a new set)", file=sys.stderr, flush=True)
                        continue
                    if out.exists():  # an interrupted run of an earlier invocation
                        shutil.rmtree(out)
                    result = execute(the_job, p, ExecutionOptions(
                        steps=args.steps, seed=repeat, out=out, reward_warmup_steps=3))
                    print(f"ran {run_name(name, repeat):<29} {result.seconds:6.1f} s",
                          file=sys.stderr, flush=True)
        finally:
            ray.shutdown()

    def runs(use: str) -> list:
        return [load_run(args.out / run_name(n, r)) for n, (_, u) in plans.items() if u == use
                for r in range(args.repeats)]

    fit, held = runs("fit"), runs("held-out")
    base = load_profile(PROFILE)
    try:
        calibrated = calibrate(fit, base, fit=args.fit.split(","),
                               name=f"{PROFILE}-calibrated", skip=args.skip, held_out=held)
    except SpecError as exc:
        print(f"accuracy: {exc}", file=sys.stderr)
        sys.exit(1)
    before, result = calibrated.held_out_before, calibrated.held_out_after
    train = accuracy(fit, calibrated.profile, skip=args.skip)
    header = ("# The CPU profile calibrated on executor runs by `make accuracy` "
              "(benchmarks/accuracy.py); its measured error on held-out plans is in "
              "provenance.accuracy.")
    written = [args.out / f"{PROFILE}-calibrated.yaml"]
    if args.install:
        written.append(ROOT / "profiles" / "devices" / f"{PROFILE}-calibrated.yaml")
    profile = calibrated.profile
    profile = replace(profile, provenance=replace(
        profile.provenance, predictions=calibration_predictions(profile)))
    for path in written:
        write_profile_file(profile, path, header=header)
    print(f"\nuncalibrated {PROFILE} on held-out plans: median |error| "
          f"{before['median_abs_error_pct']:.1f}%, max {before['max_abs_error_pct']:.1f}%, "
          f"bias {before['bias_pct']:+.1f}%", file=sys.stderr)
    print(f"calibrated on {len(fit)} runs of {train['plans']} plans "
          f"({', '.join(calibrated.values)}): relative RMS "
          f"{calibrated.residual_before:.1%} -> {calibrated.residual_after:.1%}; on those plans "
          f"median |error| {train['median_abs_error_pct']:.1f}%, bias {train['bias_pct']:+.1f}%",
          file=sys.stderr)
    for key, value in calibrated.values.items():
        bound = calibrated.at_bounds.get(key)
        print(f"  {key:<28} {value:.4g}" + (f"   AT ITS {bound.upper()} BOUND" if bound else ""),
              file=sys.stderr)
    for run in result["per_run"]:
        print(f"  held-out {run['run']:<29} measured {run['measured_iteration_seconds']:.3f} s "
              f"predicted {run['predicted_iteration_seconds']:.3f} s ({run['error_pct']:+.1f}%;"
              f" {run['repeats']} runs, spread {run['repeat_spread_pct']:.0f}%)",
              file=sys.stderr)
    print(f"held-out plans: median |error| {result['median_abs_error_pct']:.1f}%, max "
          f"{result['max_abs_error_pct']:.1f}%, bias {result['bias_pct']:+.1f}%, Kendall tau "
          f"{result['kendall_tau']}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    summary = {k: result[k] for k in ("profile", "runs", "plans", "median_abs_error_pct",
                                      "max_abs_error_pct", "bias_pct", "kendall_tau",
                                      "iteration_median_abs_error_pct",
                                      "iteration_max_abs_error_pct",
                                      "stage_median_abs_error_pct", "stage_max_abs_error_pct",
                                      "per_stage", "per_run")}
    summary["at_bounds"] = calibrated.at_bounds
    summary["fitted"] = calibrated.values
    print(json.dumps(summary))


if __name__ == "__main__":
    try:
        main()
    except SpecError as exc:  # a bad --out or a run directory that is not one: one line
        print(f"accuracy: error: {exc}", file=sys.stderr)
        sys.exit(2)
