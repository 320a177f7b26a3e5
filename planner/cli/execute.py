"""``hybridflow execute``: a plan run on Ray, checked, resumed, and set against its prediction."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError, json_text, write_text_atomic

if TYPE_CHECKING:
    from simulator.specs.job import JobSpec
from planner.cli.common import (
    _about,
    _emit_json,
    _load_plan_and_job,
    _rl_config,
    _role_paths,
    cli,
)

TINY_MODEL_PARAMS = 100e6
"""Below this many parameters a model is a toy trained from scratch on the built-in task (the
tiny-* presets have under a million), where a large learning rate is what makes it learn."""
TOY_LR = 1e-2
"""The learning rate of such toys (the executor's learning tests)."""
VERL_ACTOR_LR = 1e-6
"""verl's actor learning rate (verl 0.9.1 trainer/config/_generated_ppo_trainer.yaml:12,
actor_rollout_ref.actor.optim.lr), with no warm-up (lr_warmup_steps_ratio 0.0, :13)."""
VERL_CRITIC_LR = 1e-5
"""verl's critic learning rate (the same file :539, critic.optim.lr)."""


def ray_address(address: str | None) -> str | None:
    """The Ray cluster a run joins: ``--address``, else Ray's own ``RAY_ADDRESS``; with
    neither, None, and the run starts a local Ray of its own (virtual GPUs on CPU). Ray's
    ``ray.init()`` would otherwise join a cluster that ``ray start`` recorded on this machine
    and refuse the local Ray's GPU count ("When connecting to an existing cluster, num_cpus
    and num_gpus must not be provided", Ray 2.60); ``RAY_ADDRESS=local`` is how Ray is told to
    start its own."""
    if address:
        return address
    environment = os.environ.get("RAY_ADDRESS", "")
    if environment and environment != "local":
        return environment
    os.environ["RAY_ADDRESS"] = "local"
    return None


def learning_rates(job: JobSpec, actor_lr: float | None,
                   critic_lr: float | None) -> tuple[float, float]:
    """(actor, critic) learning rates: the ones given, else a toy's for a job whose trained
    models are all under TINY_MODEL_PARAMS, else verl's defaults for pretrained models."""
    trained = [job.model(r) for r in job.dataflow.trained_roles if r in job.models]
    toy = all(m.param_count < TINY_MODEL_PARAMS for m in trained)
    actor = actor_lr if actor_lr is not None else (TOY_LR if toy else VERL_ACTOR_LR)
    critic = critic_lr if critic_lr is not None else (actor if toy else VERL_CRITIC_LR)
    return actor, critic


@cli.command()
@click.argument("plan_path", metavar="[PLAN.json]", required=False,
                type=click.Path(dir_okay=False))
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the job stored in the plan).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="RL iterations (with --resume: the total to reach; default: the run's).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/<time>-<placement>).")
@click.option("--address", default=None,
              help="Ray cluster to join (default: $RAY_ADDRESS if set, else start a local "
                   "one, virtual GPUs on CPU).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--transition", type=click.Choice(["micro_dp", "naive"]), default="micro_dp",
              show_default=True,
              help="Actor train->generate: 3D-HybridEngine micro-DP gather, or gather all.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Learning rate of the actor (default: 1e-2 for models under 100M "
                   "parameters, which learn the built-in task from scratch; else verl's "
                   "1e-6).")
@click.option("--critic-lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Learning rate of the critic (default: --lr for models under 100M "
                   "parameters; else verl's 1e-5).")
@click.option("--reward-warmup", type=click.IntRange(min=0), default=20, show_default=True,
              help="Steps fitting the reward / cost models to the task's rules before RL.")
@click.option("--rl", "rl_settings", multiple=True, metavar="KEY=VALUE",
              help="An RL hyper-parameter (repeatable), e.g. --rl kl_coef=0.05 --rl "
                   "cost_threshold=0.1; keys: see executor/algorithms.py RLConfig.")
