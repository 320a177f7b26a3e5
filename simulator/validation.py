"""Validation of the cost models against published measurements (``hybridflow validate``).

Cases live in ``simulator/data/validation_cases.yaml`` with their sources. For every case the
tool prints the measurement, the prediction and the signed error (predicted - measured, over
measured: for times + means predicted too slow, for throughputs too fast); per group the
mean and maximum absolute error and the mean signed error (bias: a bias near the mean absolute
error means every case errs the same way, which points at a missing mechanism, not noise).

Every group carries a regression gate (``gate_mean_abs_error_pct``, ``gate_max_abs_error_pct``:
its error when the gate was set, rounded up) so that a change that makes any group worse fails
``validate`` and CI; the Korthikanti et al. 2022 Table 5 group also carries the acceptance
target (maximum absolute error <= 10%; Calculon, Isaev et al. SC'23, reports 3.65% mean and
8.87% maximum on the same eight cases). Interpretations of a source that the source does not
state are listed under ``assumptions`` and printed with the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pandas as pd

from profiles.datafile import SpecError, from_mapping, merged_mapping, read_mapping
from profiles.device import load_profile
from simulator.costs.generation import generate, generation_weight_bytes, workspace_bytes
from simulator.costs.training import train_step
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS
from simulator.validation_bands import (
    BandPoint,
    BandResult,
    band_results,
    read_bands,
    summary_point,
)

CASES_FILE = Path(__file__).resolve().parent / "data" / "validation_cases.yaml"


@dataclass(kw_only=True, slots=True, frozen=True)
class FirstSeen:
    """A group's error when its cases were added (before any change made for them)."""

    commit: str
    """The commit that added the cases."""
    cases: int
    cases_only: bool
    """That commit changed no cost model, so its figure is out of sample."""
    mean_abs_error_pct: float
    median_abs_error_pct: float
    max_abs_error_pct: float


@dataclass(frozen=True, slots=True)
class GroupSummary:
    group: str
    source: str
    cases: int
    mean_abs_error_pct: float
    max_abs_error_pct: float
    bias_pct: float
    """Mean signed error (predicted - measured, over measured), in percent."""
    target_max_abs_error_pct: float | None
    """Acceptance target of the group (None: no target beyond its gate)."""
    gate_mean_abs_error_pct: float
    """Regression gate: the group's mean |error| must stay at or below this."""
    gate_max_abs_error_pct: float
    """Regression gate: the group's max |error| must stay at or below this."""
    metric: str = "iteration_seconds"
    """What the cases measure: a time (seconds, ms) or a throughput (..._per_s...)."""
    assumptions: tuple[str, ...] = ()
    """Readings of the source that the source does not state."""
    median_abs_error_pct: float = 0.0
    goal_median_abs_error_pct: float | None = None
    """A goal for the group's median |error|, reported (met or missed) but, unlike the target
    and the gates, not failing ``validate``."""
    winners: tuple[str, ...] = ()
    """Groups comparing modes: per scale, the faster mode measured and predicted."""
    first_seen: FirstSeen | None = None
    """The group's error at the commit that added its cases (validation_cases.yaml)."""
    mixture_of_experts: bool = False
    """The group's models are mixtures of experts (all of them)."""
    mixed_models: bool = False
    """The group has cases of dense and of MoE models: it applies to jobs of both kinds."""
    asynchronous: bool = False
    """The group's cases run a rollout set of their own (one_step_off or async)."""
    bands: tuple[BandResult, ...] = ()
    """The group's error over each assumed input's plausible range (``bands:``)."""

    @property
    def out_of_sample(self) -> bool:
        """Today's figure is out of sample: the cases were added by a commit that changed no
        cost model, and the group's cases and errors are what they were then (any later
        change may have been made while looking at them)."""
        seen = self.first_seen
        return seen is not None and seen.cases_only and seen.cases == self.cases and \
            abs(seen.mean_abs_error_pct - self.mean_abs_error_pct) <= 0.05 and \
            abs(seen.max_abs_error_pct - self.max_abs_error_pct) <= 0.05

    @property
    def sample_label(self) -> str:
        return "out-of-sample" if self.out_of_sample else "in-sample"

    def applies_to(self, *, mixture_of_experts: bool, asynchronous: bool) -> bool:
        """Whether the group says something about a job of this kind: its models dense or
        MoE as the job's, and its asynchronous cases only for an asynchronous plan."""
        return (self.mixed_models or self.mixture_of_experts == mixture_of_experts) and \
            (asynchronous or not self.asynchronous)

    @property
    def bias_direction(self) -> str:
        """'too fast' or 'too slow': what the sign of the bias means for this metric."""
        higher_is_faster = "_per_s" in self.metric
        return "too fast" if (self.bias_pct > 0) == higher_is_faster else "too slow"

    @property
    def meets_target(self) -> bool | None:
        if self.target_max_abs_error_pct is None:
            return None
        return self.max_abs_error_pct <= self.target_max_abs_error_pct

    @property
    def meets_goal(self) -> bool | None:
        if self.goal_median_abs_error_pct is None:
            return None
        return self.median_abs_error_pct <= self.goal_median_abs_error_pct

    @property
    def within_gate(self) -> bool:
        return (self.mean_abs_error_pct <= self.gate_mean_abs_error_pct
                and self.max_abs_error_pct <= self.gate_max_abs_error_pct)

    @property
    def passes(self) -> bool:
        return self.within_gate and self.meets_target is not False


