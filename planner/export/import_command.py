"""``hybridflow import LAUNCH --from verl|openrlhf|nemo-rl [--device D | --job job.yaml]``:
read a run a user already launches with their framework as a job and a plan, and print its
predicted step with the stages."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import yaml

from planner.export.importing import ImportContext
from profiles.datafile import SpecError, json_text, write_text_atomic

MODULES = {
    "verl": ("verl.trainer.main_ppo", "verl.experimental.one_step_off_policy.main_ppo",
             "verl.experimental.fully_async_policy.fully_async_main"),
    "openrlhf": ("openrlhf.cli.train_ppo_ray",),
    "nemo-rl": ("run_grpo.py",),
}
"""The trainer modules a launch of each framework runs."""


def read_imported(source: str, framework: str, context: ImportContext,
                  env: dict[str, str]) -> tuple[Any, Any]:
    """(job, plan) of the launch in ``source``."""
    from planner.export.launch import read_launch

    if framework == "nemo-rl" and Path(source).suffix in (".yaml", ".yml"):
        from planner.export.launch import Launch

        launch = Launch(source=source, module="")  # a recipe itself
    else:
        launch = read_launch(source, MODULES[framework], env=env)
    if framework == "verl":
        from planner.export.verl_import import import_verl

        return import_verl(launch, context)
    if framework == "nemo-rl":
        from planner.export.nemo_rl_import import import_nemo_rl

        return import_nemo_rl(launch, context)
    from planner.export.openrlhf_import import import_openrlhf

    return import_openrlhf(launch, context)


def _pairs(values: tuple[str, ...], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise SpecError(f"expected NAME=VALUE, got {value!r}", key=flag)
        out[name.strip()] = rest
    return out


@click.command("import")
@click.argument("source", metavar="LAUNCH", type=click.Path(dir_okay=False))
@click.option("--from", "framework", type=click.Choice(sorted(MODULES)), required=True,
              help="The framework the launch runs (its overrides, arguments or run script).")
@click.option("--device", default=None,
              help="Device profile of the GPUs (hybridflow list devices); or give --job.")
@click.option("--job", "job_path", type=click.Path(dir_okay=False), default=None,
              help="A job YAML for what a launch does not say: models, cluster, response "
                   "lengths (a distribution prices closer than the launch's maximum).")
@click.option("--model", "models", multiple=True, metavar="ROLE=MODEL",
              help="The architecture of a role's model: a preset, spec YAML or config.json "
                   "(for checkpoints the import cannot read).")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="A shell variable the run script takes from outside.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write job.yaml and plan.json here (plan.json embeds the job).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def import_launch(source: str, framework: str, device: str | None, job_path: str | None,
                  models: tuple[str, ...], env: tuple[str, ...], out_dir: str | None,
                  as_json: bool) -> None:
    """Read a launch of verl, OpenRLHF or NeMo-RL (its overrides, arguments, run script, or a
    NeMo-RL recipe YAML) as a job and a plan and print its predicted step
    (stage by stage). A setting the planner does not price is refused in one line naming
    it; `plan --baseline OUT/plan.json` then shows what the best plan saves against it."""
    from planner.planning import evaluate
    from simulator.specs.job import load_job

    context = ImportContext(device=device, models=_pairs(models, "--model"),
                            job=load_job(job_path) if job_path else None,
                            base_dir=Path(source).resolve().parent)
    if device is not None:
        from profiles.device import load_profile

        try:
            load_profile(device)
        except SpecError as exc:
            raise SpecError(exc.problem, key="--device") from None
    job, plan = read_imported(source, framework, context, _pairs(env, "--env"))
    evaluated = evaluate(job, None, "imported", plan=plan)
    plan = replace(evaluated.plan, strategy="imported")
    simulation = evaluated.simulation
    if out_dir:
        out = Path(out_dir)
        write_text_atomic(out / "job.yaml", yaml.safe_dump(job.to_value(), sort_keys=False))
        plan.save(out / "plan.json")
    summary = {
        "source": source, "framework": framework, "algorithm": job.algorithm,
        "gpus": job.cluster.total_gpus, "device": job.cluster.device_label,
        "plan": plan.describe(), "mode": plan.mode,
        "feasible": simulation.feasible, "reasons": list(simulation.reasons),
        "iteration_seconds": simulation.iteration_seconds,
        "throughput_tokens_per_s": simulation.throughput_tokens_per_s,
        "stages": simulation.stage_seconds, "notes": context.notes,
        "files": [str(Path(out_dir) / n) for n in ("job.yaml", "plan.json")] if out_dir else [],
    }
    if as_json:
        click.echo(json_text(summary, default=str))
    else:
        _print(summary, job)
    if not simulation.feasible:
        sys.exit(1)


def _print(summary: dict[str, Any], job: Any) -> None:
    click.echo(f"{summary['framework']} launch {summary['source']}: "
               f"{job.algorithm.upper()} on {job.cluster.describe()}")
    click.echo(f"plan      {summary['plan']} (mode {summary['mode']})")
    if not summary["feasible"]:
        for reason in summary["reasons"]:
            click.echo(f"does not fit: {reason}")
        return
    click.echo(f"predicted {summary['iteration_seconds']:.2f} s per step   "
               f"{summary['throughput_tokens_per_s']:,.0f} tokens/s")
    click.echo("stages (seconds):")
    for name, seconds in summary["stages"].items():
        click.echo(f"  {name:<24} {seconds:10.2f}")
    for note in summary["notes"]:
        click.echo(f"note: {note}")
    if summary["files"]:
        click.echo(f"wrote {', '.join(summary['files'])}")
