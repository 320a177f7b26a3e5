"""``plan --baseline PLAN``: how much the searched plan saves against a plan the user already
runs (an imported launch, or any plan file), and why: the stages that got shorter or longer,
and what changed in the placement and the layouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.planning import Evaluated, evaluate
from simulator.plan import Plan
from simulator.specs.job import JobSpec

STAGES_SHOWN = 5
"""Stages listed in the explanation (the largest changes)."""


@dataclass(frozen=True, slots=True)
class BaselineComparison:
    """The best plan against the baseline."""

    baseline: Evaluated
    best: Evaluated | None
    stage_changes: tuple[tuple[str, float, float], ...] = ()
    """(stage, baseline seconds, best seconds), largest change first."""
    layout_changes: tuple[str, ...] = field(default=())
    """What differs between the two plans, one line each."""

    @property
    def saved_seconds(self) -> float | None:
        if self.best is None or not self.baseline.simulation.feasible:
            return None
        return self.baseline.iteration_seconds - self.best.iteration_seconds

    @property
    def saved_fraction(self) -> float | None:
        saved = self.saved_seconds
        if saved is None or self.baseline.iteration_seconds <= 0:
            return None
        return saved / self.baseline.iteration_seconds

    def to_value(self) -> dict[str, Any]:
        return {
            "baseline_plan": self.baseline.plan.describe(),
            "baseline_feasible": self.baseline.simulation.feasible,
            "baseline_iteration_seconds": self.baseline.iteration_seconds
            if self.baseline.simulation.feasible else None,
            "best_iteration_seconds": self.best.iteration_seconds if self.best else None,
            "saved_seconds": self.saved_seconds, "saved_fraction": self.saved_fraction,
            "stage_changes": [{"stage": s, "baseline_seconds": a, "best_seconds": b}
                              for s, a, b in self.stage_changes],
            "layout_changes": list(self.layout_changes),
        }

    def lines(self) -> list[str]:
        """The comparison as the CLI prints it."""
        base = self.baseline
        if not base.simulation.feasible:
            return [f"baseline {base.plan.describe()} does not fit: "
                    + "; ".join(base.simulation.reasons)]
        out = [f"baseline  {base.iteration_seconds:.2f} s/iter  {base.plan.describe()}"]
        if self.best is None:
            return out
        saved, fraction = self.saved_seconds, self.saved_fraction
        verb = "saves" if saved and saved > 0 else "costs"
        out.append(f"best      {self.best.iteration_seconds:.2f} s/iter: {verb} "
                   f"{abs(saved or 0):.2f} s per iteration ({abs(fraction or 0):.1%})")
        if self.stage_changes:
            out.append("where the time goes (baseline -> best, seconds):")
            out += [f"  {stage:<24} {a:9.2f} -> {b:9.2f}  ({b - a:+.2f})"
                    for stage, a, b in self.stage_changes]
        if self.layout_changes:
            out.append("what changes:")
            out += [f"  {line}" for line in self.layout_changes]
        return out


def compare_with_baseline(job: JobSpec, baseline: Plan, best: Evaluated | None
                          ) -> BaselineComparison:
    """Evaluate ``baseline`` on ``job`` and set it beside ``best``."""
    evaluated = evaluate(job, None, "baseline", plan=baseline)
    if best is None or not evaluated.simulation.feasible:
        return BaselineComparison(baseline=evaluated, best=best)
    before = evaluated.simulation.stage_seconds
    after = best.simulation.stage_seconds
    stages = sorted(set(before) | set(after),
                    key=lambda s: -abs(after.get(s, 0.0) - before.get(s, 0.0)))
    changes = tuple((s, before.get(s, 0.0), after.get(s, 0.0)) for s in stages
                    if abs(after.get(s, 0.0) - before.get(s, 0.0)) > 1e-9)[:STAGES_SHOWN]
    return BaselineComparison(baseline=evaluated, best=best, stage_changes=changes,
                              layout_changes=tuple(layout_differences(evaluated.plan,
                                                                      best.plan)))


def layout_differences(before: Plan, after: Plan) -> list[str]:
    """One line per difference: mode, placement and GPUs per set, each role's layout."""
    out = []
    if before.mode != after.mode:
        out.append(f"mode {before.mode_label()} -> {after.mode_label()}")
    sets_before = " | ".join(f"{s.label()} ({s.gpus})" for s in before.located_sets())
    sets_after = " | ".join(f"{s.label()} ({s.gpus})" for s in after.located_sets())
    if sets_before != sets_after:
        out.append(f"placement {sets_before} -> {sets_after}")
    for role in after.roles:
        if role not in before.roles:
            continue
        a, b = before.roles[role], after.roles[role]
        parts = []
        if a.parallel != b.parallel:
            parts.append(f"{_layout(a.parallel)} -> {_layout(b.parallel)}")
        if a.generation != b.generation and a.generation and b.generation:
            parts.append(f"generation {_generation(a.generation)} -> "
                         f"{_generation(b.generation)}")
        if parts:
            out.append(f"{role}: " + "; ".join(parts))
    return out


def _layout(par: Any) -> str:
    batches = (f"token budgets {par.micro_batch_tokens} / {par.infer_micro_batch_tokens}"
               if par.micro_batch_tokens or par.infer_micro_batch_tokens
               else f"micro-batch {par.micro_batch_size}")
    return f"{par.short()} {par.recompute} recompute, {batches}"


def _generation(gen: Any) -> str:
    return (f"{gen.short()} max_num_seqs {gen.max_num_seqs} gpu_memory_utilization "
            f"{gen.memory_utilization:g}")
