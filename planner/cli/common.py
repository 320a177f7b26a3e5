"""What every command shares: exit codes, flag types, JSON output, the ``cli`` group, and
the loaders of jobs, plans and devices whose errors name the flag or the file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError, json_text
from simulator.specs.workload import MAX_SEQUENCE_TOKENS, MAX_SEQUENCES_PER_ITERATION

if TYPE_CHECKING:
    pass

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2

GIB = 1024**3

TOKENS = click.IntRange(min=1, max=MAX_SEQUENCE_TOKENS)
"""A sequence length flag, in tokens, within the planner's limit."""
SEQUENCES = click.IntRange(min=1, max=MAX_SEQUENCES_PER_ITERATION)
"""A batch flag, in sequences, within the planner's limit."""


def _emit_json(obj: Any) -> None:
    click.echo(json_text(obj, default=_json_default), nl=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and value != value:  # NaN
        return None
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _finite(value: float) -> float | None:
    return value if value == value and value not in (float("inf"), float("-inf")) else None


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _memory_json(memory: Any) -> dict[str, float]:
    return {k: float(v) for k, v in memory.as_dict().items()}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="hybridflow-planner", prog_name="hybridflow")
def cli() -> None:
    """Plan, simulate and run RLHF jobs (HybridFlow auto-mapping)."""


def _load_job(config: str | None) -> Any:
    from simulator.specs.job import default_job, load_job

    return load_job(config) if config else default_job()


def _load_plan_and_job(plan_path: str, config: str | None, *, require_job: bool = False
                       ) -> tuple[Any, Any]:
    """A plan file and its job: ``--config`` if given, else the job stored in the plan, else
    (unless ``require_job``) the built-in default job."""
    from simulator.plan import load_plan
    from simulator.specs.job import default_job, job_from_mapping

    plan = load_plan(plan_path)
    if config:
        job = _load_job(config)
    elif plan.job is not None:
        job = job_from_mapping(plan.job, source=f"{plan_path} (job)")
    elif require_job:
        raise SpecError("the plan has no job; pass --config job.yaml", source=plan_path,
                        key="job")
    else:
        job = default_job()
    return plan, job


def _checked(plan: Any, job: Any, plan_path: str) -> Any:
    try:
        plan.validate(job)
    except SpecError as exc:
        raise exc.within(source=plan_path) from None
    return plan


@contextlib.contextmanager
def _about(source: str | None) -> Iterator[None]:
    """Errors about the job (raised while planning) name the job's file."""
    try:
        yield
    except SpecError as exc:
        raise exc.within(source=source or "the default job") from None


def _load_device(name: str) -> Any:
    from profiles.device import load_profile

    try:
        return load_profile(name)
    except SpecError as exc:
        raise (exc.within("--device") if exc.key != "device" else
               SpecError(exc.problem, key="--device", source=exc.source)) from None


def _role_paths(settings: tuple[str, ...], option: str) -> dict[str, str]:
    """role -> path from repeated ``ROLE=PATH`` flags."""
    out: dict[str, str] = {}
    for setting in settings:
        role, sep, path = setting.partition("=")
        if not sep or not role.strip() or not path.strip():
            raise SpecError(f"expected ROLE=DIR, got {setting!r}", key=option)
        if role.strip() in out:
            raise SpecError(f"{role.strip()} is given twice", key=option)
        out[role.strip()] = path.strip()
    return out


def _rl_config(settings: tuple[str, ...]) -> Any:
    """RLConfig from ``--rl key=value`` flags (values read as YAML scalars)."""
    import yaml

    from executor.algorithms import RLConfig
    from profiles.datafile import from_mapping

    values: dict[str, Any] = {}
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"expected KEY=VALUE, got {setting!r}", key="--rl")
        try:
            values[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise SpecError(f"cannot read the value of {setting!r}", key="--rl") from None
    try:
        return from_mapping(RLConfig, values)
    except SpecError as exc:
        raise SpecError(exc.problem, key=f"--rl {exc.key}" if exc.key else "--rl") from None


def _held_out_accuracy(profile) -> str:
    """A calibrated profile's measured error on held-out runs, from its own provenance (empty
    for a profile that was not calibrated on runs)."""
    provenance = profile.provenance
    acc = provenance.accuracy
    if not provenance.fitted_on or not acc:
        return ""
    tau = f", Kendall tau {acc['kendall_tau']:.2f}" if "kendall_tau" in acc else ""
    bounds = ("; at a bound: " + ", ".join(provenance.parameters_at_bounds)
              if provenance.parameters_at_bounds else "; no parameter at a bound")
    return (f"calibrated {provenance.fitted_at or '?'} (commit {provenance.commit or '?'}) on "
            f"{len(provenance.fitted_on)} runs; on {acc.get('held_out_plans', 0):.0f} held-out "
            f"plans ({acc.get('held_out_runs', 0):.0f} runs): median |error| "
            f"{acc['median_abs_error_pct']:.1f}%, max {acc['max_abs_error_pct']:.1f}%, bias "
            f"{acc.get('bias_pct', 0):+.1f}%{tau}{bounds}")
