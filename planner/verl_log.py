"""Read a verl run's per-step metrics log as a run that ``calibrate`` and ``accuracy`` can use.

verl (volcengine/verl) logs one dict of metrics per training step through
``verl.utils.tracking.Tracking``. Two of its backends write text this module reads:

- ``console`` (``verl/utils/logger/aggregate_logger.py``, ``LocalLogger``): one line per step,
  ``step:12 - timing_s/gen:34.5 - timing_s/step:80.1 - response_length/mean:412.0 - ...``
  (``concat_dict_to_str``: numbers only, each value as ``pprint.pformat`` writes it, so numpy
  scalars appear as ``np.float64(34.5)``). The trainer runs in a Ray actor, so a captured
  console has a prefix such as ``(TaskRunner pid=123)`` and colour codes; both are accepted.
  Every other line of a captured console (warnings, progress bars, worker output) is skipped;
  a line that starts with ``step:`` must be a whole metrics line.
- ``file`` (``verl/utils/tracking.py``, ``FileLogger``): JSON lines,
  ``{"step": 12, "data": {"timing_s/gen": 34.5, ...}}``; every non-blank line must be one.

The stage timers are the trainer's ``marked_timer`` blocks
(``verl/trainer/ppo/ray_trainer.py``, ``fit``), logged as ``timing_s/NAME`` in seconds by
``compute_timing_metrics`` (``verl/trainer/ppo/metric_utils.py``); :data:`STAGES` maps them to
this project's dataflow nodes. The response and prompt lengths of each step come from
``compute_data_metrics`` (``response_length/mean|max|min|clip_ratio``, ``prompt_length/mean``).

A step is predicted with the job as it ran (the log's mean prompt length and a response-length
distribution with the log's mean, minimum, maximum and clipped fraction) under the plan that
ran it, with the job's framework profile (verl by default), so a measured stage and its
prediction describe the same work.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from planner.calibration import Run
from profiles.datafile import SpecError, read_text_file
from simulator.plan import Plan
from simulator.specs.dataflow import CONTROLLER
from simulator.specs.job import JobSpec

TIMING_PREFIX = "timing_s/"

STAGES: dict[str, str] = {
    "gen": "actor.generate",
    "gen_max": "actor.generate_greedy",
    "old_log_prob": "actor.old_log_prob",
    "ref": "ref.infer",
    "values": "critic.infer",
    "reward": "reward.infer",
    "adv": "advantage",
    "update_critic": "critic.train",
    "update_actor": "actor.train",
    "update_weights": "actor.transition",
    "step": "iteration",
}
"""verl timer (``timing_s/NAME``, seconds) -> dataflow node. ``gen`` holds the rollout with its
wake-up and sleep; ``update_weights`` (verl >= 0.7) the weight sync from the trainer to the
rollout engine, our actor's train -> generate transition (earlier releases sync inside
``gen``). ``reward`` is the reward model's pass and/or the reward function (before verl 0.4 both
ran inside ``adv``); ``adv`` is the driver's advantage computation; ``step`` the whole step."""

OPTIONAL_STAGES = frozenset({"reward", "adv", "update_weights"})
"""Timers a step may lack (older releases, rule rewards, rollouts without a weight sync)."""

DEFAULT_FIT = ("train_compute", "infer_compute", "prefill_compute", "decode")
"""What ``calibrate --verl-log`` fits unless ``--fit`` says otherwise: the device's kernel
corrections, which the stage timers separate (training from the updates, forward passes from
old_log_prob / ref / values / reward, generation from gen; prefill from decode only as far as
prompt and response lengths vary between steps). Collectives and fixed costs scale the same
stages as the kernels in one plan: fit them on logs of several plans (see docs/calibration.md)."""

IGNORED_TIMERS = frozenset({"testing", "save_checkpoint", "start_profile", "stop_profile",
                            "dump_rollout_generations", "generate_sequences"})
"""Timers that are no stage of ours: validation and checkpoints run outside ``step``; the
profiler hooks; ``generate_sequences`` is the rollout worker's own timer inside ``gen``."""

IGNORED_TIMER_PREFIXES = ("generation_timing/", "agent_loop/")
"""Families of rollout statistics verl also logs under ``timing_s/`` (min / max / mean over
workers of time inside ``gen``)."""