def _training_rows(group: str, spec: dict) -> list[dict]:
    profile = load_profile(spec["device"])
    if spec.get("kind") == "training":
        return [_training_row(group, spec, profile, case) for case in spec["cases"]]
    rows = []
    for case in spec["cases"]:
        model = MODEL_PRESETS[case["model"]]
        for mode in ("full", "selective"):
            if mode not in case:
                continue
            par = ParallelConfig(tp=case.get("tp", 8), pp=case["pp"], dp=case.get("dp", 1),
                                 vpp=case["vpp"], micro_batch_size=case["micro_batch"],
                                 recompute=mode, sequence_parallel=mode == "selective",
                                 overlap_grad_reduce=False)
            cost = train_step(model, profile, par, global_batch=case["global_batch"],
                              seq_len=case.get("seq_len", 2048), dtype=spec["dtype"],
                              attention="unfused")
            rows.append({
                "group": group, "case": f"{case['model']} {mode}"
                + (f" dp{par.dp}" if par.dp > 1 else ""),
                "metric": "iteration_seconds", "measured": case[mode],
                "predicted": cost.seconds})
    return rows


def _training_row(group: str, spec: dict, profile, case: dict) -> dict:
    """One training step of a case given with its whole layout (``kind: training``)."""
    model = MODEL_PRESETS[case["model"]]
    tp, pp = case.get("tp", 1), case.get("pp", 1)
    dp = case["gpus"] // (tp * pp)
    overlap = case.get("overlap", False)
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=case.get("vpp", 1),
                         micro_batch_size=case["micro_batch"],
                         recompute=case.get("recompute", "none"),
                         sequence_parallel=case.get("sequence_parallel", tp > 1),
                         sharding=case.get("sharding", "none"),
                         overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                         ep=case.get("ep", 1), etp=case.get("etp", 1),
                         moe_dispatcher=case.get("moe_dispatcher", "alltoall"))
    cost = train_step(model, profile, par, global_batch=case["global_batch"],
                      seq_len=case["seq_len"], dtype=spec["dtype"],
                      grad_bytes=case.get("grad_bytes", 4))
    return {"group": group, "case": case["name"], "metric": spec["metric"],
            "measured": float(case["measured"]), "predicted": cost.seconds}


def _generation_rows(group: str, spec: dict) -> list[dict]:
    profile = load_profile(spec["device"])
    dtype = spec["dtype"]
    rows = []
    for case in spec["cases"]:
        model = MODEL_PRESETS[case["model"]]
        # A static batch (``batch``), or an offline run of ``requests`` queued at once that the
        # engine batches continuously as far as its KV cache holds them.
        sequences = case.get("requests", case.get("batch"))
        gen = GenerationConfig(tp=case["tp"], max_num_seqs=case.get("batch", sequences))
        budget = (profile.usable_memory_bytes - generation_weight_bytes(model, gen, dtype)
                  - workspace_bytes(model, gen, dtype)) * spec.get("kv_cache_fraction", 1.0)
        cost = generate(model, profile, gen, lengths=(case["response"],) * sequences,
                        prompt_len=case["prompt"], kv_budget_bytes=budget, dtype=dtype)
        if spec["metric"] == "latency_ms":
            predicted = cost.seconds * 1000
        elif spec["metric"] == "out_tokens_per_s":
            predicted = sequences * case["response"] / cost.seconds
        else:
            predicted = sequences * case["response"] / cost.seconds / case["tp"]
        size = f"batch {case['batch']}" if "batch" in case else f"{sequences} requests"
        rows.append({
            "group": group,
            "case": f"{case['model']} tp{case['tp']} {size} "
                    f"{case['prompt']}/{case['response']}",
            "metric": spec["metric"], "measured": case["measured"], "predicted": predicted})
    return rows