@click.option("--worker-setup", default=None, metavar="MODULE:FUNCTION",
              help="A function every worker imports and calls before it builds models "
                   "(site-specific preparation; the CPU tests pass their Megatron "
                   "compatibility layer this way).")
@click.option("--worker-logs/--no-worker-logs", default=None,
              help="Show the workers' output on stderr (default: on with --address).")
@click.option("--checkpoint", "checkpoints", multiple=True, metavar="ROLE=DIR",
              help="Start a role from a local Hugging Face checkpoint directory (safetensors "
                   "with Hugging Face Llama parameter names; repeatable). The reference "
                   "takes the actor's unless given its own.")
@click.option("--validate-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Score greedy responses to held-out prompts every N iterations and after "
                   "the last (the validation reward in metrics.csv; 0: never).")
@click.option("--save-hf", type=click.Path(file_okay=False), default=None,
              help="Write the trained actor to this directory at the end, as a Hugging Face "
                   "checkpoint (config.json + model.safetensors, and the tokenizer of the "
                   "job's data; Llama-style models).")
@click.option("--save-hf-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --save-hf, also write the actor every N iterations (0: at the end "
                   "only).")
@click.option("--save-hf-critic", type=click.Path(file_okay=False), default=None,
              help="Also write the trained critic there (Hugging Face "
                   "LlamaForTokenClassification with one label), when --save-hf writes.")
@click.option("--log", "log_to", type=click.Choice(["tensorboard"]), default=None,
              help="Also write every iteration's metrics as TensorBoard scalars "
                   "(RUN/tensorboard).")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Save the trained roles, the data position, the generators' states and "
                   "the records every N iterations (RUN/checkpoints; 0: never).")
@click.option("--resume", "resume", type=click.Path(file_okay=False), default=None,
              metavar="RUN", help="Continue RUN from its last checkpoint (its plan, job and "
                                  "options; --steps may raise the total).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=2, show_default=True,
              help="Restart the workers from the last checkpoint after a worker fails, at "
                   "most this many times.")
@click.option("--dry-run", is_flag=True,
              help="Check the plan against the executor (engines installed, layouts, data, "
                   "checkpoints) and exit without starting Ray.")
@click.option("--json", "as_json", is_flag=True, help="Print the run summary as JSON.")
def execute(plan_path: str | None, config: str | None, steps: int | None, out: str | None,
            address: str | None, seed: int, transition: str, lr: float | None,
            critic_lr: float | None, reward_warmup: int,
            rl_settings: tuple[str, ...], worker_setup: str | None, worker_logs: bool | None,
            checkpoints: tuple[str, ...], validate_every: int, save_hf: str | None,
            save_hf_every: int, save_hf_critic: str | None, log_to: str | None,
            checkpoint_every: int, resume: str | None, max_restarts: int, dry_run: bool,
            as_json: bool) -> None:
    """Run a plan for real on Ray: the job's data (data:) or the built-in digit-sorting task."""
    import time as _time

    if dry_run and resume is not None:
        raise SpecError("--dry-run checks a new run; a resumed run was checked when it started",
                        key="--dry-run")
    address = ray_address(address)
    if resume is not None:
        _resume_run(resume, plan_path, steps, address, worker_logs, max_restarts, as_json)
        return
    if plan_path is None:
        raise SpecError("give the plan to run (PLAN.json), or --resume RUN", key="execute")
    if steps is None and not dry_run:
        raise SpecError("give --steps N", key="--steps")
    plan_file, job = _load_plan_and_job(plan_path, config, require_job=True)
    if plan_file.mode not in ("sync", "one_step_off"):
        raise SpecError(f"the executor runs sync and one_step_off plans; this plan runs "
                        f"{plan_file.mode_label()} (plan it with another mode to run it here, "
                        "or export it to verl with `hybridflow export`)", key="mode",
                        source=str(plan_path))
    if not job.cluster.is_homogeneous:
        # The executor maps a plan's GPUs onto one kind of node; mixed clusters are planned.
        with _about(config or plan_path):
            job.cluster.only_group()
    try:
        from executor.run import ExecutionOptions
    except ImportError as exc:
        raise SpecError(f"the executor needs its extra dependencies ({exc.name} is missing): "
                        "pip install -e '.[executor]' (torch==2.13.0 first on CPU machines)",
                        key="execute") from None
    run_dir = Path(out) if out else Path("runs") / (
        _time.strftime("%Y%m%d-%H%M%S") + "-" + plan_file.placement.replace("|", "_")
        .replace(",", "+"))
    actor_lr, critic_lr = learning_rates(job, lr, critic_lr)
    options = ExecutionOptions(steps=steps or 1, seed=seed, out=run_dir, address=address,
                               transition=transition,  # type: ignore[arg-type]
                               actor_lr=actor_lr, critic_lr=critic_lr,
                               reward_warmup_steps=reward_warmup,
                               rl=_rl_config(rl_settings), worker_setup=worker_setup,
                               worker_logs=worker_logs,
                               checkpoints=_role_paths(checkpoints, "--checkpoint"),
                               save_hf=Path(save_hf) if save_hf else None,
                               save_hf_critic=Path(save_hf_critic) if save_hf_critic else None,
                               log_tensorboard=log_to == "tensorboard",
                               validate_every=validate_every, save_hf_every=save_hf_every,
                               checkpoint_every=checkpoint_every, max_restarts=max_restarts,
                               log=None if as_json else (lambda m: click.echo(m, err=True)))
    if dry_run:
        _check_run(job, plan_file, replace(options, out=Path(out) if out else None), plan_path,
                   as_json, job_source=config)
        return
    _run_and_report(job, plan_file, options, plan_path, as_json, job_source=config)


