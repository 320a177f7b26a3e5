"""Warnings about a plan that is valid but probably not what the user meant: an iteration
longer than an hour (a batch typed with too many zeros), or GPUs idle most of the iteration
(a placement that waits on one model, or a cluster too large for the job)."""

from __future__ import annotations

from planner.planning import Evaluated
from simulator.plan import ROLLOUT_LABEL
from simulator.specs.job import JobSpec

LONG_ITERATION_SECONDS = 3600.0
"""An RLHF step over an hour: published recipes step in seconds to minutes (verl's DAPO
example, 512 prompts x 16 samples on 16 H20: about 10 minutes; validation_cases.yaml), so an
hour usually means a mistyped batch or length."""

MOSTLY_IDLE_FRACTION = 0.5
"""Share of the iteration the plan's GPUs, weighted by their number, do nothing."""


def plan_warnings(job: JobSpec, best: Evaluated | None) -> list[str]:
    """One line per thing worth a second look in ``job``'s best plan (none: nothing)."""
    if best is None:
        return []
    return [w for w in (_long_iteration(job, best), _mostly_idle(job, best)) if w]


def _long_iteration(job: JobSpec, best: Evaluated) -> str:
    seconds = best.iteration_seconds
    if seconds <= LONG_ITERATION_SECONDS:
        return ""
    return (f"an iteration takes {seconds / 3600:.1f} hours ({seconds:,.0f} s): check "
            f"workload.prompts_per_iteration ({job.workload.prompts_per_iteration}) and the "
            "response lengths")


def _mostly_idle(job: JobSpec, best: Evaluated) -> str:
    """The cluster's GPU time: each set busy or idle as simulated, GPUs outside the plan idle
    (paying for the GPUs used, --pay-for used, the others are not the plan's to fill)."""
    gpus = {set_.label(): set_.gpus for set_ in best.plan.sets}
    if best.plan.rollout is not None:
        gpus[ROLLOUT_LABEL] = best.plan.rollout.gpus
    fractions = {label: f for label, f in best.simulation.idle_fraction.items() if label in gpus}
    used = sum(gpus[label] for label in fractions)
    cluster = used if best.plan.predicted.get("paying_for") == "used" else \
        job.cluster.total_gpus
    if not cluster:
        return ""
    idle = (sum(gpus[label] * f for label, f in fractions.items()) + cluster - used) / cluster
    if idle <= MOSTLY_IDLE_FRACTION:
        return ""
    sets = ", ".join(f"{label} {fraction:.0%}" for label, fraction in fractions.items())
    unused = f"; {cluster - used} of the {cluster} GPUs hold no model" if used < cluster else ""
    if cluster == 1:  # no smaller cluster to suggest: the time goes outside the GPU
        return (f"the GPU is idle {idle:.0%} of the iteration: the work outside it (the "
                "controller's calls and computation) takes most of the time")
    return (f"the cluster's GPUs are idle {idle:.0%} of the iteration (idle per set: "
            f"{sets}{unused}): a smaller cluster (--gpus) may run it as fast, or one model "
            "holds up the others")