def _stage_seconds(estimate, parts: list[str], source: str) -> float:
    """Sum of the simulator's parts that one of the source's timers holds: a node
    (``actor.train``), one entry of a node's detail (``actor.generate:decode_seconds``) or the
    actor's transition (``actor.transition``)."""
    total = 0.0
    for part in parts:
        if part == "actor.transition":
            total += estimate.transition.seconds if estimate.transition is not None else 0.0
            continue
        name, _, key = part.partition(":")
        if name not in estimate.nodes:
            raise SpecError(f"no node {name!r} (nodes: {', '.join(estimate.nodes)})",
                            key="stage_parts", source=source)
        node = estimate.nodes[name]
        if not key:
            total += node.seconds
        elif key in node.detail:
            total += node.detail[key]
        else:
            raise SpecError(f"node {name!r} has no detail {key!r}", key="stage_parts",
                            source=source)
    return total


def split_plan(job, rollout_gpus: int):
    """An asynchronous case as its source ran it: the job's ``mode`` on a rollout set of the
    last ``rollout_gpus`` GPUs (the actor's pinned generation layout), every other model
    colocated on the GPUs before it."""
    from dataclasses import replace

    from simulator.default_plan import colocate_plan
    from simulator.plan import Plan, RolePlan, RolloutSet
    from simulator.specs.asynchrony import allowed_modes
    from simulator.specs.parallel import GenerationConfig

    total = job.cluster.total_gpus
    rollout_at = RolloutSet(gpus=rollout_gpus, first_gpu=total - rollout_gpus)
    if job.cluster.is_homogeneous:
        trainer_job = replace(job, cluster=job.cluster.with_total_gpus(total - rollout_gpus),
                              generation_elsewhere=True)
    else:
        # Trainer and rollout GPUs share nodes (e.g. 6 + 2 of each 8-GPU node): the job
        # gives them as two node groups, the trainer's first, and the rollout set is the
        # whole second group.
        if len(job.cluster.node_groups) != 2 or \
                job.cluster.node_groups[1].nodes * job.cluster.node_groups[1].gpus_per_node \
                != rollout_gpus:
            raise SpecError("a split case on node groups gives two: the trainer's, then the "
                            f"rollout's {rollout_gpus} GPUs", key="cluster.node_groups")
        trainer_job = replace(job, generation_elsewhere=True)
        rollout_at = RolloutSet(gpus=rollout_gpus, first_gpu=0, node_group=1)
    trainer = colocate_plan(trainer_job)
    pin = job.parallel.get("actor")
    seqs, utilization = job.rollout_defaults()
    gen = GenerationConfig(tp=(pin.generation_tp if pin and pin.generation_tp else 1),
                           max_num_seqs=seqs, memory_utilization=utilization)
    roles = dict(trainer.roles)
    roles["actor"] = RolePlan(parallel=roles["actor"].parallel, generation=gen,
                              training_backend=roles["actor"].training_backend)
    mode, staleness = allowed_modes(job.mode, job.max_staleness)[-1]
    return Plan(algorithm=job.algorithm, sets=trainer.sets, roles=roles, strategy=mode,
                mode=mode, max_staleness=staleness,
                partial_rollout=job.partial_rollout and mode == "async",
                rollout=rollout_at)


def case_plan(job, case: dict):
    """The plan a whole-step case ran: colocated on all its GPUs, or, with ``rollout_gpus``,
    split as ``split_plan`` builds it."""
    from simulator.default_plan import colocate_plan

    if "rollout_gpus" in case:
        return split_plan(job, int(case["rollout_gpus"]))
    return colocate_plan(job)


