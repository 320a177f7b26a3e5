"""``hybridflow export PLAN.json --to verl|openrlhf [--out DIR]``."""

from __future__ import annotations

from pathlib import Path

import click

from profiles.datafile import SpecError


@click.command("export")
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option("--to", "target", type=click.Choice(["verl", "openrlhf", "nemo-rl"]),
              required=True,
              help="The framework to launch the plan with (verl 0.9, OpenRLHF 0.11, NeMo-RL "
                   "0.7).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory to write the files to (default: export-TARGET beside the plan).")
def export(plan_path: str, target: str, out_dir: str | None) -> None:
    """Write a plan as another framework's launch: verl_overrides.txt + run_verl.sh,
    openrlhf_args.txt + run_openrlhf.sh, or nemo_rl_overrides.txt + run_nemo_rl.sh, with
    every setting the plan's price assumed. A placement the framework cannot express is
    refused with one line naming the part of the plan; a plan made for another framework is
    translated, each difference noted."""
    from planner.export import export_files, translation_for, write_files
    from simulator.plan import load_plan
    from simulator.specs.job import job_from_mapping

    plan = load_plan(plan_path)
    if plan.job is None:
        raise SpecError("the plan has no job (export reads the batch sizes from it)",
                        source=plan_path, key="job")
    job = job_from_mapping(plan.job, source=f"{plan_path} (job)")
    translation = translation_for(job, target)
    try:
        plan.validate(job)
        files = export_files(plan, job, target, plan_name=Path(plan_path).name,
                             translation=translation)
    except SpecError as exc:
        raise exc.within(source=plan_path) from None
    out = Path(out_dir) if out_dir else Path(plan_path).parent / f"export-{target}"
    for path in write_files(out, files):
        click.echo(str(path))
    if not translation.exact:
        click.echo(f"note: the plan was priced for framework {job.framework}; plan the job "
                   f"with framework: {target} for a price of this run", err=True)
        for note in translation.notes:
            click.echo(f"note: {note}", err=True)
