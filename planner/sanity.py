"""Warnings about a plan that is valid but probably not what the user meant: an iteration
longer than an hour (a batch typed with too many zeros), or GPUs idle most of the iteration
(a placement that waits on one model, or a cluster too large for the job)."""

from __future__ import annotations

from planner.planning import Evaluated
from simulator.plan import ROLLOUT_LABEL

LONG_ITERATION_SECONDS = 3600.0
"""An RLHF step over an hour: published recipes step in seconds to minutes (verl's DAPO
example, 512 prompts x 16 samples on 16 H20: about 10 minutes; validation_cases.yaml), so an
hour usually means a mistyped batch or length."""

MOSTLY_IDLE_FRACTION = 0.5
"""Share of the iteration the plan's GPUs, weighted by their number, do nothing."""


def plan_warnings(best: Evaluated | None) -> list[str]:
    """One line per thing worth a second look in the best plan (none: nothing)."""
    if best is None:
        return []
    out = []
    job = best.plan.job or {}
    seconds = best.iteration_seconds
    if seconds > LONG_ITERATION_SECONDS:
        work = job.get("workload", {})
        out.append(f"an iteration takes {seconds / 3600:.1f} hours ({seconds:,.0f} s): check "
                   f"workload.prompts_per_iteration ({work.get('prompts_per_iteration')}) "
                   f"and the response lengths")
    # The cluster's GPU time: each set busy or idle as simulated, GPUs outside the plan idle.
    gpus = {set_.label(): set_.gpus for set_ in best.plan.sets}
    if best.plan.rollout is not None:
        gpus[ROLLOUT_LABEL] = best.plan.rollout.gpus
    fractions = {label: f for label, f in best.simulation.idle_fraction.items() if label in gpus}
    used = sum(gpus[label] for label in fractions)
    # Paying for the GPUs used (--pay-for used), the others are not the plan's to fill.
    cluster = used if best.plan.predicted.get("paying_for") == "used" else \
        sum(group.get("nodes", 1) * group.get("gpus_per_node", 1)
            for group in _node_groups(job)) or used
    idle = (sum(gpus[label] * f for label, f in fractions.items()) + cluster - used) / cluster
    if idle > MOSTLY_IDLE_FRACTION:
        sets = ", ".join(f"{label} {fraction:.0%}" for label, fraction in fractions.items())
        unused = f"; {cluster - used} of the {cluster} GPUs hold no model" if used < cluster \
            else ""
        out.append(f"the cluster's GPUs are idle {idle:.0%} of the iteration (idle per set: "
                   f"{sets}{unused}): a smaller cluster (--gpus) may run it as fast, or one "
                   "model holds up the others")
    return out


def _node_groups(job: dict) -> list[dict]:
    cluster = job.get("cluster", {})
    return cluster.get("node_groups") or [cluster]
