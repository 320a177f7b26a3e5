"""What every export and import shares: the layout an export is read back into, how a plan
made for another framework is translated, and small helpers on plans and argument files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from profiles.datafile import SpecError, write_text_atomic
from profiles.framework import load_framework
from simulator.plan import Plan
from simulator.specs.job import JobSpec

TARGETS = ("verl", "openrlhf", "nemo-rl")


@dataclass(frozen=True, slots=True)
class Layout:
    """What an export must carry over: which roles share GPUs, how many GPUs each group has,
    each role's training (tp, pp, dp), the actor's generation (tp, pp) and the rollout GPUs."""

    sets: frozenset[tuple[frozenset[str], int]]
    """(roles, GPUs) of each colocated set."""
    parallel: tuple[tuple[str, tuple[int, int, int]], ...]
    """(role, (tp, pp, dp)), sorted by role."""
    generation: tuple[int, int]
    """The actor's generation (tp, pp)."""
    rollout_gpus: int
    """GPUs of the rollout set (0: the actor generates on its training GPUs)."""
    mode: str
    """sync, one_step_off or async."""
    max_staleness: int
    partial_rollout: bool
    experts: tuple[tuple[str, tuple[int, int]], ...] = ()
    """MoE: (role, (ep, etp)) of the roles with expert parallelism, sorted by role."""
    generation_ep: int = 1
    """MoE: the actor's expert-parallel serving size."""


@dataclass(slots=True)
class Translation:
    """How an export follows the plan. Exact (the plan was made in the target framework's own
    space): a setting the framework cannot express is refused, naming the plan key and the
    value that would work. Otherwise (a plan made for another framework) the nearest setting
    is written and each difference from what was priced is listed in ``notes``."""

    target: str
    """The framework written for (verl, openrlhf)."""
    exact: bool
    notes: list[str] = field(default_factory=list)

    def differ(self, problem: str, *, key: str, fix: str, written: str) -> None:
        """``problem`` with the plan at ``key``: refused (naming ``fix``) when exact, else
        noted (``written`` is what the export writes instead)."""
        if self.exact:
            raise SpecError(f"{problem}; {fix}", key=key)
        self.notes.append(f"{key}: {problem}; written as {written} (priced otherwise)")


def translation_for(job: JobSpec, target: str) -> Translation:
    """Exact when the job's framework has the target's search space (the target's own profile
    or one based on it), else a translation."""
    exact = job.framework_profile.space == load_framework(target).space
    return Translation(target=target, exact=exact)


def notes_comment(job: JobSpec, translation: Translation) -> str:
    """The script header's lines on how exactly the export follows the plan."""
    if translation.exact:
        return (f"# Every setting the plan's price assumed is written below (framework "
                f"{job.framework}).\n")
    lines = [f"# The plan was priced for framework {job.framework}, not {translation.target}; "
             "plan the job with", f"# framework: {translation.target} for a price of this run. "
             "Written differently from the plan:"]
    lines += [f"#   {note}" for note in translation.notes] or ["#   (nothing)"]
    return "\n".join(lines) + "\n"


def plan_layout(plan: Plan) -> Layout:
    """The layout a plan asks for."""
    gen = plan.roles["actor"].generation
    assert gen is not None
    return Layout(
        sets=frozenset((frozenset(s.roles), s.gpus) for s in plan.sets),
        parallel=tuple(sorted((role, (rp.parallel.tp, rp.parallel.pp, rp.parallel.dp))
                              for role, rp in plan.roles.items())),
        generation=(gen.tp, gen.pp),
        rollout_gpus=plan.rollout.gpus if plan.rollout is not None else 0,
        mode=plan.mode, max_staleness=plan.max_staleness,
        partial_rollout=plan.partial_rollout,
        experts=tuple(sorted((role, (rp.parallel.ep, rp.parallel.etp))
                             for role, rp in plan.roles.items()
                             if (rp.parallel.ep, rp.parallel.etp) != (1, 1))),
        generation_ep=gen.ep)


def nodes_of(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a set of ``gpus``: part of one node, or whole nodes (the
    plan's own rule for a set's shape)."""
    if gpus <= gpus_per_node:
        return 1, gpus
    return gpus // gpus_per_node, gpus_per_node


def set_key(plan: Plan, roles: tuple[str, ...]) -> str:
    """'sets[i]' of the set holding the first of ``roles``."""
    return f"sets[{plan.set_index(roles[0])}]"


def write_files(out_dir: str | Path, files: dict[str, str]) -> list[Path]:
    """Write each file atomically; shell scripts are made executable."""
    written = []
    for name, text in files.items():
        path = Path(out_dir) / name
        write_text_atomic(path, text)
        if name.endswith(".sh"):
            os.chmod(path, path.stat().st_mode | 0o111)
        written.append(path)
    return written


def read_argument_lines(text: str) -> list[str]:
    """The arguments of an exported argument file: one per line, blank lines and '#'
    comments skipped."""
    return [line for line in (raw.strip() for raw in text.splitlines())
            if line and not line.startswith("#")]