def winners(rows: list[dict]) -> list[str]:
    """Per scale (cases sharing ``scale``): the faster mode measured and predicted, e.g.
    '32 GPUs: measured async, predicted async (same)'."""
    out = []
    scales = sorted({r["scale"] for r in rows if r.get("scale") is not None and not r["stage"]})
    for scale in scales:
        at = [r for r in rows if r.get("scale") == scale and not r["stage"]]
        measured = min(at, key=lambda r: r["measured"])
        predicted = min(at, key=lambda r: r["predicted"])
        same = "same" if measured is predicted else "DIFFERENT"
        out.append(f"{scale} GPUs: measured {measured['mode']}, predicted {predicted['mode']} "
                   f"({same})")
    return out


def _priced_case(job_mapping: dict, case: dict, source: str):
    """A whole-step case's job priced as its source ran it: (its estimate, the simulated
    iteration in seconds, the plan)."""
    from simulator.engine import simulate_estimated
    from simulator.plan import job_as_planned
    from simulator.predict import estimate_plan
    from simulator.specs.job import job_from_mapping

    job = job_from_mapping(job_mapping, source=source)
    plan = case_plan(job, case)
    # One estimate serves the simulation, the measured stage and the stage rows.
    plan.validate(job)
    planned = job_as_planned(job, plan)
    estimate = estimate_plan(planned, plan)
    result = simulate_estimated(planned, plan, estimate)
    if not result.feasible:
        raise SpecError(f"the case does not fit: {'; '.join(result.reasons)}", source=source)
    return estimate, result.iteration_seconds, plan


def _rlhf_step_rows(group: str, spec: dict, cases_file: Path, *,
                    stages: bool = True) -> list[dict]:
    """Whole RLHF iterations: each case is a job (with its framework and every parallel setting
    pinned), colocated on all its GPUs as the source ran it, simulated for one iteration (or,
    with ``measures: STAGE``, the stage timer STAGE of ``stage_parts`` as the measurement). A
    case with ``stages`` adds one row per published stage timer (``stage_parts`` of the group
    says which of the simulator's nodes and parts each timer holds); stage rows are reported
    but the group's statistics are the whole steps'.

    A case with ``relative_to`` (settings of its job, e.g. another generation TP size) is a
    published ratio: its measurement is the case's figure over that of the same job with those
    settings (a source that gives "60% less than with TP 8" but not the times), and its
    prediction is the simulator's ratio of the same two."""
    rows = []
    stage_parts = spec.get("stage_parts", {})
    measures = spec.get("measures")
    if measures is not None and measures not in stage_parts:
        # A group of one published stage timer (``measures``: a key of stage_parts).
        raise SpecError(f"measures {measures!r} has no entry in stage_parts",
                        key=f"{group}.measures", source=str(cases_file))

    def measured_part(estimate, iteration_seconds: float, source: str) -> float:
        if measures is None:
            return iteration_seconds
        return _stage_seconds(estimate, stage_parts[measures], source)

    for i, case in enumerate(spec["cases"]):
        source = f"{cases_file} ({group}.cases[{i}])"
        estimate, iteration_seconds, plan = _priced_case(case["job"], case, source)
        predicted = measured_part(estimate, iteration_seconds, source)
        relative_to = case.get("relative_to")
        if relative_to is not None:
            if not isinstance(relative_to, dict) or not relative_to:
                raise SpecError("expected the job settings of the case it is measured against "
                                "(e.g. {parallel: {actor: {generation_tp: 8}}})",
                                key=f"{group}.cases[{i}].relative_to", source=str(cases_file))
            reference, reference_seconds, _ = _priced_case(
                merged_mapping(case["job"], relative_to), case,
                f"{source} relative_to")
            predicted /= measured_part(reference, reference_seconds, f"{source} relative_to")
        rows.append({"group": group, "case": case["name"], "metric": spec["metric"],
                     "measured": float(case["measured"]),
                     "predicted": predicted, "stage": "",
                     "scale": case.get("scale"), "mode": plan.mode,
                     **({"measures": measures} if measures is not None else {}),
                     **({"relative": True} if relative_to is not None else {})})
        if not stages or not case.get("stages"):
            continue
        for stage, measured in case["stages"].items():
            if stage not in stage_parts:
                raise SpecError(f"stage {stage!r} has no entry in the group's stage_parts",
                                key=f"{group}.cases[{i}].stages", source=str(cases_file))
            rows.append({"group": group, "case": f"{case['name']}: {stage}",
                         "metric": "stage_seconds", "measured": float(measured),
                         "predicted": _stage_seconds(estimate, stage_parts[stage], source),
                         "stage": stage})
    return rows


