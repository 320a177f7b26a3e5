"""``hybridflow validate``: every public case, measured against predicted."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    EXIT_DOES_NOT_FIT,
    _emit_json,
    cli,
)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def validate(as_json: bool) -> None:
    """Compare the cost models with published measurements."""
    from profiles.datafile import to_mapping
    from simulator.validation import run_validation

    table, groups = run_validation(bands=True)
    if as_json:
        _emit_json({
            "cases": table.to_dict(orient="records"),
            "groups": [{"group": g.group, "source": g.source, "cases": g.cases,
                        "mean_abs_error_pct": g.mean_abs_error_pct,
                        "median_abs_error_pct": g.median_abs_error_pct,
                        "max_abs_error_pct": g.max_abs_error_pct,
                        "bias_pct": g.bias_pct, "bias_direction": g.bias_direction,
                        "metric": g.metric,
                        "target_max_abs_error_pct": g.target_max_abs_error_pct,
                        "meets_target": g.meets_target,
                        "goal_median_abs_error_pct": g.goal_median_abs_error_pct,
                        "meets_goal": g.meets_goal,
                        "gate_mean_abs_error_pct": g.gate_mean_abs_error_pct,
                        "gate_max_abs_error_pct": g.gate_max_abs_error_pct,
                        "within_gate": g.within_gate,
                        "assumptions": list(g.assumptions),
                        "winners": list(g.winners),
                        "sample": g.sample_label,
                        "first_seen": None if g.first_seen is None else
                        to_mapping(g.first_seen),
                        "bands": [to_mapping(b) for b in g.bands]} for g in groups],
        })
    else:
        click.echo("error = (predicted - measured) / measured; bias = mean error, with what "
                   "its sign means for the group's metric")
        click.echo("out of sample (first seen, the cases added by a commit that changed no cost "
                   "model; simulator/data/validation_cases.yaml says how):")
        for g in groups:
            seen = g.first_seen
            if seen is not None and seen.cases_only:
                click.echo(f"  {g.group:<32} median |error| {seen.median_abs_error_pct:.1f}%, "
                           f"mean {seen.mean_abs_error_pct:.1f}%, max "
                           f"{seen.max_abs_error_pct:.1f}% at {seen.commit}; today "
                           f"{g.sample_label}: median {g.median_abs_error_pct:.1f}%")
        for g in groups:
            rows = table[table["group"] == g.group]
            click.echo(f"\n{g.group}  ({rows['metric'].iloc[0]})")
            click.echo(f"  source: {g.source}")
            for assumption in g.assumptions:
                click.echo(f"  assumption: {assumption}")
            click.echo(f"  {'case':<40} {'measured':>10} {'predicted':>10} {'error':>8}")
            for _, row in rows.iterrows():
                # A published stage timer of the case above (not in the group's statistics).
                label = f"  . {row['stage']}" if row["stage"] else row["case"]
                click.echo(f"  {label:<40} {row['measured']:>10.2f} "
                           f"{row['predicted']:>10.2f} {row['error_pct']:>+7.1f}%")
            target = ("" if g.target_max_abs_error_pct is None else
                      f"   target max <= {g.target_max_abs_error_pct:g}%: "
                      f"{'met' if g.meets_target else 'MISSED'}")
            goal = ("" if g.goal_median_abs_error_pct is None else
                    f"   goal median <= {g.goal_median_abs_error_pct:g}%: "
                    f"{'met' if g.meets_goal else 'MISSED'}")
            gate = (f"   gate {g.gate_mean_abs_error_pct:g}% / {g.gate_max_abs_error_pct:g}%: "
                    + ("held" if g.within_gate else "REGRESSED"))
            click.echo(f"  mean |error| {g.mean_abs_error_pct:.2f}%   median "
                       f"{g.median_abs_error_pct:.2f}%   max |error| "
                       f"{g.max_abs_error_pct:.2f}%   bias {g.bias_pct:+.2f}% ({g.bias_direction})"
                       f"{target}{goal}{gate}")
            seen = g.first_seen
            if seen is not None:
                how = "cases alone" if seen.cases_only else "with cost-model changes"
                click.echo(f"  first seen at {seen.commit} ({how}): mean |error| "
                           f"{seen.mean_abs_error_pct:.1f}%   median "
                           f"{seen.median_abs_error_pct:.1f}%   max {seen.max_abs_error_pct:.1f}%;"
                           f" today's figure is {g.sample_label}")
            for winner in g.winners:
                click.echo(f"  faster mode at {winner}")
            _echo_bands(g)
    if not all(g.passes for g in groups):
        sys.exit(EXIT_DOES_NOT_FIT)


def _echo_bands(group) -> None:
    """A group's error over each assumed input's plausible range (validation_bands)."""
    if not group.bands:
        return
    click.echo("  assumption bands (median |error| at each value; the other bands nominal):")
    for band in group.bands:
        values = ", ".join(f"{p.value or p.setting} {p.median_abs_error_pct:.1f}%"
                           for p in band.points)
        low, high = band.median_range
        max_low, max_high = band.max_range
        goal = f"; goal {band.goal}" if band.goal else ""
        where = f" ({band.key})" if band.key else ""
        click.echo(f"    {band.band}{where}: median {low:.1f}-{high:.1f}%, max "
                   f"{max_low:.1f}-{max_high:.1f}%{goal}")
        if band.key:
            click.echo(f"      at {values}")
            click.echo(f"      why this range: {' '.join(band.reason.split())}")