READ_PREFIXES = (TIMING_PREFIX, "response_length/", "prompt_length/", "perf/")
"""Metrics this module reads: their values must be numbers."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CONSOLE = re.compile(r"^(?:\([^()]*\)\s*)?step:(\S*)(.*)$")
"""A console metrics line: an optional Ray prefix ``(TaskRunner pid=1, ip=...)``, then
``step:N`` and `` - key:value`` pairs."""
_NUMPY_SCALAR = re.compile(r"^(?:np|numpy)\.[a-z]+[0-9]*\((.*)\)$")


@dataclass(frozen=True)
class Step:
    """One step of a verl log: its number, the file line it came from, and its metrics."""

    step: int
    line: int
    metrics: dict[str, float]


def _number(text: str) -> float | None:
    """A console value as ``pprint.pformat`` wrote it: int, float, nan/inf, a numpy scalar,
    a bool. None when it is none of these."""
    text = text.strip()
    match = _NUMPY_SCALAR.match(text)
    if match:
        text = match.group(1).strip()
    if text in ("True", "False"):
        return float(text == "True")
    try:
        return float(text)
    except ValueError:
        return None


def _console_steps(text: str, source: str) -> list[Step]:
    steps = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = _ANSI.sub("", raw).rsplit("\r", 1)[-1].strip()
        match = _CONSOLE.match(line)
        if not match:
            continue  # anything else a captured console holds
        step_text, rest = match.groups()
        if not re.fullmatch(r"\d+", step_text):
            raise SpecError(f"line {number}: step: expected a whole number, got {step_text!r}",
                            source=source)
        metrics: dict[str, float] = {}
        if rest and not rest.startswith(" - "):
            raise SpecError(f"line {number}: expected ' - key:value' after step:{step_text}, "
                            f"got {rest[:40]!r}", source=source)
        for piece in rest.split(" - ")[1:]:
            key, sep, value = piece.rpartition(":")
            if not sep or not key:
                raise SpecError(f"line {number}: {piece[:60]!r} is not key:value (truncated "
                                "or corrupt line)", source=source)
            parsed = _number(value)
            if parsed is None:
                raise SpecError(f"line {number}: {key}: expected a number, got {value[:40]!r}",
                                source=source)
            metrics[key] = parsed
        steps.append(Step(step=int(step_text), line=number, metrics=metrics))
    return steps


def _jsonl_steps(text: str, source: str) -> list[Step]:
    steps = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SpecError(f"line {number}: not a JSON object (truncated or corrupt line)",
                            source=source) from None
        if not isinstance(record, dict) or set(record) != {"step", "data"}:
            raise SpecError(f"line {number}: expected {{\"step\": N, \"data\": {{...}}}} as "
                            "verl's file logger writes", source=source)
        step, data = record["step"], record["data"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SpecError(f"line {number}: step: expected a whole number >= 0, got "
                            f"{step!r}", source=source)
        if not isinstance(data, dict):
            raise SpecError(f"line {number}: data: expected a mapping of metrics, got "
                            f"{type(data).__name__}", source=source)
        metrics: dict[str, float] = {}
        for key, value in data.items():
            if key.startswith(READ_PREFIXES) and (
                    isinstance(value, (str, list, dict, bool))):
                raise SpecError(f"line {number}: {key}: expected a number, got "
                                f"{json.dumps(value)[:40]}", source=source)
            if value is None or isinstance(value, (str, list, dict)):
                continue  # orjson writes NaN as null; metrics this module does not read
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                continue
            metrics[key] = float(value)
        steps.append(Step(step=step, line=number, metrics=metrics))
    return steps


def read_verl_steps(path: str | Path) -> list[Step]:
    """The training steps of a verl console or JSONL log (steps without any ``timing_s/``
    key, such as the validation before training, are left out), in order. Refuses malformed
    lines, steps that do not increase, and a log without any training step."""
    path = Path(path)
    source = str(path)
    text = read_text_file(path, what="UTF-8 verl log")
    first = next((line.strip() for line in text.split("\n") if line.strip()), "")
    if not first:
        raise SpecError("empty file (no steps)", source=source)
    jsonl = first.startswith("{")  # the file logger's; a console line starts otherwise
    steps = _jsonl_steps(text, source) if jsonl else _console_steps(text, source)
    previous: Step | None = None
    for step in steps:
        if previous is not None and step.step <= previous.step:
            raise SpecError(f"line {step.line}: step {step.step} after step {previous.step} "
                            f"(line {previous.line}): steps must increase (two runs in one "
                            "file? give each its own file)", source=source)
        previous = step
    training = [s for s in steps if any(k.startswith(TIMING_PREFIX) for k in s.metrics)]
    if not training:
        what = "JSON lines" if jsonl else "lines starting with step:"
        raise SpecError(f"no training steps: no {what} with timing_s/ keys (verl's console "
                        "or file logger output expected)", source=source)
    return training


# ----- from steps to a run ------------------------------------------------------------------


def _stage_keys(job: JobSpec) -> dict[str, str]:
    """verl timer -> node, for the timers this job's dataflow has a node for."""
    nodes = {n.name for n in job.dataflow.nodes}
    return {timer: node for timer, node in STAGES.items()
            if node in nodes or node in ("iteration", "actor.transition")}