def _group_rows(group: str, spec: dict, cases_file: Path, *, stages: bool = True) -> list[dict]:
    """The group's rows (measured, predicted, signed error in percent); ``stages=False``
    leaves out the published stage timers of whole-step cases."""
    if spec.get("kind") == "rlhf_step":
        rows = _rlhf_step_rows(group, spec, cases_file, stages=stages)
    elif "metric" in spec and spec.get("kind") != "training":
        rows = _generation_rows(group, spec)
    else:
        rows = _training_rows(group, spec)
    for row in rows:
        row["error_pct"] = 100.0 * (row["predicted"] - row["measured"]) / row["measured"]
        row.setdefault("stage", "")
    return rows


def _with_framework_paths(spec: dict, cases_file: Path) -> dict:
    """The group with each case job's framework profile file (``framework: x.yaml``, a profile
    of the system a source ran that no shipped profile describes) named relative to the cases
    file, as an absolute path."""
    if not isinstance(spec, dict) or not isinstance(spec.get("cases"), list):
        return spec
    cases = []
    for case in spec["cases"]:
        job = case.get("job") if isinstance(case, dict) else None
        framework = job.get("framework") if isinstance(job, dict) else None
        if isinstance(framework, str) and framework.endswith((".yaml", ".yml")) \
                and not Path(framework).is_absolute():
            case = {**case, "job": {**job, "framework": str(cases_file.parent / framework)}}
        cases.append(case)
    return {**spec, "cases": cases}


def _whole_step_errors(rows: list[dict]) -> list[float]:
    return [r["error_pct"] for r in rows if not r["stage"]]


def run_validation(cases_file: Path = CASES_FILE, *,
                   bands: bool = False) -> tuple[pd.DataFrame, list[GroupSummary]]:
    """Every case's measurement, prediction and error, and a summary per group; with
    ``bands``, also the group's error over each assumption band (each band prices the group
    again at each of its values)."""
    data = read_mapping(cases_file)
    rows: list[dict] = []
    summaries: list[GroupSummary] = []
    for group, spec in data.items():
        spec = _with_framework_paths(spec, cases_file)
        group_rows = _group_rows(group, spec, cases_file)
        rows.extend(group_rows)
        signed = _whole_step_errors(group_rows)
        nominal = summary_point("nominal", signed)
        for key in ("gate_mean_abs_error_pct", "gate_max_abs_error_pct"):
            if not isinstance(spec.get(key), (int, float)):
                raise SpecError("every group needs a number (its regression gate, in percent)",
                                key=f"{group}.{key}", source=str(cases_file))
        assumptions = spec.get("assumptions", [])
        if not isinstance(assumptions, list) or not all(isinstance(a, str)
                                                        for a in assumptions):
            raise SpecError("expected a list of sentences", key=f"{group}.assumptions",
                            source=str(cases_file))
        moe = [_case_model(case).moe is not None for case in spec["cases"]]
        summaries.append(GroupSummary(
            group=group, source=" ".join(spec["source"].split()), cases=len(signed),
            mean_abs_error_pct=nominal.mean_abs_error_pct,
            max_abs_error_pct=nominal.max_abs_error_pct,
            bias_pct=sum(signed) / len(signed),
            target_max_abs_error_pct=spec.get("target_max_abs_error_pct"),
            median_abs_error_pct=nominal.median_abs_error_pct,
            goal_median_abs_error_pct=spec.get("goal_median_abs_error_pct"),
            gate_mean_abs_error_pct=float(spec["gate_mean_abs_error_pct"]),
            gate_max_abs_error_pct=float(spec["gate_max_abs_error_pct"]),
            metric=spec.get("metric", "iteration_seconds"),
            assumptions=tuple(" ".join(a.split()) for a in assumptions),
            winners=tuple(winners(group_rows)),
            mixture_of_experts=all(moe), mixed_models=any(moe) and not all(moe),
            asynchronous=any("rollout_gpus" in case for case in spec["cases"]),
            first_seen=None if "first_seen" not in spec else from_mapping(
                FirstSeen, spec["first_seen"], source=str(cases_file),
                key_prefix=f"{group}.first_seen"),
            bands=_bands(group, spec, cases_file, nominal) if bands else ()))
    return pd.DataFrame(rows), summaries