def _check_run(job: Any, plan_file: Any, options: Any, source: str, as_json: bool,
               job_source: str | None) -> None:
    """``execute --dry-run``: the executor's checks, and what a run would start."""
    from executor.session import check_plan

    try:
        summary = check_plan(job, plan_file, options)
    except SpecError as exc:
        raise exc.within(source=_error_source(exc, source, job_source)) from None
    # A run on several nodes writes checkpoints and exports by path from every node.
    shared = options.address is not None and summary["gpus"] > job.cluster.gpus_per_node
    if as_json:
        _emit_json({"runs": True, **summary, "needs_shared_filesystem": shared})
        return
    roles = "; ".join(f"{role} {r['training']} training / {r['generation']} generation"
                      if role == "actor" else f"{role} {r['training']}"
                      for role, r in summary["roles"].items())
    click.echo(f"the executor runs this plan: {summary['algorithm'].upper()} "
               f"{summary['mode']} on {summary['gpus']} GPUs ({summary['placement']}); "
               f"{roles}; prompts: {summary['prompts']} (nothing was started)")
    if shared:
        click.echo("note: the run spans several nodes: --out (its checkpoints) and --save-hf "
                   "must be paths every node sees (a shared filesystem), or no node holds a "
                   "whole checkpoint or export")


def _error_source(exc: SpecError, plan_source: str, job_source: str | None) -> str | None:
    """Which file an execute error is about: the job file for a job key, none for a flag,
    else the plan (which also carries the job when no --config is given)."""
    from simulator.specs.job import JOB_KEYS

    head = (exc.key or "").split(".")[0].split("[")[0]
    if head.startswith("--"):
        return None
    # "algorithm" is the plan's: a plan made for another job.
    if job_source is not None and head in JOB_KEYS and head != "algorithm":
        return job_source
    return plan_source