def _check_dataflow(job: JobSpec, job_source: str) -> None:
    """Every node of the job's dataflow must be one verl times."""
    timed = set(STAGES.values())
    for node in job.dataflow.nodes:
        if node.name not in timed:
            raise SpecError(f"the job's {job.algorithm} dataflow has node {node.name}, which "
                            f"verl has no timer for (verl times: "
                            f"{', '.join(TIMING_PREFIX + t for t in STAGES)})",
                            key="algorithm", source=job_source)


def length_counts(mean: float, low: float, high: float, clipped: float,
                  sequences: int) -> dict[int, int]:
    """A response-length histogram of ``sequences`` responses with the log's mean, minimum
    and maximum, and ``clipped`` (the fraction that hit the maximum, at least one): one
    response at the minimum, the clipped ones at the maximum and the rest at the length that
    keeps the mean (or, when that cannot be, the two extremes in the proportion that does).
    The longest response sets the decode steps, the mean the tokens."""
    low_n, high_n = round(low), round(high)
    if high_n <= low_n or sequences == 1:
        return {max(0, round(mean)): sequences}
    at_high = min(sequences - 1, max(1, round(clipped * sequences)))
    rest = sequences - at_high - 1
    if rest > 0:
        middle = (mean * sequences - low - high * at_high) / rest
        if low <= middle <= high:
            counts: dict[int, int] = {}
            for length, count in ((low_n, 1), (round(middle), rest), (high_n, at_high)):
                counts[length] = counts.get(length, 0) + count
            return counts
    share = (mean - low) / (high - low)
    at_high = min(sequences - 1, max(1, round(share * sequences)))
    return {low_n: sequences - at_high, high_n: at_high}


def _metric(step: Step, key: str, source: str, *, required: bool = True) -> float | None:
    value = step.metrics.get(key)
    if value is None:
        if required:
            raise SpecError(f"line {step.line}: step {step.step} has no {key} (verl logs it "
                            "every training step)", source=source)
        return None
    if not math.isfinite(value):
        raise SpecError(f"line {step.line}: {key}: not a finite number", source=source)
    return value


