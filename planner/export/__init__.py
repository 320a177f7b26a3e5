"""Export a plan to the configuration of widely used RLHF trainers (verl, OpenRLHF).

An export reads a plan (and the job it embeds) and writes what a user needs to launch that
plan with the other framework: a file of arguments, one per line, exactly as passed on the
command line, and a runnable shell script that passes them. It never imports the search, and
it never changes the plan: a placement or layout the framework cannot express by its
configuration is refused with one line naming the part of the plan (a SpecError with a key).

Both targets read their own files back (``parse_*``) into a :class:`Layout`, the placement
and parallel sizes, so the tests can check that an export round-trips.
"""

from __future__ import annotations

from planner.export.common import (
    TARGETS,
    Layout,
    Translation,
    nodes_of,
    notes_comment,
    plan_layout,
    read_argument_lines,
    set_key,
    translation_for,
    write_files,
)
from planner.export.nemo_rl import nemo_rl_files
from planner.export.openrlhf import openrlhf_files
from planner.export.verl import verl_files
from profiles.datafile import SpecError
from simulator.plan import Plan
from simulator.specs.job import JobSpec

__all__ = ["TARGETS", "Layout", "Translation", "export_files", "nodes_of", "notes_comment",
           "plan_layout", "read_argument_lines", "set_key", "translation_for", "write_files"]


def export_files(plan: Plan, job: JobSpec, target: str, *, plan_name: str = "plan.json",
                 translation: Translation | None = None) -> dict[str, str]:
    """File name -> text of the export of ``plan`` to ``target`` (raises SpecError, naming
    the part of the plan, when the framework cannot express it; ``translation`` collects how
    a plan made for another framework was written differently)."""
    if target == "verl":
        return verl_files(plan, job, plan_name=plan_name, translation=translation)
    if target == "openrlhf":
        return openrlhf_files(plan, job, plan_name=plan_name, translation=translation)
    if target == "nemo-rl":
        return nemo_rl_files(plan, job, plan_name=plan_name, translation=translation)
    raise SpecError(f"unknown target {target!r} (choose {' or '.join(TARGETS)})", key="--to")
