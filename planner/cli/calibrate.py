"""``hybridflow profile``, ``calibrate`` and ``accuracy``: device profiles measured, and fitted
on runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    _emit_json,
    _load_device,
    cli,
)


def _executor_import(what: str) -> None:
    raise SpecError(f"{what} needs the executor's dependencies (torch): pip install -e "
                    "'.[executor]' (torch==2.13.0 first on CPU machines)", key=what)


@cli.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--world-size", type=click.IntRange(min=2), default=2, show_default=True,
              help="Processes for the collective benchmarks.")
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="Profile YAML to write (measurements CSV beside it).")
@click.option("--quick", is_flag=True, help="A small grid (seconds), for tests.")
def profile(device: str, world_size: int, out: str, quick: bool) -> None:
    """Measure this machine and write a device profile."""
    try:
        from executor.profiler import ProfileSettings, measure_profile, write_profile
    except ImportError:
        _executor_import("profile")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError("no CUDA device on this machine", key="--device")
    path = Path(out)
    if path.suffix not in (".yaml", ".yml"):
        raise SpecError("the profile file must end in .yaml", key="--out")
    # Checked before measuring, so a wrong path fails in a second, not after the benchmarks.
    parent = path.parent
    if not parent.is_dir():
        raise SpecError(f"{parent} is not an existing directory", key="--out")
    if not os.access(parent, os.W_OK):
        raise SpecError(f"{parent} is not writable", key="--out")
    # One process per core (per GPU on CUDA): more would time the scheduler, not the links.
    available = (torch.cuda.device_count() if device == "cuda"
                 else max(2, os.cpu_count() or 2))
    if world_size > available:
        raise SpecError(f"{world_size} processes on a machine with {available} "
                        f"{'GPUs' if device == 'cuda' else 'cores'}; at most {available}",
                        key="--world-size")
    settings = ProfileSettings(device=device, world_size=world_size, quick=quick,
                               name=path.stem)
    started = __import__("time").perf_counter()
    profile_map, measurements = measure_profile(
        settings, progress=lambda message: click.echo(f"  {message}", err=True))
    write_profile(profile_map, measurements, path)
    click.echo(f"wrote {path} and {path.with_suffix('.measurements.csv')} in "
               f"{__import__('time').perf_counter() - started:.1f} s")


def _runs(paths: tuple[str, ...]) -> list[Any]:
    from planner.calibration import load_run

    if not paths:
        raise SpecError("give at least one run directory", key="RUNS")
    return [load_run(p) for p in paths]


def _verl_options(f: Any) -> Any:
    """--verl-log / --job / --plan: runs read from a verl trainer's metrics logs."""
    for option in reversed((
        click.option("--verl-log", "verl_logs", multiple=True,
                     type=click.Path(dir_okay=False),
                     help="A verl run's per-step metrics: its console output or its file "
                          "logger's JSON lines (repeatable; see docs/calibration.md "
                          "'Calibrate from verl logs')."),
        click.option("--job", "--config", "verl_jobs", multiple=True,
                     type=click.Path(dir_okay=False),
                     help="The job file of the verl run (one for all logs or one per log)."),
        click.option("--plan", "verl_plans", multiple=True, type=click.Path(dir_okay=False),
                     help="The plan the verl run ran (one for all logs or one per log; "
                          "default: the job's colocate plan, verl's default placement)."),
    )):
        f = option(f)
    return f


def _all_runs(paths: tuple[str, ...], logs: tuple[str, ...], jobs: tuple[str, ...],
              plans: tuple[str, ...]) -> list[Any]:
    """Executor run directories, then runs read from verl logs."""
    from planner.verl_log import load_verl_runs

    if not logs:
        for option, given in (("--job", jobs), ("--plan", plans)):
            if given:
                raise SpecError("only used with --verl-log", key=option)
        return _runs(paths)
    return (_runs(paths) if paths else []) + load_verl_runs(logs, jobs, plans)


@cli.command()
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--profile", "profile_name", required=True,
              help="Profile to start from (name or YAML).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the calibrated profile (default: NAME-calibrated.yaml "
                   "next to the base profile).")
@click.option("--fit", default=None,
              help="Comma-separated parameters to fit (default: all; see docs/calibration.md).")
@click.option("--framework-out", "framework_output", type=click.Path(dir_okay=False),
              default=None,
              help="Where to write the framework profile when --fit names framework.* fixed "
                   "costs (default: FRAMEWORK-calibrated.yaml in the current directory).")
@click.option("--held-out", "held_out", multiple=True, type=click.Path(file_okay=False),
              help="A run not fitted on, to measure the fit's error (repeatable). The profile "
                   "is not written when it predicts these worse than the base profile.")
@click.option("--skip", type=click.IntRange(min=0), default=1, show_default=True,
              help="Leading iterations of each run to ignore (start-up costs).")