def verl_run(path: str | Path, job: JobSpec, plan: Plan, *,
             job_source: str = "the job") -> Run:
    """A verl log of ``job`` run under ``plan``, as a :class:`Run` (iteration i = the i-th
    training step in the log, 0 first; the verl step number is in the ``step`` column)."""
    source = str(path)
    steps = read_verl_steps(path)
    _check_dataflow(job, job_source)
    stages = _stage_keys(job)
    nodes = {n.name: n for n in job.dataflow.nodes}
    sequences = job.workload.prompts_per_iteration * job.workload.samples_per_prompt
    gpus = plan.total_gpus
    rows: list[dict[str, Any]] = []
    counts: dict[int, dict[int, int]] = {}
    prompts: dict[int, int] = {}
    for iteration, step in enumerate(steps):
        timers = {k[len(TIMING_PREFIX):]: v for k, v in step.metrics.items()
                  if k.startswith(TIMING_PREFIX)}
        for timer in timers:
            if timer in stages or timer in IGNORED_TIMERS or \
                    timer.startswith(IGNORED_TIMER_PREFIXES):
                continue
            if timer in STAGES:
                raise SpecError(
                    f"line {step.line}: {TIMING_PREFIX}{timer} times {STAGES[timer]}, which "
                    f"the job's {job.algorithm} dataflow does not have (a log of another "
                    f"algorithm or models? check {job_source})", source=source)
            raise SpecError(
                f"line {step.line}: {TIMING_PREFIX}{timer}: unknown verl timer (known: "
                f"{', '.join(STAGES)}; ignored: {', '.join(sorted(IGNORED_TIMERS))})",
                source=source)
        for timer, node in stages.items():
            key = TIMING_PREFIX + timer
            value = _metric(step, key, source, required=timer not in OPTIONAL_STAGES)
            if value is None:
                continue
            if value < 0:
                raise SpecError(f"line {step.line}: {key}: a duration cannot be negative, "
                                f"got {value}", source=source)
            if node == "iteration":
                role, operation = CONTROLLER, "iteration"
            elif node == "actor.transition":
                role, operation = "actor", "transition"
            else:
                role, operation = nodes[node].role, nodes[node].operation
            rows.append({"iteration": iteration, "step": step.step, "node": node, "role": role,
                         "operation": operation, "location": 0, "set": "verl", "gpus": gpus,
                         "wall_seconds": value, "compute_seconds": value,
                         "backend": "controller" if role == CONTROLLER else "verl",
                         "sequences": sequences})
        mean = _metric(step, "response_length/mean", source)
        high = _metric(step, "response_length/max", source)
        low = _metric(step, "response_length/min", source, required=False)
        clipped = _metric(step, "response_length/clip_ratio", source, required=False)
        low = mean if low is None else low
        if not (0 <= low <= mean + 1e-6 and mean <= high + 1e-6):
            raise SpecError(f"line {step.line}: response_length: expected 0 <= min <= mean <= "
                            f"max, got min {low}, mean {mean}, max {high}", source=source)
        counts[iteration] = length_counts(mean, low, high, clipped or 0.0, sequences)
        prompt = _metric(step, "prompt_length/mean", source, required=False)
        if prompt is not None:
            prompts[iteration] = max(1, round(prompt))
        _check_gpus(step, gpus, source)
    return Run(path=Path(path), plan=plan, job=job, prompt_length=job.workload.prompt_length,
               measurements=pd.DataFrame(rows), length_counts=counts, prompt_tokens=prompts,
               framework=job.framework)


def _check_gpus(step: Step, gpus: int, source: str) -> None:
    """verl's throughput is tokens / (step seconds x GPUs): the GPUs it ran on must be the
    plan's."""
    tokens = step.metrics.get("perf/total_num_tokens")
    seconds = step.metrics.get("perf/time_per_step")
    throughput = step.metrics.get("perf/throughput")
    if not tokens or not seconds or not throughput or not all(
            math.isfinite(v) for v in (tokens, seconds, throughput)):
        return
    ran_on = tokens / (seconds * throughput)
    if abs(ran_on - gpus) > 0.01 * gpus + 0.5:
        raise SpecError(f"line {step.line}: perf/throughput says the step ran on "
                        f"{ran_on:.0f} GPUs, the plan has {gpus}", source=source)


def load_verl_runs(logs: tuple[str, ...] | list[str], jobs: tuple[str, ...] | list[str],
                   plans: tuple[str, ...] | list[str]) -> list[Run]:
    """Runs from verl logs: one job file for all logs or one per log, and no plan (the colocate
    plan that ``simulate`` uses for the job: verl's default of every model on every GPU), one
    plan for all or one per log."""
    from simulator.default_plan import colocate_plan
    from simulator.plan import load_plan
    from simulator.specs.job import load_job

    if not jobs:
        raise SpecError("a verl log needs the job file that describes its run", key="--job")
    for option, given in (("--job", jobs), ("--plan", plans)):
        if len(given) > 1 and len(given) != len(logs):
            raise SpecError(f"give one {option} for all {len(logs)} logs or one per log, got "
                            f"{len(given)}", key=option)
    runs = []
    for i, log in enumerate(logs):
        job_path = jobs[i] if len(jobs) > 1 else jobs[0]
        job = load_job(job_path)
        if plans:
            plan_path = plans[i] if len(plans) > 1 else plans[0]
            plan = load_plan(plan_path)
            try:
                plan.validate(job)
            except SpecError as exc:
                raise exc.within(source=plan_path) from None
        else:
            try:
                plan = colocate_plan(job)
            except SpecError as exc:
                raise exc.within(source=job_path) from None
        runs.append(verl_run(log, job, plan, job_source=job_path))
    return runs


__all__ = ["DEFAULT_FIT", "STAGES", "Step", "length_counts", "load_verl_runs", "read_verl_steps",
           "verl_run"]
