"""``hybridflow simulate``: one plan's iteration, simulated, with its JSON."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError, json_text, write_text_atomic

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    EXIT_DOES_NOT_FIT,
    _checked,
    _emit_json,
    _finite,
    _gib,
    _load_job,
    _load_plan_and_job,
    _memory_json,
    cli,
)


def simulation_json(job: Any, plan: Any, result: Any, estimate: Any) -> dict[str, Any]:
    """The machine-readable summary of one simulation (``simulate --json``)."""
    return {
        "job": job.name or None,
        "algorithm": job.algorithm,
        "gpus": job.cluster.total_gpus,
        "device": job.cluster.device_label,
        "cost_model": result.mode,
        "iterations": result.iterations,
        "placement": plan.placement,
        "plan": plan.describe(),
        "feasible": result.feasible,
        "reasons": list(result.reasons),
        "iteration_seconds": _finite(result.iteration_seconds),
        "throughput_tokens_per_s": result.throughput_tokens_per_s,
        "tokens_per_iteration": estimate.tokens_per_iteration,
        "stages": result.stage_seconds,
        "idle_fraction": result.idle_fraction,
        "peak_memory_bytes_per_gpu": result.peak_memory_bytes_per_gpu,
        "memory_per_set": [
            {"set": m.label, "gpus": m.gpus, "peak_node": m.peak_node,
             "available_bytes": m.available_bytes, "fits": m.fits, **_memory_json(m.peak)}
            for m in estimate.memory],
        "transition": {
            name: {"seconds": t.seconds, "bytes_received_per_gpu": t.bytes_received_per_gpu,
                   "peak_param_bytes_per_gpu": t.peak_param_bytes_per_gpu,
                   "redundant_bytes_per_gpu": t.redundant_bytes_per_gpu}
            for name, t in estimate.transition_schemes.items()},
    }


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the job stored in --plan, else the HybridFlow paper's "
                   "PPO 7B job on 16 A100s).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Plan JSON (default: colocate everything with a sensible parallel config).")
@click.option("--cost-model", type=click.Choice(["des", "paper"]), default="des",
              show_default=True,
              help="des: event simulation; paper: HybridFlow's stage-by-stage d_cost.")
@click.option("--iterations", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--overlap-iterations", is_flag=True,
              help="Let an iteration start before the previous one ends where the dataflow "
                   "allows (asynchronous); default: synchronous iterations, as RLHF trainers "
                   "run them.")
@click.option("--transition", type=click.Choice(["micro_dp", "train_group", "all_gpus"]),
              default=None,
              help="Actor train->generate resharding scheme (default: the job framework's).")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome trace (chrome://tracing, Perfetto).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Also write plan.json, simulation.json and trace.json here.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def simulate(config: str | None, plan_path: str | None, cost_model: str, iterations: int,
             overlap_iterations: bool, transition: str, trace: str | None, out: str | None,
             as_json: bool) -> None:
    """Simulate RLHF iterations of a job under a plan."""
    from simulator.default_plan import colocate_plan
    from simulator.engine import simulate_estimated
    from simulator.plan import job_as_planned
    from simulator.predict import estimate_plan
    from simulator.trace import write_chrome_trace

    if plan_path:
        plan, job = _load_plan_and_job(plan_path, config)
        _checked(plan, job, plan_path)
    else:
        job = _load_job(config)
        try:
            plan = colocate_plan(job)
        except SpecError as exc:
            raise exc.within(source=config or "the default job") from None
    job = job_as_planned(job, plan)
    estimate = estimate_plan(job, plan, transition_scheme=transition)  # type: ignore[arg-type]
    try:
        result = simulate_estimated(job, plan, estimate, mode=cost_model,  # type: ignore[arg-type]
                                    iterations=iterations, overlap_iterations=overlap_iterations)
    except SpecError as exc:
        raise exc.within(source=plan_path or config or "the default job") from None
    summary = simulation_json(job, plan, result, estimate)
    if trace:
        write_chrome_trace(trace, result.timeline, metadata={"placement": plan.placement})
    if out:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        replace(plan, predicted={k: summary[k] for k in (
            "iteration_seconds", "throughput_tokens_per_s", "peak_memory_bytes_per_gpu")},
            job=job.to_value()).save(out_dir / "plan.json")
        write_text_atomic(out_dir / "simulation.json", json_text(summary))
        write_chrome_trace(out_dir / "trace.json", result.timeline,
                           metadata={"placement": plan.placement})
    if as_json:
        _emit_json(summary)
    else:
        _print_simulation(job, plan, result, estimate)
        if out:
            click.echo(f"\nwrote {out}/plan.json, simulation.json, trace.json "
                       "(open trace.json in https://ui.perfetto.dev)")
    if not result.feasible:
        if not as_json:
            for reason in result.reasons:
                click.echo(f"does not fit: {reason}", err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


def _print_simulation(job: Any, plan: Any, result: Any, estimate: Any) -> None:
    cluster = job.cluster
    click.echo(f"{job.algorithm.upper()} on {cluster.describe()} ({result.mode} cost model)")
    click.echo(f"plan      {plan.describe(job)}")
    if not result.feasible:
        click.echo("result    infeasible")
        return
    click.echo(f"iteration {result.iteration_seconds:.2f} s   throughput "
               f"{result.throughput_tokens_per_s:,.0f} tokens/s   peak memory "
               f"{_gib(result.peak_memory_bytes_per_gpu)} per GPU")
    click.echo("stages (seconds):")
    for name, seconds in result.stage_seconds.items():
        node = estimate.nodes.get(name)
        where = "" if node is None or node.location < 0 else f"  [set {node.location}]"
        click.echo(f"  {name:<24} {seconds:10.2f}{where}")
    click.echo("idle fraction per set: " + ", ".join(
        f"{label} {idle:.0%}" for label, idle in result.idle_fraction.items()))
    if estimate.transition_schemes:
        click.echo("actor transition (per GPU): " + "; ".join(
            f"{name} {t.bytes_received_per_gpu / 1e9:.2f} GB in {t.seconds * 1000:.1f} ms"
            for name, t in estimate.transition_schemes.items()))