def _run_and_report(job: Any, plan_file: Any, options: Any, source: str,
                    as_json: bool, job_source: str | None = None) -> None:
    """Run, then print the summary and the predicted-vs-measured table; one line and a
    non-zero status when the run fails (1) or is interrupted (130)."""
    from executor.run import RunFailedError
    from executor.session import RunInterruptedError
    from executor.session import execute as run_plan

    run_dir = options.out
    try:  # checks everything (and reads the data) before any worker starts
        result = run_plan(job, plan_file, options)
    except SpecError as exc:
        raise exc.within(source=_error_source(exc, source, job_source)) from None
    except RunFailedError as exc:
        click.echo(f"hybridflow: run failed: {exc}", err=True)
        sys.exit(1)
    except RunInterruptedError as exc:
        click.echo(f"hybridflow: {exc}", err=True)
        sys.exit(130)
    steps = options.steps
    comparison = _predicted_vs_measured(run_dir, job)
    summary = {"out": str(run_dir), "steps": steps, "seconds": result.seconds,
               "iteration_seconds": [m["seconds"] for m in result.metrics],
               "rule_score": [m["rule_score"] for m in result.metrics],
               "solved": [m["solved"] for m in result.metrics],
               "predicted_vs_measured": comparison}
    if as_json:
        _emit_json(summary)
    else:
        ran = len(summary["iteration_seconds"])
        mean = sum(summary["iteration_seconds"]) / max(ran, 1)
        where = f"{plan_file.total_gpus} GPUs" if plan_file.rollout is None else \
            f"{plan_file.total_gpus}+{plan_file.rollout.gpus} GPUs, {plan_file.mode}"
        click.echo(f"ran {ran} iterations of {job.algorithm.upper()} on {plan_file.placement} "
                   f"({where}) in {result.seconds:.1f} s, {mean:.2f} s per "
                   f"iteration; score {summary['rule_score'][0]:.3f} -> "
                   f"{summary['rule_score'][-1]:.3f}")
        click.echo(f"records: {run_dir}/measurements.csv, metrics.csv, meta.json, trace.json")
        if comparison:
            click.echo(_comparison_table(comparison, job))


def _resume_run(resume: str, plan_path: str | None, steps: int | None, address: str | None,
                worker_logs: bool | None, max_restarts: int, as_json: bool) -> None:
    """``execute --resume RUN``: the run's plan, job and options from its meta.json, its last
    checkpoint's state, and the iterations still to run."""
    from executor.run import ExecutionOptions
    from planner.calibration import read_run_meta
    from simulator.plan import load_plan

    run_dir = Path(resume)
    meta_path = run_dir / "meta.json"
    meta, plan_file, job = read_run_meta(meta_path)
    if plan_path is not None and load_plan(plan_path).to_value() != plan_file.to_value():
        raise SpecError(f"the run was made with another plan than {plan_path}",
                        key="--resume", source=str(meta_path))
    saved = meta["options"]
    local = {"out": run_dir, "address": address, "worker_logs": worker_logs, "resume": run_dir,
             "max_restarts": max_restarts,
             "log": None if as_json else (lambda m: click.echo(m, err=True))}
    options = ExecutionOptions.from_saved(saved, source=str(meta_path), **local)
    if steps is not None:
        options = replace(options, steps=steps)
    _run_and_report(job, plan_file, options, str(meta_path), as_json)


def _predicted_vs_measured(run_dir: Path, job: Any) -> list[dict[str, Any]]:
    """The plan's predicted seconds (on the job's device profile, for the lengths the run
    produced) next to the measured medians, per stage and whole; stored in meta.json."""
    from planner.calibration import load_run, run_summary

    try:
        comparison = run_summary(load_run(run_dir), job.cluster.profile())
    except SpecError as exc:  # the run itself succeeded: say why there is no comparison
        click.echo(f"predicted vs measured: not available ({exc})", err=True)
        return []
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["predicted_vs_measured"] = {"device": job.cluster.profile().name, "stages": comparison}
    write_text_atomic(meta_path, json_text(meta, default=str))
    return comparison


def _comparison_table(comparison: list[dict[str, Any]], job: Any) -> str:
    """Predicted vs measured seconds as a text table, the whole iteration last."""
    lines = [f"predicted ({job.cluster.profile().name} profile, the run's lengths) vs measured, "
             "median seconds:",
             f"  {'stage':<22}{'measured':>10}{'predicted':>11}{'error':>9}"]
    for row in comparison:
        lines.append(f"  {row['node']:<22}{row['measured_seconds']:>10.4f}"
                     f"{row['predicted_seconds']:>11.4f}{row['error_pct']:>+8.1f}%")
    return "\n".join(lines)
