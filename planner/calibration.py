"""Close the loop: read executor runs, predict them with the simulator, fit a profile's free
parameters to the measurements (``calibrate``) and measure the prediction error
(``accuracy``).

A run directory holds ``measurements.csv`` (one row per stage per iteration), ``metrics.csv``
(response lengths per iteration) and ``meta.json`` (plan, job, options). The simulator predicts
each iteration with the job as it ran: the task's prompt length, the response lengths measured
in that iteration, fp32 on CPUs, and the profile under test.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from profiles.datafile import SpecError, read_mapping, read_text_file
from profiles.device import DeviceProfile, Provenance, register_profile
from profiles.framework import FixedCosts, load_framework
from simulator.asynchronous import SYNC_NODE, generate_names, steady_step_seconds, sync_seconds
from simulator.engine import iteration_seconds
from simulator.plan import Plan, plan_from_mapping
from simulator.predict import estimate_plan
from simulator.specs.job import JobSpec, job_from_mapping
from simulator.specs.lengths import LengthDistribution

EXECUTOR_FRAMEWORK = "hybridflow"
"""The framework profile of ``hybridflow execute`` (profiles/frameworks/hybridflow.yaml)."""

MEASUREMENT_FIELDS: dict[str, Callable[[str], Any]] = {
    "iteration": int, "node": str, "role": str, "operation": str, "location": int,
    "set": str, "gpus": int, "wall_seconds": float, "compute_seconds": float,
}
"""Columns calibration needs, with their types (other columns are kept as text)."""


@dataclass(frozen=True)
class Run:
    """One executor run, validated."""

    path: Path
    plan: Plan
    job: JobSpec
    prompt_length: int
    measurements: pd.DataFrame
    length_counts: dict[int, dict[int, int]]
    """iteration -> {response length: count}."""
    greedy_counts: dict[int, dict[int, int]] = field(default_factory=dict)
    """iteration -> {greedy response length: count} (ReMax)."""
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    """iteration -> mean prompt length in tokens, where prompts differ (the user's data)."""
    framework: str = EXECUTOR_FRAMEWORK
    """The framework profile that ran it: this project's executor, or the job's framework for
    a run read from another trainer's log (planner/verl_log.py)."""

    @property
    def label(self) -> str:
        return f"{self.path.name} ({self.plan.placement})"


def _read_csv(path: Path, fields: dict[str, Callable[[str], Any]],
              optional: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a CSV with the named fields parsed; errors name the file, line and field."""
    text = read_text_file(path, what="UTF-8 CSV")
    if text and not text.endswith("\n"):
        # The executor writes whole lines; a last row without its line end was cut short.
        raise SpecError(f"line {text.count(chr(10)) + 1}: the last row has no line end (the "
                        "file is truncated)", source=str(path))
    rows = []
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if not header:
            raise SpecError("empty file (no header line)", source=str(path))
        missing = [f for f in fields if f not in header]
        if missing:
            raise SpecError(f"line 1: missing column {missing[0]!r}", source=str(path))
        for line, values in enumerate(reader, start=2):
            if not values:
                continue
            if len(values) != len(header):
                raise SpecError(f"line {line}: {len(values)} fields, expected {len(header)} "
                                "(truncated or corrupt row)", source=str(path))
            row: dict[str, Any] = dict(zip(header, values, strict=True))
            for name, parse in fields.items():
                text = row[name]
                if text == "" and name in optional:
                    row[name] = None
                    continue
                try:
                    row[name] = parse(text)
                except ValueError:
                    raise SpecError(f"line {line}: {name}: expected {parse.__name__}, got "
                                    f"{text!r}", source=str(path)) from None
                if parse is float and not math.isfinite(row[name]):
                    raise SpecError(f"line {line}: {name}: not a finite number",
                                    source=str(path))
                if name.endswith("_seconds") and row[name] < 0:
                    raise SpecError(f"line {line}: {name}: a duration cannot be negative, got "
                                    f"{text}", source=str(path))
            rows.append(row)
    if not rows:
        raise SpecError("no rows", source=str(path))
    return rows


def read_run_meta(meta_path: Path) -> tuple[dict[str, Any], Plan, JobSpec]:
    """A run's meta.json: the whole mapping, its plan and its job, checked against each
    other (errors name meta.json and the key)."""
    meta = read_mapping(meta_path)
    for key in ("plan", "job", "options"):
        if key not in meta:
            raise SpecError("missing key", key=key, source=str(meta_path))
        if not isinstance(meta[key], dict):
            raise SpecError(f"expected a mapping, got {type(meta[key]).__name__}", key=key,
                            source=str(meta_path))
    plan = plan_from_mapping(meta["plan"], source=f"{meta_path} (plan)")
    job = job_from_mapping(meta["job"], source=f"{meta_path} (job)")
    try:
        plan.validate(job)
    except SpecError as exc:  # a plan and job that never ran together
        raise exc.within("plan", source=str(meta_path)) from None
    return meta, plan, job


def load_run(directory: str | Path) -> Run:
    """Read and validate a run directory written by ``hybridflow execute``."""
    path = Path(directory)
    if not path.is_dir():
        raise SpecError("not a run directory", source=str(path))
    meta_path = path / "meta.json"
    meta, plan, job = read_run_meta(meta_path)
    task = meta["options"].get("task", {})
    if not isinstance(task, dict):
        raise SpecError(f"expected a mapping, got {type(task).__name__}", key="options.task",
                        source=str(meta_path))
    # The built-in task's prompts are BOS, its digits and SEP; the user's data's (meta.json's
    # "data", or the options' task in runs written before 2026-11-27) come from each
    # iteration's measured prompt tokens.
    prompt_length = int(task.get("digits", 3)) + 2
    user_data = "data" in meta or "data" in task
    rows = _read_csv(path / "measurements.csv", MEASUREMENT_FIELDS,
                     optional=("compute_seconds",))
    measurements = pd.DataFrame(rows)
    metrics = _read_csv(path / "metrics.csv", {"iteration": int,
                                               "response_length_counts": str})
    counts: dict[int, dict[int, int]] = {}
    greedy: dict[int, dict[int, int]] = {}
    prompts: dict[int, int] = {}
    for line, row in enumerate(metrics, start=2):
        if user_data and row.get("prompt_tokens"):
            try:
                prompts[row["iteration"]] = max(1, round(float(row["prompt_tokens"])))
            except ValueError:
                raise SpecError(f"line {line}: prompt_tokens: expected a number, got "
                                f"{row['prompt_tokens']!r}",
                                source=str(path / "metrics.csv")) from None
        for column, target in (("response_length_counts", counts),
                               ("greedy_length_counts", greedy)):
            if not row.get(column):
                continue
            try:
                raw = json.loads(row[column])
                lengths = {int(k): int(v) for k, v in raw.items()}
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                raise SpecError(f"line {line}: {column}: not a JSON mapping of length -> "
                                "count", source=str(path / "metrics.csv")) from None
            if any(n < 0 or c < 0 for n, c in lengths.items()) or not sum(lengths.values()):
                raise SpecError(f"line {line}: {column}: lengths and counts must be >= 0 with "
                                f"at least one response, got {row[column]}",
                                source=str(path / "metrics.csv"))
            target[row["iteration"]] = lengths
    return Run(path=path, plan=plan, job=job, prompt_length=prompt_length,
               measurements=measurements, length_counts=counts, greedy_counts=greedy,
               prompt_tokens=prompts)


def iteration_job(run: Run, iteration: int, profile: DeviceProfile | str, *,
                  fixed_costs: FixedCosts | None = None) -> JobSpec:
    """The job as iteration ``iteration`` of ``run`` ran it, on ``profile`` (with
    ``fixed_costs`` in place of its framework profile's, when given)."""
    counts = run.length_counts.get(iteration)
    if not counts:
        raise SpecError(f"no response lengths for iteration {iteration}",
                        source=str(run.path / "metrics.csv"))
    greedy = run.greedy_counts.get(iteration)
    workload = replace(run.job.workload,
                       prompt_length=run.prompt_tokens.get(iteration, run.prompt_length),
                       response_length=_empirical(counts),
                       greedy_response_length=_empirical(greedy) if greedy else None)
    rule_cost = _rule_seconds_per_sample(run, iteration)
    if rule_cost is not None:
        # A rule's time is the user's function's, an input like the response lengths.
        workload = replace(workload, rule_reward_seconds_per_sample=rule_cost)
    device = profile if isinstance(profile, str) else register_profile(profile)
    cluster = run.job.cluster
    group = replace(cluster.only_group(), device=device)
    # An executor run is this project's executor's behaviour, whatever framework the job was
    # planned for; a verl log's is the job's framework.
    return replace(run.job, workload=workload, cluster=replace(cluster, node_groups=(group,)),
                   framework=run.framework, framework_fixed_costs=fixed_costs)


def _rule_seconds_per_sample(run: Run, iteration: int) -> float | None:
    """Seconds per sample the run's rule reward or cost took in ``iteration`` (None when the
    job has no rule role)."""
    rules = run.job.rule_roles
    if not rules:
        return None
    frame = run.measurements
    rows = frame[(frame["iteration"] == iteration) & frame["role"].isin(rules)]
    if rows.empty or "sequences" not in rows.columns:
        return None
    sequences = pd.to_numeric(rows["sequences"], errors="coerce").sum()
    if not sequences or sequences != sequences:
        return None
    return float(rows["wall_seconds"].sum() / sequences)


def _empirical(counts: dict[int, int]) -> LengthDistribution:
    total = sum(counts.values())
    lengths = tuple(sorted(counts))
    return LengthDistribution(distribution="empirical", csv="measured", lengths=lengths,
                              weights=tuple(counts[n] / total for n in lengths))


# ----- prediction --------------------------------------------------------------------------


def _measured_stages(run: Run, iteration: int) -> dict[str, float]:
    frame = run.measurements[run.measurements["iteration"] == iteration]
    stages: dict[str, float] = {}
    for row in frame.to_dict(orient="records"):
        key = "wall_seconds" if row["node"] == "iteration" else "compute_seconds"
        stages[row["node"]] = float(row[key])
    return stages


def predicted_stages(run: Run, iteration: int, profile: DeviceProfile, *,
                     fixed_costs: FixedCosts | None = None) -> dict[str, float]:
    """The simulator's seconds for every stage of one iteration, and for the iteration."""
    job = iteration_job(run, iteration, profile, fixed_costs=fixed_costs)
    estimate = estimate_plan(job, run.plan)
    # A stage's measured compute starts when its workers have their data: the driver's
    # dispatch (a framework's controller settings) is not in it, only in the iteration.
    predicted = {name: n.seconds - n.detail.get("dispatch_seconds", 0.0)
                 for name, n in estimate.nodes.items()}
    if estimate.transition is not None:
        predicted["actor.transition"] = estimate.transition.seconds
    if run.plan.mode == "sync":
        predicted["iteration"] = iteration_seconds(job, estimate)
    else:
        # Off-policy: the weight sync after each update, and the steady-state step (the
        # busier of the rollout set and the trainer), which every iteration after the
        # first one is.
        predicted[SYNC_NODE] = sync_seconds(estimate)
        predicted["iteration"] = steady_step_seconds(job, estimate)
    return predicted


def predict(run: Run, profile: DeviceProfile, *, skip: int = 1,
            fixed_costs: FixedCosts | None = None) -> list[dict[str, Any]]:
    """Predicted and measured seconds of every stage and iteration of ``run`` (from iteration
    ``skip`` on; the first iterations pay one-off start-up costs), with ``fixed_costs`` in
    place of the framework profile's when given."""
    rows = []
    backends = _backends(run)
    off_policy = run.plan.mode != "sync"
    generates = set(generate_names(run.job)) if off_policy else set()
    predictions: dict[int, dict[str, float]] = {}

    def predicted_at(iteration: int) -> dict[str, float]:
        if iteration not in predictions:
            predictions[iteration] = predicted_stages(run, iteration, profile,
                                                      fixed_costs=fixed_costs)
        return predictions[iteration]

    for iteration in sorted(run.length_counts):
        if iteration < skip:
            continue
        predicted = predicted_at(iteration)
        # Off-policy, the generation measured in iteration i is of batch i + 1 (made while
        # batch i trains): it is predicted with that batch's lengths.
        ahead = predicted_at(iteration + 1) if off_policy and \
            iteration + 1 in run.length_counts else predicted
        for node, measured in _measured_stages(run, iteration).items():
            if node not in predicted or measured <= 0:
                continue  # nothing ran (a transition with nothing to gather)
            seconds = ahead[node] if node in generates else predicted[node]
            rows.append({"run": str(run.path), "placement": run.plan.placement,
                         "iteration": iteration, "node": node, "measured_seconds": measured,
                         "predicted_seconds": seconds,
                         "error_pct": 100.0 * (seconds - measured) / measured,
                         "backend": backends.get(node, "")})
    return rows


def run_summary(run: Run, profile: DeviceProfile, *, skip: int = 1) -> list[dict[str, Any]]:
    """Per stage and for the whole iteration: the median measured and predicted seconds over
    the run's iterations (from ``skip`` on, or all when the run is shorter), and the error.
    Predictions are for the lengths the run produced, so both describe the same work."""
    iterations = sorted(run.length_counts)
    rows = predict(run, profile, skip=skip if len(iterations) > skip else 0)
    if not rows:
        return []
    frame = pd.DataFrame(rows)
    out = []
    for node, group in frame.groupby("node", sort=False):
        measured = float(group["measured_seconds"].median())
        predicted = float(group["predicted_seconds"].median())
        out.append({"node": str(node), "measured_seconds": measured,
                    "predicted_seconds": predicted,
                    "error_pct": 100.0 * (predicted - measured) / measured,
                    "iterations": int(group["iteration"].nunique())})
    # The whole iteration last, the stages in the order they ran.
    return sorted(out, key=lambda r: r["node"] == "iteration")


def _backends(run: Run) -> dict[str, str]:
    """node -> the backend that ran it (the ``backend`` column; runs recorded before it
    existed ran torch training and native generation)."""
    frame = run.measurements
    if "backend" in frame.columns:
        pairs = frame[["node", "backend"]].drop_duplicates("node")
        return {str(n): str(b) for n, b in zip(pairs["node"], pairs["backend"], strict=True)}
    return {str(n): "controller" if str(o) == "compute" or str(r) == "controller" else
            ("native" if str(o) in ("generate", "transition") else "torch")
            for n, o, r in zip(frame["node"], frame["operation"], frame["role"], strict=True)}


# ----- parameters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """A free parameter of a profile: how to read it and how to set it. A device parameter
    reads and sets a ``DeviceProfile``; a framework parameter the framework profile's
    ``FixedCosts``."""

    name: str
    get: Callable[[Any], float]
    set: Callable[[Any, float], Any]
    lower: float
    upper: float
    initial: float
    """Starting point when the profile's value is 0 (fitting happens in log space)."""
    target: str = "device"
    """'device' (the GPU profile) or 'framework' (the framework profile's fixed costs)."""


def _overhead(name: str, initial: float) -> Parameter:
    return Parameter(
        name=name, get=lambda p: getattr(p.overheads, name),
        set=lambda p, v: replace(p, overheads=replace(p.overheads, **{name: v})),
        lower=1e-8, upper=1.0, initial=initial)


def _correction(name: str) -> Parameter:
    return Parameter(
        name=name, get=lambda p: p.correction(name),
        set=lambda p, v: replace(p, corrections={**p.corrections, name: v}),
        lower=0.05, upper=50.0, initial=1.0)


PARAMETERS: dict[str, Parameter] = {p.name: p for p in (
    _overhead("kernel_launch_seconds", 1e-5), _overhead("decode_step_seconds", 1e-3),
    _overhead("iteration_seconds", 1e-3), _overhead("fsdp_unit_seconds", 1e-4),
    _overhead("call_seconds", 1e-3), _overhead("operation_seconds", 1e-3),
    Parameter(name="shared_host_slowdown",
              get=lambda p: p.overheads.shared_host_slowdown,
              set=lambda p, v: replace(p, overheads=replace(p.overheads,
                                                            shared_host_slowdown=v)),
              lower=1.0, upper=4.0, initial=1.2),
    _correction("train_compute"), _correction("infer_compute"),
    _correction("prefill_compute"), _correction("decode"), _correction("collective"),
    _correction("train_collective"), _correction("expert_imbalance"),
)}
"""Every device-profile parameter ``calibrate`` can fit (``--fit`` chooses a subset)."""


FRAMEWORK_PREFIX = "framework."


def _fixed_cost(name: str, initial: float) -> Parameter:
    return Parameter(
        name=FRAMEWORK_PREFIX + name, get=lambda f: getattr(f, name),
        set=lambda f, v: replace(f, **{name: v}), lower=1e-8, upper=10.0, initial=initial,
        target="framework")


FRAMEWORK_PARAMETERS: dict[str, Parameter] = {p.name: p for p in (
    _fixed_cost("call_seconds", 1e-2), _fixed_cost("optimizer_step_seconds", 1e-2),
    _fixed_cost("micro_batch_seconds", 1e-3), _fixed_cost("iteration_seconds", 1e-1),
)}
"""The framework profile's fixed costs ``calibrate --fit framework.NAME`` can fit; the fit
writes them to a framework profile (``--framework-out``) that names the runs' framework as
its base."""

SAME_TERM = {"framework.call_seconds": "call_seconds",
             "framework.optimizer_step_seconds": "iteration_seconds"}
"""Framework fixed costs that add to the same term as a device overhead: fitting both would
leave their split undetermined."""


@dataclass(frozen=True)
class CalibrationResult:
    profile: DeviceProfile
    values: dict[str, float]
    residual_before: float
    residual_after: float
    rows: int
    runs: tuple[str, ...] = field(default_factory=tuple)
    at_bounds: dict[str, str] = field(default_factory=dict)
    """Parameter -> 'lower' or 'upper' for the fitted values that ended at a bound."""
    held_out_before: dict[str, Any] | None = None
    """``accuracy`` of the base profile on the held-out runs (when given)."""
    held_out_after: dict[str, Any] | None = None
    """``accuracy`` of the fitted profile on the held-out runs (when given)."""
    objective_before: float = 0.0
    """Root mean square of the weighted log errors the fit minimises, at the base profile."""
    objective_after: float = 0.0
    """...and at the fitted profile (never larger: the fit starts at the base)."""
    framework: str | None = None
    """The runs' framework profile, when framework fixed costs were fitted."""
    fixed_costs: FixedCosts | None = None
    """The fitted fixed costs of that framework (the rest of it is unchanged)."""


def _apply(profile: DeviceProfile, params: Sequence[Parameter], x: np.ndarray,
           fixed: FixedCosts | None = None) -> tuple[DeviceProfile, FixedCosts | None]:
    """The device profile and framework fixed costs with ``params`` set to ``exp(x)``."""
    for param, value in zip(params, np.exp(x), strict=True):
        if param.target == "framework":
            fixed = param.set(fixed, float(value))
        else:
            profile = param.set(profile, float(value))
    return profile, fixed


FLOOR_SECONDS = 1e-3
"""Stages are compared as log((predicted + floor) / (measured + floor)): a stage of a few
microseconds (a transition with nothing to gather) must not outweigh the seconds that matter."""


def _log_errors(runs: Sequence[Run], profile: DeviceProfile, skip: int,
                fixed: FixedCosts | None = None) -> np.ndarray:
    errors = []
    for run in runs:
        for row in predict(run, profile, skip=skip, fixed_costs=fixed):
            weight = 2.0 if row["node"] == "iteration" else 1.0
            errors.append(weight * math.log((row["predicted_seconds"] + FLOOR_SECONDS)
                                            / (row["measured_seconds"] + FLOOR_SECONDS)))
    return np.array(errors)


def _rms_relative(runs: Sequence[Run], profile: DeviceProfile, skip: int,
                  fixed: FixedCosts | None = None) -> float:
    """Relative RMS error of stage and iteration times (with the same floor)."""
    rows = [r for run in runs for r in predict(run, profile, skip=skip, fixed_costs=fixed)]
    return float(np.sqrt(np.mean([
        ((r["predicted_seconds"] - r["measured_seconds"])
         / (r["measured_seconds"] + FLOOR_SECONDS)) ** 2 for r in rows])))


BOUND_TOLERANCE = 0.01
"""A fitted value within this fraction of its allowed range (in log space) from a bound counts
as at the bound (e.g. an overhead within a factor 1.2 of its 1e-8 s floor)."""


def calibrate(runs: Sequence[Run], base: DeviceProfile, *, fit: Sequence[str] | None = None,
              skip: int = 1, name: str | None = None,
              held_out: Sequence[Run] = ()) -> CalibrationResult:
    """Least-squares fit (scipy, log space) of ``fit`` parameters to the runs' stage and
    iteration times. Refuses when the runs do not constrain a parameter, and, given
    ``held_out`` runs, when the fitted profile predicts them worse (per-plan median |error|)
    than ``base`` does. Parameters that end at a bound are reported in ``at_bounds`` and in
    the profile's provenance."""
    from scipy.optimize import least_squares

    chosen = _chosen_parameters(runs, fit, skip)
    every = {**PARAMETERS, **FRAMEWORK_PARAMETERS}
    fits_framework = any(k in FRAMEWORK_PARAMETERS for k in chosen)
    framework = _runs_framework([*runs, *held_out]) if fits_framework else None
    base_fixed = load_framework(framework).fixed_costs if framework else None
    if "call_seconds" not in chosen and "framework.call_seconds" not in chosen:
        # Measured, not fitted: the controller's dispatch + collect of calls that did not
        # wait behind another call on their set (generations and updates).
        base = PARAMETERS["call_seconds"].set(base, measured_call_seconds(runs))
    params = [every[k] for k in chosen]

    def value_of(param: Parameter) -> float:
        return param.get(base_fixed if param.target == "framework" else base)

    x0 = np.log([value_of(p) if value_of(p) > 0 else p.initial for p in params])
    lower = np.log([p.lower for p in params])
    upper = np.log([p.upper for p in params])
    x0 = np.clip(x0, lower + 1e-9, upper - 1e-9)

    def residuals(x: np.ndarray) -> np.ndarray:
        profile, fixed = _apply(base, params, x, base_fixed)
        return _log_errors(runs, profile, skip, fixed)

    before = _rms_relative(runs, base, skip, base_fixed)
    start = residuals(x0)
    _refuse_unconstrained(params, residuals, x0, start)
    solution = least_squares(residuals, x0, bounds=(lower, upper), x_scale="jac",
                             diff_step=1e-3, max_nfev=200)
    fitted, fitted_fixed = _apply(base, params, solution.x, base_fixed)
    after = _rms_relative(runs, fitted, skip, fitted_fixed)
    values = {p.name: float(v) for p, v in zip(params, np.exp(solution.x), strict=True)}
    at_bounds = _at_bounds(params, solution.x, lower, upper)
    if "call_seconds" not in values and "framework.call_seconds" not in values:
        values["call_seconds (measured)"] = fitted.overheads.call_seconds
    held_before = held_after = None
    if held_out:
        held_before = accuracy(held_out, base, skip=skip, fixed_costs=base_fixed)
        held_after = accuracy(held_out, fitted, skip=skip, fixed_costs=fitted_fixed)
        _refuse_worse_on_held_out(held_before, held_after, len(held_out), base.name)
    provenance = _fit_provenance(runs, base, before=before, after=after, values=values,
                                 at_bounds=at_bounds,
                                 accuracy_record=_held_out_record(held_before, held_after,
                                                                  len(held_out)))
    fitted = replace(fitted, name=name or f"{base.name}-calibrated", provenance=provenance)
    return CalibrationResult(profile=fitted, values=values, residual_before=before,
                             residual_after=after,
                             rows=sum(len(predict(r, base, skip=skip)) for r in runs),
                             runs=tuple(str(r.path) for r in runs), at_bounds=at_bounds,
                             held_out_before=held_before, held_out_after=held_after,
                             objective_before=float(np.sqrt(np.mean(start ** 2))),
                             objective_after=float(np.sqrt(np.mean(
                                 residuals(solution.x) ** 2))),
                             framework=framework, fixed_costs=fitted_fixed)


def _chosen_parameters(runs: Sequence[Run], fit: Sequence[str] | None, skip: int) -> list[str]:
    """The parameters to fit (all the device's but the measured call_seconds when ``fit`` is
    empty), after checking that the runs leave iterations to fit and the names exist and do
    not add to one term."""
    if not runs:
        raise SpecError("give at least one run directory", key="runs")
    if not any(i >= skip for run in runs for i in run.length_counts):
        longest = max(len(run.length_counts) for run in runs)
        raise SpecError(f"skipping the first {skip} iteration(s) leaves nothing to fit (the "
                        f"longest run has {longest})", key="--skip")
    chosen = list(fit) if fit else [k for k in PARAMETERS if k != "call_seconds"]
    every = {**PARAMETERS, **FRAMEWORK_PARAMETERS}
    for key in chosen:
        if key not in every:
            raise SpecError(f"unknown parameter {key!r} (allowed: {', '.join(every)})",
                            key="--fit")
    for key, device_key in SAME_TERM.items():
        if key in chosen and device_key in chosen:
            raise SpecError(f"{key} and {device_key} add to the same term: fit one of them",
                            key="--fit")
    return chosen


def _refuse_unconstrained(params: Sequence[Parameter],
                          residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray,
                          start: np.ndarray) -> None:
    """A parameter whose doubling changes no residual is not constrained by the runs."""
    unconstrained = []
    for i, param in enumerate(params):
        doubled = x0.copy()
        doubled[i] += math.log(2.0)
        if np.max(np.abs(residuals(doubled) - start)) < 1e-6:
            unconstrained.append(param.name)
    if unconstrained:
        raise SpecError(
            f"the runs do not constrain {', '.join(unconstrained)}: no measured stage changes "
            "when it doubles (collective needs runs with tp or dp > 1; decode_step_seconds "
            "needs generation; framework.iteration_seconds the controller's stage or the whole "
            "step). Leave it out with --fit "
            + ",".join(p.name for p in params if p.name not in unconstrained), key="--fit")


def _at_bounds(params: Sequence[Parameter], x: np.ndarray, lower: np.ndarray,
               upper: np.ndarray) -> dict[str, str]:
    """The parameters whose fitted log value is within BOUND_TOLERANCE of a bound."""
    at_bounds = {}
    for param, value, low, high in zip(params, x, lower, upper, strict=True):
        margin = BOUND_TOLERANCE * (high - low)
        if value <= low + margin:
            at_bounds[param.name] = "lower"
        elif value >= high - margin:
            at_bounds[param.name] = "upper"
    return at_bounds


def _refuse_worse_on_held_out(before: dict, after: dict, runs: int, base_name: str) -> None:
    if after["median_abs_error_pct"] > before["median_abs_error_pct"]:
        raise SpecError(
            f"refusing to write the fit: on the {runs} held-out run(s) its median "
            f"|error| per plan is {after['median_abs_error_pct']:.1f}%, worse than "
            f"{before['median_abs_error_pct']:.1f}% of {base_name} unfitted (the fit "
            "describes its own runs only: fit on more varied runs or fewer parameters)",
            key="--held-out")


def _held_out_record(before: dict | None, after: dict | None, runs: int) -> dict[str, float]:
    """The held-out accuracy the profile's provenance keeps (empty without held-out runs)."""
    if before is None or after is None:
        return {}
    record = {
        "median_abs_error_pct": after["median_abs_error_pct"],
        "max_abs_error_pct": after["max_abs_error_pct"],
        "bias_pct": after["bias_pct"],
        "held_out_runs": float(runs),
        "held_out_plans": float(after["plans"]),
        "unfitted_median_abs_error_pct": before["median_abs_error_pct"]}
    if after["kendall_tau"] is not None:
        record["kendall_tau"] = after["kendall_tau"]
    return record


def _fit_provenance(runs: Sequence[Run], base: DeviceProfile, *, before: float, after: float,
                    values: dict[str, float], at_bounds: dict[str, str],
                    accuracy_record: dict[str, float]) -> Provenance:
    from planner.provenance import code_fingerprint, executor_fingerprint, git_commit

    now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    bounds_note = ("; at a bound: " + ", ".join(f"{k} ({v})" for k, v in at_bounds.items())
                   if at_bounds else "")
    return Provenance(
        source=f"calibrated from {len(runs)} executor run(s) on top of {base.name}",
        fitted_on=tuple(str(r.path) for r in runs), fitted_at=now,
        residual_before=before, residual_after=after, accuracy=accuracy_record,
        parameters_at_bounds=tuple(f"{k}={v}" for k, v in at_bounds.items()),
        commit=git_commit(), code_fingerprint=code_fingerprint(),
        executor_fingerprint=executor_fingerprint(),
        notes=f"fitted {', '.join(f'{k}={v:.4g}' for k, v in values.items())}"
              f"{bounds_note}; base provenance: {base.provenance.source}")


def _runs_framework(runs: Sequence[Run]) -> str:
    """The one framework profile that ran ``runs`` (fixed costs are a framework's own)."""
    frameworks = sorted({run.framework for run in runs})
    if len(frameworks) != 1:
        raise SpecError(f"the runs were made by different frameworks ({', '.join(frameworks)}): "
                        "fit a framework's fixed costs on its own runs", key="--fit")
    return frameworks[0]


def measured_call_seconds(runs: Sequence[Run]) -> float:
    """Median dispatch seconds (wall minus compute) of generation and update calls."""
    values = []
    for run in runs:
        frame = run.measurements
        chosen = frame[frame["operation"].isin(["generate", "update"])]
        values.extend((chosen["wall_seconds"] - chosen["compute_seconds"]).tolist())
    values = [v for v in values if v == v and v >= 0]
    return float(np.median(values)) if values else 0.0


def run_name(run: Run) -> str:
    """How rows and reports name a run: its directory's name, or parent/name for the usual
    layout where every run directory is called ``run``."""
    return run.path.name if run.path.name != "run" else f"{run.path.parent.name}/run"


def plan_groups(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs grouped by the plan they ran (repeats of one plan form one group), keyed by the
    first run's name, in the order the runs were given."""
    groups: dict[str, list[Run]] = {}
    names: dict[str, str] = {}
    for run in runs:
        identity = json.dumps(run.plan.to_value(), sort_keys=True)
        if identity not in names:
            name = run_name(run)
            while name in groups:  # two plans, runs of the same name
                name += "'"
            names[identity] = name
        groups.setdefault(names[identity], []).append(run)
    return groups


def _signed_summary(errors: Sequence[float]) -> dict[str, float]:
    """Median and max of |error| and the mean signed error (bias: > 0 predicts too slow)."""
    if not len(errors):
        return {"median_abs_error_pct": 0.0, "max_abs_error_pct": 0.0, "bias_pct": 0.0}
    values = np.asarray(errors, dtype=float)
    return {"median_abs_error_pct": float(np.median(np.abs(values))),
            "max_abs_error_pct": float(np.max(np.abs(values))),
            "bias_pct": float(np.mean(values))}


def accuracy(runs: Sequence[Run], profile: DeviceProfile, *, skip: int = 1,
             fixed_costs: FixedCosts | None = None) -> dict[str, Any]:
    """Per-stage, per-iteration and per-plan error of ``profile`` on ``runs``; Kendall tau
    between measured and predicted iteration times across plans.

    A plan's measured time is the median over its runs (repeats) of each run's median
    iteration: one slow iteration on a shared machine (a neighbour's burst, a garbage
    collection) or one slow run should not decide it. Errors are signed (predicted minus
    measured, over measured): a bias that keeps its sign is a missing mechanism.
    """
    from scipy.stats import kendalltau

    rows = [r for run in runs for r in predict(run, profile, skip=skip, fixed_costs=fixed_costs)]
    if not rows:
        raise SpecError("the runs have no iterations to compare (fewer than --skip + 1?)",
                        key="runs")
    iterations = [r for r in rows if r["node"] == "iteration"]
    stages = [r for r in rows if r["node"] != "iteration"]
    per_run = pd.DataFrame(iterations).groupby("run")[["measured_seconds",
                                                       "predicted_seconds"]].median()
    per_plan = []
    for name, members in plan_groups(runs).items():
        medians = per_run.loc[[str(m.path) for m in members if str(m.path) in per_run.index]]
        if medians.empty:
            continue
        measured = float(medians["measured_seconds"].median())
        predicted = float(medians["predicted_seconds"].median())
        per_plan.append({
            "run": name, "placement": members[0].plan.placement, "repeats": len(medians),
            "measured_iteration_seconds": measured, "predicted_iteration_seconds": predicted,
            "repeat_spread_pct": float(100.0 * (medians["measured_seconds"].max()
                                                - medians["measured_seconds"].min())
                                       / measured),
            "error_pct": 100.0 * (predicted - measured) / measured})
    tau = None
    if len(per_plan) >= 2:
        value = kendalltau([p["measured_iteration_seconds"] for p in per_plan],
                           [p["predicted_iteration_seconds"] for p in per_plan]).statistic
        tau = None if value != value else float(value)
    plan_summary = _signed_summary([p["error_pct"] for p in per_plan])
    iteration_summary = _signed_summary([r["error_pct"] for r in iterations])
    stage_summary = _signed_summary([r["error_pct"] for r in stages])
    per_stage: dict[str, dict[str, float]] = {}
    per_backend: dict[str, dict[str, float]] = {}
    if stages:
        frame = pd.DataFrame(stages)
        for node, group in frame.groupby("node"):
            per_stage[str(node)] = _signed_summary(group["error_pct"].tolist())
        for backend, group in frame.groupby("backend"):
            if backend:
                per_backend[str(backend)] = _signed_summary(group["error_pct"].tolist())
    return {
        "profile": profile.name,
        "runs": len(runs),
        "plans": len(per_plan),
        # Per plan: its predicted iteration time against its measured one (see above).
        **plan_summary,
        "kendall_tau": tau,
        **{f"iteration_{k}": v for k, v in iteration_summary.items()},
        **{f"stage_{k}": v for k, v in stage_summary.items()},
        "per_stage": per_stage,
        "per_backend": per_backend,
        "per_run": per_plan,
        "rows": rows,
    }


__all__ = ["FRAMEWORK_PARAMETERS", "PARAMETERS", "CalibrationResult", "Run", "accuracy",
           "calibrate", "load_run", "plan_groups", "predict", "predicted_stages"]