@_verl_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def calibrate(runs: tuple[str, ...], profile_name: str, output: str | None, fit: str | None,
              framework_output: str | None, held_out: tuple[str, ...], skip: int,
              verl_logs: tuple[str, ...], verl_jobs: tuple[str, ...],
              verl_plans: tuple[str, ...], as_json: bool) -> None:
    """Fit a device profile's free parameters, and a framework profile's fixed costs, to
    executor runs or verl logs."""
    from planner.calibration import FRAMEWORK_PARAMETERS
    from planner.calibration import calibrate as fit_profile
    from planner.verl_log import DEFAULT_FIT
    from profiles.device import resolve_profile_path, write_profile_file
    from profiles.framework import write_fixed_costs_profile

    base = _load_device(profile_name)
    loaded = _all_runs(runs, verl_logs, verl_jobs, verl_plans)
    if not fit and verl_logs:
        fit = ",".join(DEFAULT_FIT)
    chosen = fit.split(",") if fit else []
    if framework_output and not any(k in FRAMEWORK_PARAMETERS for k in chosen):
        raise SpecError("only used when --fit names framework.* fixed costs",
                        key="--framework-out")
    result = fit_profile(loaded, base, fit=fit.split(",") if fit else None, skip=skip,
                         name=Path(output).stem if output else None,
                         held_out=_runs(held_out) if held_out else ())
    fits_device = not fit or any(k not in FRAMEWORK_PARAMETERS for k in chosen)
    header = f"# Calibrated by `hybridflow calibrate` from {len(loaded)} run(s)."
    written = []
    path = None
    if fits_device:
        path = Path(output) if output else resolve_profile_path(profile_name).with_name(
            f"{result.profile.name}.yaml")
        write_profile_file(result.profile, path, header=header)
        written.append(path)
    framework_path = None
    if result.fixed_costs is not None and result.framework is not None:
        framework_path = Path(framework_output) if framework_output else Path(
            f"{Path(result.framework).stem}-calibrated.yaml")
        write_fixed_costs_profile(result.framework, result.fixed_costs, framework_path,
                                  header=header + " Use it as the job's `framework:`.")
        written.append(framework_path)
    summary = {"profile": str(path) if path else None,
               "framework_profile": str(framework_path) if framework_path else None,
               "values": result.values,
               "residual_before": result.residual_before,
               "residual_after": result.residual_after, "rows": result.rows,
               "runs": list(result.runs), "at_bounds": result.at_bounds,
               "objective_before": result.objective_before,
               "objective_after": result.objective_after,
               "held_out": None if result.held_out_after is None else {
                   key: {k: result_part[k] for k in ("median_abs_error_pct",
                                                     "max_abs_error_pct", "bias_pct",
                                                     "kendall_tau")}
                   for key, result_part in (("before", result.held_out_before),
                                            ("after", result.held_out_after))}}
    if as_json:
        _emit_json(summary)
        return
    click.echo(f"fitted {len(result.values)} parameters on {result.rows} stage timings from "
               f"{len(loaded)} run(s): relative RMS error {result.residual_before:.1%} -> "
               f"{result.residual_after:.1%}")
    for key, value in result.values.items():
        bound = result.at_bounds.get(key)
        click.echo(f"  {key:<32} {value:.4g}"
                   + (f"   at its {bound} bound" if bound else ""))
    for key, bound in result.at_bounds.items():
        click.echo(f"warning: {key} ended at its {bound} bound: the runs push it past the range "
                   "the model allows, so a mechanism is missing (or it does not matter for "
                   "these runs and should be left out with --fit)", err=True)
    if result.held_out_after is not None:
        before, after = result.held_out_before, result.held_out_after
        click.echo(f"held-out runs ({len(held_out)}): median |error| per plan "
                   f"{before['median_abs_error_pct']:.1f}% -> "
                   f"{after['median_abs_error_pct']:.1f}%, max {after['max_abs_error_pct']:.1f}%,"
                   f" bias {after['bias_pct']:+.1f}%")
    for written_path in written:
        click.echo(f"wrote {written_path}")


@cli.command()
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--profile", "profile_name", default=None,
              help="Profile to predict with (default: the device in each run's job).")
@click.option("--skip", type=click.IntRange(min=0), default=1, show_default=True,
              help="Leading iterations of each run to ignore (start-up costs).")
@_verl_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def accuracy(runs: tuple[str, ...], profile_name: str | None, skip: int,
             verl_logs: tuple[str, ...], verl_jobs: tuple[str, ...],
             verl_plans: tuple[str, ...], as_json: bool) -> None:
    """The simulator's error on executor runs or verl logs, per stage and per iteration."""
    from planner.calibration import accuracy as measure

    loaded = _all_runs(runs, verl_logs, verl_jobs, verl_plans)
    device = profile_name or loaded[0].job.cluster.only_group().device
    result = measure(loaded, _load_device(device), skip=skip)
    if as_json:
        _emit_json(result)
        return
    click.echo(f"profile {result['profile']} on {result['runs']} run(s) of "
               f"{result['plans']} plan(s) (error = predicted - measured; + is too slow):")
    for run in result["per_run"]:
        repeats = f" (median of {run['repeats']} runs)" if run["repeats"] > 1 else ""
        click.echo(f"  {run['run']:<32} measured {run['measured_iteration_seconds']:.3f} s, "
                   f"predicted {run['predicted_iteration_seconds']:.3f} s per iteration "
                   f"{run['error_pct']:+6.1f}%{repeats}")
    click.echo("  per stage, median |error| (bias): " + ", ".join(
        f"{node} {s['median_abs_error_pct']:.0f}% ({s['bias_pct']:+.0f}%)"
        for node, s in result["per_stage"].items()))
    click.echo("  per backend, median |error| of its stages (bias): " + ", ".join(
        f"{name} {s['median_abs_error_pct']:.0f}% ({s['bias_pct']:+.0f}%)"
        for name, s in result["per_backend"].items()))
    tau = "n/a" if result["kendall_tau"] is None else f"{result['kendall_tau']:.2f}"
    click.echo(f"per plan: median |error| {result['median_abs_error_pct']:.1f}%, max "
               f"{result['max_abs_error_pct']:.1f}%, bias {result['bias_pct']:+.1f}%; ranking "
               f"of plans (Kendall tau) {tau}")