@cache
def cached_validation() -> tuple[pd.DataFrame, list[GroupSummary]]:
    """``run_validation()`` of the shipped cases, once per process and, between processes,
    from a file in the user's cache directory named by a hash of everything the result
    depends on (the simulator's and the profiles' sources and data files): any change to
    them names another file, so a stale result is never read. The report's accuracy note and
    the plan's confidence read it; callers must not modify what it returns."""
    import json
    import os

    from profiles.datafile import to_mapping, write_text_atomic

    path = _validation_cache_path()
    if path is not None and path.exists():
        try:
            data = json.loads(path.read_text())
            groups = [_summary_from_mapping(g) for g in data["groups"]]
            return pd.DataFrame(data["cases"]), groups
        except (OSError, ValueError, KeyError, TypeError, SpecError):
            pass  # unreadable: computed again and rewritten below
    table, groups = run_validation()
    if path is not None:
        try:
            os.makedirs(path.parent, exist_ok=True)
            write_text_atomic(path, json.dumps({
                "cases": table.to_dict(orient="records"),
                "groups": [to_mapping(g) for g in groups]}))
        except OSError:
            pass  # a read-only home: the next process computes it again
    return table, groups


VALIDATION_INPUTS = ("simulator", "profiles")
"""Packages whose sources and data files decide ``run_validation``'s result."""


def _validation_cache_path() -> Path | None:
    """The cache file for today's sources (None when caching is off:
    HYBRIDFLOW_CACHE_DIR set to an empty string)."""
    import hashlib
    import os

    base = os.environ.get("HYBRIDFLOW_CACHE_DIR")
    if base == "":
        return None
    if base is None:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME")
                            or os.path.join(os.path.expanduser("~"), ".cache"), "hybridflow")
    import sys

    import numpy as np

    from profiles.device import profile_search_path

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{sys.version} numpy {np.__version__} pandas "
                            f"{pd.__version__}".encode())
    # The shipped packages, and the profile directories a user puts before the shipped ones
    # (HYBRIDFLOW_PROFILE_PATH: a profile there would replace a shipped one of its name).
    folders = [root / package for package in VALIDATION_INPUTS] + \
        [d for d in profile_search_path() if d.is_dir()]
    for folder in folders:
        for file in sorted(folder.rglob("*")):
            if file.suffix in (".py", ".yaml", ".yml", ".csv", ".json") and file.is_file():
                digest.update(str(file).encode() + b"\0")
                digest.update(file.read_bytes() + b"\0")
    return Path(base) / f"validation-{digest.hexdigest()[:20]}.json"


def _summary_from_mapping(data: dict) -> GroupSummary:
    seen = data.get("first_seen")
    return GroupSummary(**{
        **data, "first_seen": None if seen is None else FirstSeen(**seen),
        "assumptions": tuple(data["assumptions"]), "winners": tuple(data["winners"]),
        "bands": ()})


def _bands(group: str, spec: dict, cases_file: Path,
           nominal: BandPoint) -> tuple[BandResult, ...]:
    """The group's error over each of its assumption bands, and over all of them together."""
    bands = read_bands(spec, group, str(cases_file))
    goal_median = spec.get("goal_median_abs_error_pct")
    target_max = spec.get("target_max_abs_error_pct")
    goal = None
    if goal_median is not None:
        def goal(point: BandPoint) -> bool:
            return point.median_abs_error_pct <= goal_median
    elif target_max is not None:
        def goal(point: BandPoint) -> bool:
            return point.max_abs_error_pct <= target_max
    try:
        return band_results(
            spec, bands,
            lambda variant: _whole_step_errors(_group_rows(group, variant, cases_file,
                                                           stages=False)),
            goal=goal, nominal=nominal)
    except SpecError as exc:
        # Named in the cases file (a band's framework variant is a temporary file).
        key = f"{group}.bands" + (f" ({exc.key})" if exc.key else "")
        raise SpecError(exc.problem, key=key, source=str(cases_file)) from None


def _case_model(case: dict):
    """The model a case measures (a whole-step case's actor)."""
    from simulator.specs.presets import load_model

    model = case["job"]["models"]["actor"] if "job" in case else case["model"]
    return load_model(model)
