"""The ``hybridflow`` command line.

Bad input ends with one line naming the file, the key and the problem, and exit status 2; a
job or plan that does not fit ends with the numbers that show why and exit status 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError, json_text, write_text_atomic
from simulator.specs.workload import MAX_SEQUENCE_TOKENS, MAX_SEQUENCES_PER_ITERATION

if TYPE_CHECKING:
    from simulator.specs.job import JobSpec

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


# ----------------------------------------------------------------------------------------------
# estimate


@cli.group()
def estimate() -> None:
    """Cost of one training step, one inference pass or one generation on a device."""


def _model_option(f: Any) -> Any:
    return click.option("--model", "model_name", required=True,
                        help="Preset name, spec YAML or Hugging Face config.json.")(f)


def _device_option(f: Any) -> Any:
    return click.option("--device", default="a100-80gb", show_default=True,
                        help="Device profile name or profile YAML.")(f)


def _load_model(name: str) -> Any:
    from simulator.specs.presets import load_model

    return load_model(name, key="--model")


@contextlib.contextmanager
def _as_flags() -> Iterator[None]:
    """Report a layout error under the command-line flag that set it (``--tp``, not ``tp``)."""
    try:
        yield
    except SpecError as exc:
        if exc.key is None:
            raise
        flag = "--" + exc.key.rsplit(".", 1)[-1].replace("_", "-")
        raise SpecError(exc.problem, key=flag) from None


def _load_device(name: str) -> Any:
    from profiles.device import load_profile

    try:
        return load_profile(name)
    except SpecError as exc:
        raise (exc.within("--device") if exc.key != "device" else
               SpecError(exc.problem, key="--device", source=exc.source)) from None


@estimate.command("train")
@_model_option
@_device_option
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs in total.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--vpp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Virtual pipeline stages per rank (interleaved 1F1B).")
@click.option("--fsdp", is_flag=True, help="FSDP / ZeRO-3 over the data-parallel ranks.")
@click.option("--distributed-optimizer", is_flag=True,
              help="Shard optimizer states over data-parallel ranks (ZeRO-1).")
@click.option("--global-batch", type=SEQUENCES, required=True,
              help="Sequences per optimizer step.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences per micro-batch per data-parallel rank.")
@click.option("--seq-len", type=TOKENS, required=True, help="Tokens per sequence.")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]),
              default="selective", show_default=True)
@click.option("--sequence-parallel/--no-sequence-parallel", default=True, show_default=True)
@click.option("--attention", type=click.Choice(["flash", "unfused"]), default="flash",
              show_default=True)
@click.option("--value-head", is_flag=True, help="Scalar value head (critic / reward).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def estimate_train(model_name: str, device: str, gpus: int, tp: int, pp: int, vpp: int,
                   fsdp: bool, distributed_optimizer: bool, global_batch: int, micro_batch: int,
                   seq_len: int, recompute: str, sequence_parallel: bool, attention: str,
                   value_head: bool, dtype: str, gpus_per_node: int, as_json: bool) -> None:
    """One optimizer step of a model with pp x tp x dp parallelism."""
    from simulator.costs.memory import does_not_fit_message
    from simulator.costs.training import mfu, train_step
    from simulator.specs.parallel import ParallelConfig

    model = _load_model(model_name)
    profile = _load_device(device)
    if gpus % (tp * pp):
        raise SpecError(f"{gpus} GPUs are not a multiple of tp*pp = {tp * pp}", key="--gpus")
    if fsdp and distributed_optimizer:
        raise SpecError("choose one of --fsdp and --distributed-optimizer", key="--fsdp")
    sharding = "fsdp" if fsdp else "optimizer" if distributed_optimizer else "none"
    with _as_flags():
        par = ParallelConfig(tp=tp, pp=pp, dp=gpus // (tp * pp), vpp=vpp, sharding=sharding,
                             recompute=recompute, sequence_parallel=sequence_parallel,
                             micro_batch_size=micro_batch)
        par.check_model(model, gpus_per_node=gpus_per_node)
    if global_batch % (par.dp * micro_batch):
        raise SpecError(f"{global_batch} sequences do not split into micro-batches of "
                        f"{micro_batch} over dp={par.dp} data-parallel ranks (give a multiple "
                        f"of {par.dp * micro_batch})", key="--global-batch")
    cost = train_step(model, profile, par, global_batch=global_batch, seq_len=seq_len,
                      dtype=dtype, value_head=value_head, gpus_per_node=gpus_per_node,
                      attention=attention)  # type: ignore[arg-type]
    tokens_per_s_per_gpu = global_batch * seq_len / cost.seconds / gpus
    fits = cost.memory.total <= profile.usable_memory_bytes
    result = {
        "model": model.name, "device": profile.name, "gpus": gpus,
        "parallel": par.short(), "micro_batches": cost.micro_batches,
        "seconds_per_iteration": cost.seconds,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "mfu": mfu(cost, profile, gpus, dtype),
        "memory_bytes_per_gpu": _memory_json(cost.memory),
        "available_memory_bytes_per_gpu": profile.usable_memory_bytes,
        "fits": fits,
        "seconds_breakdown": cost.breakdown,
    }
    if as_json:
        _emit_json(result)
    else:
        click.echo(f"{model.describe()} on {gpus} x {profile.name}, {par.short()}, "
                   f"{cost.micro_batches} micro-batches of {micro_batch}")
        click.echo(f"  seconds per iteration  {cost.seconds:.3f}")
        click.echo(f"  tokens/s per GPU       {tokens_per_s_per_gpu:.1f}")
        click.echo(f"  MFU                    {result['mfu']:.1%}")
        click.echo(f"  memory per GPU         {_gib(cost.memory.total)} "
                   f"({cost.memory.describe()} GiB) of {_gib(profile.usable_memory_bytes)}")
        click.echo("  time by part           " + ", ".join(
            f"{k} {v:.3f}s" for k, v in cost.breakdown.items() if v > 0))
    if not fits:
        click.echo(does_not_fit_message("training", cost.memory, profile.usable_memory_bytes),
                   err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


@estimate.command("infer")
@_model_option
@_device_option
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--batch", type=SEQUENCES, required=True, help="Sequences in total.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seq-len", type=TOKENS, required=True)
@click.option("--value-head", is_flag=True, help="Scalar value head (critic / reward).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def estimate_infer(model_name: str, device: str, gpus: int, tp: int, pp: int, batch: int,
                   micro_batch: int, seq_len: int, value_head: bool, dtype: str,
                   gpus_per_node: int, as_json: bool) -> None:
    """One forward pass over a batch (values, log-probs, rewards)."""
    from simulator.costs.inference import forward_pass
    from simulator.costs.memory import does_not_fit_message
    from simulator.specs.parallel import ParallelConfig

    model = _load_model(model_name)
    profile = _load_device(device)
    if gpus % (tp * pp):
        raise SpecError(f"{gpus} GPUs are not a multiple of tp*pp = {tp * pp}", key="--gpus")
    with _as_flags():
        par = ParallelConfig(tp=tp, pp=pp, dp=gpus // (tp * pp))
        par.check_model(model, gpus_per_node=gpus_per_node)
    cost = forward_pass(model, profile, par, sequences=batch, seq_len=seq_len,
                        micro_batch=micro_batch, dtype=dtype, value_head=value_head,
                        gpus_per_node=gpus_per_node)
    memory = cost.memory
    fits = memory.total <= profile.usable_memory_bytes
    result = {"model": model.name, "device": profile.name, "gpus": gpus,
              "parallel": par.short(), "seconds": cost.seconds,
              "tokens_per_s": batch * seq_len / cost.seconds,
              "memory_bytes_per_gpu": _memory_json(memory), "fits": fits}
    if as_json:
        _emit_json(result)
    else:
        click.echo(f"{model.describe()} forward on {gpus} x {profile.name}, {par.short()}")
        click.echo(f"  seconds          {cost.seconds:.3f}")
        click.echo(f"  tokens/s         {result['tokens_per_s']:.0f}")
        click.echo(f"  memory per GPU   {_gib(memory.total)} ({memory.describe()} GiB)")
    if not fits:
        click.echo(does_not_fit_message("inference", memory, profile.usable_memory_bytes),
                   err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


@estimate.command("generate")
@_model_option
@_device_option
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--batch", type=SEQUENCES, required=True,
              help="Sequences this replica generates.")
@click.option("--prompt-len", type=TOKENS, required=True)
@click.option("--response-len", type=TOKENS, required=True)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True,
              help="Running-batch cap (vLLM max_num_seqs).")
@click.option("--memory-utilization", type=click.FloatRange(0.05, 1.0), default=0.9,
              show_default=True, help="Fraction of device memory for weights + KV cache.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def estimate_generate(model_name: str, device: str, tp: int, pp: int, batch: int,
                      prompt_len: int, response_len: int, max_num_seqs: int,
                      memory_utilization: float, dtype: str, gpus_per_node: int,
                      as_json: bool) -> None:
    """Generation of a batch by one replica (prefill + continuous-batching decode)."""
    from simulator.costs.generation import generate, generation_weight_bytes, workspace_bytes
    from simulator.specs.parallel import GenerationConfig, ParallelConfig

    model = _load_model(model_name)
    profile = _load_device(device)
    with _as_flags():
        gen = GenerationConfig(tp=tp, pp=pp, max_num_seqs=max_num_seqs,
                               memory_utilization=memory_utilization)
        gen.check(model, ParallelConfig(tp=tp, pp=pp), gpus_per_node=gpus_per_node)
    limit = min(memory_utilization * profile.memory_bytes, profile.usable_memory_bytes)
    budget = (limit - generation_weight_bytes(model, gen, dtype)
              - workspace_bytes(model, gen, dtype))
    cost = generate(model, profile, gen, lengths=(response_len,) * batch, prompt_len=prompt_len,
                    kv_budget_bytes=budget, dtype=dtype, gpus_per_node=gpus_per_node)
    result = {
        "model": model.name, "device": profile.name, "tp": tp, "pp": pp,
        "feasible": cost.feasible, "reason": cost.reason,
        "seconds": _finite(cost.seconds),
        "tokens_per_s": _finite(batch * response_len / cost.seconds) if cost.feasible else 0.0,
        "prefill_seconds": cost.prefill_seconds, "decode_seconds": _finite(cost.decode_seconds),
        "decode_steps": cost.decode_steps, "max_running": cost.max_running,
        "kv_capacity_tokens": cost.kv_capacity_tokens,
        "memory_bytes_per_gpu": _memory_json(cost.memory),
    }
    if as_json:
        _emit_json(result)
    elif cost.feasible:
        click.echo(f"{model.describe()} generating {batch} x ({prompt_len} + {response_len}) "
                   f"tokens on tp={tp} pp={pp} {profile.name}")
        click.echo(f"  seconds          {cost.seconds:.2f} (prefill {cost.prefill_seconds:.2f}, "
                   f"decode {cost.decode_seconds:.2f} over {cost.decode_steps} steps)")
        click.echo(f"  tokens/s         {result['tokens_per_s']:.0f} generated")
        click.echo(f"  running batch    {cost.max_running} (KV cache holds "
                   f"{cost.kv_capacity_tokens:.0f} tokens)")
        click.echo(f"  memory per GPU   {_gib(cost.memory.total)} ({cost.memory.describe()} GiB)")
    if not cost.feasible:
        click.echo(f"generation does not fit: {cost.reason}", err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


# ----------------------------------------------------------------------------------------------
# simulate


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


def simulation_json(job: Any, plan: Any, result: Any, estimate: Any) -> dict[str, Any]:
    """The machine-readable summary of one simulation (``simulate --json``)."""
    return {
        "job": job.name or None,
        "algorithm": job.algorithm,
        "gpus": job.cluster.total_gpus,
        "device": job.cluster.device_label,
        "cost_model": result.mode,
        "iterations": result.iterations,
        "placement": plan.placement,
        "plan": plan.describe(),
        "feasible": result.feasible,
        "reasons": list(result.reasons),
        "iteration_seconds": _finite(result.iteration_seconds),
        "throughput_tokens_per_s": result.throughput_tokens_per_s,
        "tokens_per_iteration": estimate.tokens_per_iteration,
        "stages": result.stage_seconds,
        "idle_fraction": result.idle_fraction,
        "peak_memory_bytes_per_gpu": result.peak_memory_bytes_per_gpu,
        "memory_per_set": [
            {"set": m.label, "gpus": m.gpus, "peak_node": m.peak_node,
             "available_bytes": m.available_bytes, "fits": m.fits, **_memory_json(m.peak)}
            for m in estimate.memory],
        "transition": {
            name: {"seconds": t.seconds, "bytes_received_per_gpu": t.bytes_received_per_gpu,
                   "peak_param_bytes_per_gpu": t.peak_param_bytes_per_gpu,
                   "redundant_bytes_per_gpu": t.redundant_bytes_per_gpu}
            for name, t in estimate.transition_schemes.items()},
    }


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the job stored in --plan, else the HybridFlow paper's "
                   "PPO 7B job on 16 A100s).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Plan JSON (default: colocate everything with a sensible parallel config).")
@click.option("--cost-model", type=click.Choice(["des", "paper"]), default="des",
              show_default=True,
              help="des: event simulation; paper: HybridFlow's stage-by-stage d_cost.")
@click.option("--iterations", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--overlap-iterations", is_flag=True,
              help="Let an iteration start before the previous one ends where the dataflow "
                   "allows (asynchronous); default: synchronous iterations, as RLHF trainers "
                   "run them.")
@click.option("--transition", type=click.Choice(["micro_dp", "train_group", "all_gpus"]),
              default=None,
              help="Actor train->generate resharding scheme (default: the job framework's).")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome trace (chrome://tracing, Perfetto).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Also write plan.json, simulation.json and trace.json here.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def simulate(config: str | None, plan_path: str | None, cost_model: str, iterations: int,
             overlap_iterations: bool, transition: str, trace: str | None, out: str | None,
             as_json: bool) -> None:
    """Simulate RLHF iterations of a job under a plan."""
    from simulator.default_plan import colocate_plan
    from simulator.engine import simulate_estimated
    from simulator.plan import job_as_planned
    from simulator.predict import estimate_plan
    from simulator.trace import write_chrome_trace

    if plan_path:
        plan, job = _load_plan_and_job(plan_path, config)
        _checked(plan, job, plan_path)
    else:
        job = _load_job(config)
        try:
            plan = colocate_plan(job)
        except SpecError as exc:
            raise exc.within(source=config or "the default job") from None
    job = job_as_planned(job, plan)
    estimate = estimate_plan(job, plan, transition_scheme=transition)  # type: ignore[arg-type]
    try:
        result = simulate_estimated(job, plan, estimate, mode=cost_model,  # type: ignore[arg-type]
                                    iterations=iterations, overlap_iterations=overlap_iterations)
    except SpecError as exc:
        raise exc.within(source=plan_path or config or "the default job") from None
    summary = simulation_json(job, plan, result, estimate)
    if trace:
        write_chrome_trace(trace, result.timeline, metadata={"placement": plan.placement})
    if out:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        replace(plan, predicted={k: summary[k] for k in (
            "iteration_seconds", "throughput_tokens_per_s", "peak_memory_bytes_per_gpu")},
            job=job.to_value()).save(out_dir / "plan.json")
        write_text_atomic(out_dir / "simulation.json", json_text(summary))
        write_chrome_trace(out_dir / "trace.json", result.timeline,
                           metadata={"placement": plan.placement})
    if as_json:
        _emit_json(summary)
    else:
        _print_simulation(job, plan, result, estimate)
        if out:
            click.echo(f"\nwrote {out}/plan.json, simulation.json, trace.json "
                       "(open trace.json in https://ui.perfetto.dev)")
    if not result.feasible:
        if not as_json:
            for reason in result.reasons:
                click.echo(f"does not fit: {reason}", err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


def _print_simulation(job: Any, plan: Any, result: Any, estimate: Any) -> None:
    cluster = job.cluster
    click.echo(f"{job.algorithm.upper()} on {cluster.describe()} ({result.mode} cost model)")
    click.echo(f"plan      {plan.describe(job)}")
    if not result.feasible:
        click.echo("result    infeasible")
        return
    click.echo(f"iteration {result.iteration_seconds:.2f} s   throughput "
               f"{result.throughput_tokens_per_s:,.0f} tokens/s   peak memory "
               f"{_gib(result.peak_memory_bytes_per_gpu)} per GPU")
    click.echo("stages (seconds):")
    for name, seconds in result.stage_seconds.items():
        node = estimate.nodes.get(name)
        where = "" if node is None or node.location < 0 else f"  [set {node.location}]"
        click.echo(f"  {name:<24} {seconds:10.2f}{where}")
    click.echo("idle fraction per set: " + ", ".join(
        f"{label} {idle:.0%}" for label, idle in result.idle_fraction.items()))
    if estimate.transition_schemes:
        click.echo("actor transition (per GPU): " + "; ".join(
            f"{name} {t.bytes_received_per_gpu / 1e9:.2f} GB in {t.seconds * 1000:.1f} ms"
            for name, t in estimate.transition_schemes.items()))


# ----------------------------------------------------------------------------------------------
# plan / compare


def _number_list(text: str, parse: Any, flag: str) -> tuple:
    try:
        values = tuple(parse(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecError(f"expected comma-separated numbers, got {text!r}", key=flag) from None
    return values


def _search_options(top: int, backend: str, micro_batches: str, max_num_seqs: str = "",
                    memory_utilization: str = "", objective: str = "throughput",
                    pay_for: str = "cluster", deadline: float | None = None,
                    deadline_without_objective: bool = False) -> Any:
    from planner.objective import Ranking
    from planner.search import SearchOptions
    from planner.space import SpaceOptions

    flags = {"objective": "--objective", "pay_for": "--pay-for",
             "deadline_seconds_per_iteration": "--deadline-seconds-per-iteration"}
    try:
        ranking = Ranking(objective=objective, pay_for=pay_for,  # type: ignore[arg-type]
                          deadline_seconds_per_iteration=deadline)
    except SpecError as exc:
        raise SpecError(exc.problem, key=flags.get(exc.key or "", exc.key)) from None
    if deadline is not None and objective != "cost-at-deadline" and \
            not deadline_without_objective:
        raise SpecError("a deadline ranks plans only with --objective cost-at-deadline",
                        key="--deadline-seconds-per-iteration")

    sizes = _number_list(micro_batches, int, "--micro-batches")
    if not sizes or min(sizes) < 1:
        raise SpecError("give at least one positive integer", key="--micro-batches")
    caps = _number_list(max_num_seqs, int, "--max-num-seqs")
    if caps and min(caps) < 1:
        raise SpecError("running-batch caps must be positive integers", key="--max-num-seqs")
    fractions = _number_list(memory_utilization, float, "--gpu-memory-utilization")
    if fractions and not all(0 < f <= 1 for f in fractions):
        raise SpecError("fractions must be in (0, 1]", key="--gpu-memory-utilization")
    return SearchOptions(top_k=top, ranking=ranking, space=SpaceOptions(
        backend=backend, micro_batches=sizes, max_num_seqs=caps,  # type: ignore[arg-type]
        memory_utilization=fractions))


def _resized(job: Any, gpus: int | None, source: str | None) -> Any:
    if gpus is None:
        return job
    try:
        return job.with_cluster(job.cluster.with_total_gpus(gpus))
    except SpecError as exc:
        # On a mixed cluster the sizes that work depend on the job's groups: name its file.
        where = None if job.cluster.is_homogeneous else (source or "the default job")
        raise SpecError(exc.problem, key="--gpus", source=where) from None


@contextlib.contextmanager
def _about(source: str | None) -> Iterator[None]:
    """Errors about the job (raised while planning) name the job's file."""
    try:
        yield
    except SpecError as exc:
        raise exc.within(source=source or "the default job") from None


def _search_flags(f: Any) -> Any:
    f = click.option("--deadline-seconds-per-iteration", "deadline", type=float, default=None,
                     help="With --objective cost-at-deadline: the slowest iteration allowed, "
                          "in seconds (compare: also reports the cheapest cluster size that "
                          "meets it).")(f)
    f = click.option("--pay-for", "pay_for", type=click.Choice(["cluster", "used"]),
                     default="cluster", show_default=True,
                     help="Dollars count every GPU of the cluster (unused ones too), or only "
                          "the GPUs the plan uses.")(f)
    f = click.option("--objective", type=click.Choice(["throughput", "cost",
                                                       "cost-at-deadline"]),
                     default="throughput", show_default=True,
                     help="Rank plans by tokens per second, by tokens per dollar (fewest "
                          "dollars per iteration), or by dollars among the plans that meet "
                          "--deadline-seconds-per-iteration. Prices: the device profiles' "
                          "price_per_gpu_hour or the job's node groups'.")(f)
    f = click.option("--gpu-memory-utilization", "memory_utilization", default="",
                     help="Rollout gpu_memory_utilization values to try beside the framework's "
                          "default, e.g. 0.5,0.7,0.9.")(f)
    f = click.option("--max-num-seqs", "max_num_seqs", default="",
                     help="Rollout running-batch caps to try beside the framework's default, "
                          "e.g. 256,1024.")(f)
    f = click.option("--micro-batches", default="1,2,4", show_default=True,
                     help="Training micro-batch sizes to try (sequences per GPU).")(f)
    f = click.option("--backend", type=click.Choice(["any", "megatron", "fsdp", "simulated"]),
                     default="any", show_default=True,
                     help="Layouts to search: any = what the installed executor backends run "
                          "(torch FSDP2, and Megatron-core when installed unless the job has "
                          "data:); megatron or fsdp alone; simulated = every layout the "
                          "simulator prices, executable or not (e.g. generation pp > 1).")(f)
    return click.option("--top", "top", type=click.IntRange(min=1), default=5,
                        show_default=True, help="Plans to keep in the ranking.")(f)


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the job stored in --plan, else the HybridFlow paper's "
                   "PPO 7B job on 16 A100s).")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="Resize the job's cluster to this many GPUs.")
@click.option("--out", type=click.Path(file_okay=False), default="hybridflow-report",
              show_default=True, help="Directory for the plan and the report.")
@click.option("--placement", default=None,
              help='Evaluate only this placement, e.g. "actor,ref|critic,reward".')
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Evaluate this plan file (with the standard strategies beside it).")
@click.option("--baseline", "baseline_path", type=click.Path(dir_okay=False), default=None,
              help="A plan you already run (e.g. from `hybridflow import`): search, then show "
                   "what the best plan saves against it and why (its job is the job to plan "
                   "unless --config gives one).")
@_search_flags
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def plan(config: str | None, gpus: int | None, out: str, placement: str | None,
         plan_path: str | None, baseline_path: str | None, top: int, backend: str,
         micro_batches: str, max_num_seqs: str, memory_utilization: str, objective: str,
         pay_for: str, deadline: float | None, as_json: bool) -> None:
    """Search the best placement and parallel configs; write the plan and a report."""
    from planner.planning import plan_job
    from planner.progress import SearchProgress
    from reports.render import plan_json, write_plan_report
    from simulator.plan import parse_placement

    if placement and plan_path:
        raise SpecError("give --placement or --plan, not both", key="--placement")
    if baseline_path and plan_path:
        raise SpecError("give --plan (evaluate it) or --baseline (search and compare), not "
                        "both", key="--baseline")
    given = baseline = None
    if plan_path:
        given, job = _load_plan_and_job(plan_path, config)
        job = _resized(job, gpus, config or plan_path)
        _checked(given, job, plan_path)
    elif baseline_path:
        if gpus is not None:
            raise SpecError("the baseline runs on its own cluster; leave out --gpus",
                            key="--gpus")
        baseline, job = _load_plan_and_job(baseline_path, config, require_job=True)
        _checked(baseline, job, baseline_path)
    else:
        job = _resized(_load_job(config), gpus, config)
    options = _search_options(top, backend, micro_batches, max_num_seqs, memory_utilization,
                              objective, pay_for, deadline)
    pinned = None
    if placement:
        try:
            groups = parse_placement(placement, job.gpu_roles)
        except SpecError as exc:
            raise SpecError(exc.problem, key="--placement") from None
        pinned = tuple(tuple(r for r in job.gpu_roles if r in g) for g in groups)
    from planner.provenance import stale_calibration

    for profile in {p.name: p for p in job.cluster.profiles()}.values():
        stale = stale_calibration(profile)
        if stale:
            click.echo(f"hybridflow: warning: {stale}", err=True)
    progress = SearchProgress(enabled=not as_json)
    with _about(config or plan_path):
        result = plan_job(job, options, pinned=pinned, given=given, progress=progress)
    progress.close()
    from planner.sanity import plan_warnings

    warnings = plan_warnings(result.job, result.best)
    for warning in warnings:
        click.echo(f"hybridflow: warning: {warning}", err=True)
    files = write_plan_report(result, out)
    comparison = None
    if baseline is not None:
        from planner.baseline import compare_with_baseline

        with _about(baseline_path):
            comparison = compare_with_baseline(job, baseline, result.best)
    if as_json:
        summary = {**plan_json(result), "warnings": warnings}
        if comparison is not None:
            summary["baseline"] = comparison.to_value()
        _emit_json(summary)
    else:
        _print_plan(result, files)
        if comparison is not None:
            click.echo(f"against the baseline ({baseline_path}):")
            for line in comparison.lines():
                click.echo(f"  {line}")
    if result.best is None:
        if not as_json:
            click.echo(f"does not fit: {result.infeasible_reason}", err=True)
        sys.exit(EXIT_DOES_NOT_FIT)


def _print_plan(result: Any, files: Any) -> None:
    from reports.render import gpus_label

    job = result.job
    click.echo(f"{job.algorithm.upper()} on {job.cluster.describe()}: searched in "
               f"{result.search_seconds:.2f} s "
               f"({result.stats.candidates_evaluated} candidates)")
    rows = []
    if result.best is not None:
        rows.append((result.best.plan.strategy, result.best))
    rows += [(s.name, s.result) for s in result.strategies]
    width = max([12] + [len(gpus_label(e, job)) + 1 for _, e in rows if e is not None])
    dollars = any(e is not None and e.dollars_per_iteration is not None for _, e in rows)
    click.echo(f"  {'strategy':<11} {'placement':<28} {'GPUs':<{width}} {'s/iter':>9} "
               f"{'tokens/s':>10}" + (f" {'$/iter':>9} {'tokens/$':>11}" if dollars else ""))
    for name, evaluated in rows:
        if evaluated is None:
            outcome = next(s for s in result.strategies if s.name == name)
            click.echo(f"  {name:<11} {outcome.placement:<28} {'-':<{width}} {'-':>9} "
                       f"{'-':>10}  ({outcome.reason})")
            continue
        gpus = gpus_label(evaluated, job)
        cost = ""
        if dollars and evaluated.dollars_per_iteration is not None:
            cost = (f" {evaluated.dollars_per_iteration:>9,.2f} "
                    f"{evaluated.tokens_per_dollar or 0:>11,.0f}")
        click.echo(f"  {name:<11} {evaluated.plan.placement:<28} {gpus:<{width}} "
                   f"{evaluated.iteration_seconds:>9.2f} "
                   f"{evaluated.throughput_tokens_per_s:>10,.0f}{cost}")
    if result.modes:
        click.echo("modes (best plan of each; asynchronous ones at their steady state):")
        click.echo(f"  {'mode':<14} {'staleness':>9} {'GPUs':<{width}} {'s/iter':>9} "
                   f"{'tokens/s':>10}  allowed")
        for m in result.modes:
            e = m.result
            if e is None:
                click.echo(f"  {m.name:<14} {m.staleness:>9} {'-':<{width}} {'-':>9} "
                           f"{'-':>10}  ({m.reason})")
                continue
            click.echo(f"  {m.name:<14} {m.staleness:>9} {gpus_label(e, job):<{width}} "
                       f"{e.iteration_seconds:>9.2f} {e.throughput_tokens_per_s:>10,.0f}  "
                       f"{'yes' if m.allowed else 'no (set mode: auto to allow)'}")
    if result.best is not None:
        click.echo(f"best plan: {result.best.plan.describe(job)}")
    if result.confidence is not None:
        for line in result.confidence.lines():
            click.echo(line)
    click.echo(f"report: {files.report_html} (also report.md, plan.json, ranking.csv, "
               "strategies.csv, PNG figures)")


@cli.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="Job YAML (default: the HybridFlow paper's PPO 7B job).")
@click.option("--gpus", "gpu_list", required=True,
              help="Cluster sizes to compare, e.g. 16,32,64,96,128.")
@click.option("--out", type=click.Path(file_okay=False), default="hybridflow-compare",
              show_default=True)
@_search_flags
@click.option("--json", "as_json", is_flag=True, help="One JSON array on stdout.")
def compare(config: str | None, gpu_list: str, out: str, top: int, backend: str,
            micro_batches: str, max_num_seqs: str, memory_utilization: str, objective: str,
            pay_for: str, deadline: float | None, as_json: bool) -> None:
    """The same job at several cluster sizes: throughput per strategy and the winner (and,
    with a deadline, the cheapest size whose best plan meets it)."""
    from planner.planning import plan_job
    from planner.progress import SearchProgress
    from reports.render import deadline_verdict, gpus_label, plan_json, write_compare_report

    try:
        sizes = [int(x) for x in gpu_list.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"expected comma-separated integers, got {gpu_list!r}",
                        key="--gpus") from None
    if not sizes:
        raise SpecError("give at least one cluster size", key="--gpus")
    base = _load_job(config)
    options = _search_options(top, backend, micro_batches, max_num_seqs, memory_utilization,
                              objective, pay_for, deadline, deadline_without_objective=True)
    if deadline is not None:
        from planner.objective import check_prices

        with _about(config):
            check_prices(base)
    results = []
    for gpus in sizes:
        job = _resized(base, gpus, config)
        progress = SearchProgress(enabled=not as_json, label=f"{gpus} GPUs")
        with _about(config):
            results.append(plan_job(job, options, progress=progress))
        progress.close()
    files = write_compare_report(results, out, deadline)
    if as_json:
        _emit_json([plan_json(r) for r in results])
        return
    click.echo(f"{'GPUs':>6} {'winner placement':<28} {'GPUs per set':<14} {'s/iter':>9} "
               f"{'tokens/s':>10}   colocate / standalone / split tokens/s")
    for r in results:
        strategies = " / ".join(f"{s.result.throughput_tokens_per_s:,.0f}" if s.result else "-"
                                for s in r.strategies)
        if r.best is None:
            click.echo(f"{r.job.cluster.total_gpus:>6} does not fit")
            continue
        gpus_per_set = gpus_label(r.best, r.job)
        click.echo(f"{r.job.cluster.total_gpus:>6} {r.best.plan.placement:<28} "
                   f"{gpus_per_set:<14} {r.best.iteration_seconds:>9.2f} "
                   f"{r.best.throughput_tokens_per_s:>10,.0f}   {strategies}"
                   + (f"   ${r.best.dollars_per_iteration:,.2f}/iter"
                      if r.best.dollars_per_iteration is not None else ""))
    if deadline is not None:
        click.echo(deadline_verdict(results, deadline))
    click.echo(f"report: {files}")


# ----------------------------------------------------------------------------------------------
# execute


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
              help="Ray cluster to join (default: start a local one, virtual GPUs on CPU).")
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
    from executor.run import check_plan

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
    from executor.run import execute as run_plan
    from executor.session import RunInterruptedError

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
    from profiles.datafile import json_text, write_text_atomic

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


# ----------------------------------------------------------------------------------------------
# profile / calibrate / accuracy


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


def _executor_import(what: str) -> None:
    raise SpecError(f"{what} needs the executor's dependencies (torch): pip install -e "
                    "'.[executor]' (torch==2.13.0 first on CPU machines)", key=what)


@cli.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--world-size", type=click.IntRange(min=2), default=2, show_default=True,
              help="Processes for the collective benchmarks.")
@click.option("--out", type=click.Path(dir_okay=False), required=True,
              help="Profile YAML to write (measurements CSV beside it).")
@click.option("--quick", is_flag=True, help="A small grid (seconds), for tests.")
def profile(device: str, world_size: int, out: str, quick: bool) -> None:
    """Measure this machine and write a device profile."""
    try:
        from executor.profiler import ProfileSettings, measure_profile, write_profile
    except ImportError:
        _executor_import("profile")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError("no CUDA device on this machine", key="--device")
    path = Path(out)
    if path.suffix not in (".yaml", ".yml"):
        raise SpecError("the profile file must end in .yaml", key="--out")
    # Checked before measuring, so a wrong path fails in a second, not after the benchmarks.
    parent = path.parent
    if not parent.is_dir():
        raise SpecError(f"{parent} is not an existing directory", key="--out")
    if not os.access(parent, os.W_OK):
        raise SpecError(f"{parent} is not writable", key="--out")
    # One process per core (per GPU on CUDA): more would time the scheduler, not the links.
    available = (torch.cuda.device_count() if device == "cuda"
                 else max(2, os.cpu_count() or 2))
    if world_size > available:
        raise SpecError(f"{world_size} processes on a machine with {available} "
                        f"{'GPUs' if device == 'cuda' else 'cores'}; at most {available}",
                        key="--world-size")
    settings = ProfileSettings(device=device, world_size=world_size, quick=quick,
                               name=path.stem)
    started = __import__("time").perf_counter()
    profile_map, measurements = measure_profile(
        settings, progress=lambda message: click.echo(f"  {message}", err=True))
    write_profile(profile_map, measurements, path)
    click.echo(f"wrote {path} and {path.with_suffix('.measurements.csv')} in "
               f"{__import__('time').perf_counter() - started:.1f} s")


def _runs(paths: tuple[str, ...]) -> list[Any]:
    from planner.calibration import load_run

    if not paths:
        raise SpecError("give at least one run directory", key="RUNS")
    return [load_run(p) for p in paths]


def _verl_options(f: Any) -> Any:
    """--verl-log / --job / --plan: runs read from a verl trainer's metrics logs."""
    for option in reversed((
        click.option("--verl-log", "verl_logs", multiple=True,
                     type=click.Path(dir_okay=False),
                     help="A verl run's per-step metrics: its console output or its file "
                          "logger's JSON lines (repeatable; see README 'Calibrate from verl "
                          "logs')."),
        click.option("--job", "--config", "verl_jobs", multiple=True,
                     type=click.Path(dir_okay=False),
                     help="The job file of the verl run (one for all logs or one per log)."),
        click.option("--plan", "verl_plans", multiple=True, type=click.Path(dir_okay=False),
                     help="The plan the verl run ran (one for all logs or one per log; "
                          "default: the job's colocate plan, verl's default placement)."),
    )):
        f = option(f)
    return f


def _all_runs(paths: tuple[str, ...], logs: tuple[str, ...], jobs: tuple[str, ...],
              plans: tuple[str, ...]) -> list[Any]:
    """Executor run directories, then runs read from verl logs."""
    from planner.verl_log import load_verl_runs

    if not logs:
        for option, given in (("--job", jobs), ("--plan", plans)):
            if given:
                raise SpecError("only used with --verl-log", key=option)
        return _runs(paths)
    return (_runs(paths) if paths else []) + load_verl_runs(logs, jobs, plans)


@cli.command()
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--profile", "profile_name", required=True,
              help="Profile to start from (name or YAML).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the calibrated profile (default: NAME-calibrated.yaml "
                   "next to the base profile).")
@click.option("--fit", default=None,
              help="Comma-separated parameters to fit (default: all; see the README).")
@click.option("--framework-out", "framework_output", type=click.Path(dir_okay=False),
              default=None,
              help="Where to write the framework profile when --fit names framework.* fixed "
                   "costs (default: FRAMEWORK-calibrated.yaml in the current directory).")
@click.option("--held-out", "held_out", multiple=True, type=click.Path(file_okay=False),
              help="A run not fitted on, to measure the fit's error (repeatable). The profile "
                   "is not written when it predicts these worse than the base profile.")
@click.option("--skip", type=click.IntRange(min=0), default=1, show_default=True,
              help="Leading iterations of each run to ignore (start-up costs).")
@_verl_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def calibrate(runs: tuple[str, ...], profile_name: str, output: str | None, fit: str | None,
              framework_output: str | None, held_out: tuple[str, ...], skip: int,
              verl_logs: tuple[str, ...], verl_jobs: tuple[str, ...],
              verl_plans: tuple[str, ...], as_json: bool) -> None:
    """Fit a device profile's free parameters, and a framework profile's fixed costs, to
    executor runs or verl logs."""
    from planner.calibration import FRAMEWORK_PARAMETERS
    from planner.calibration import calibrate as fit_profile
    from planner.verl_log import DEFAULT_FIT
    from profiles.device import resolve_profile_path, write_profile_file
    from profiles.framework import write_fixed_costs_profile

    base = _load_device(profile_name)
    loaded = _all_runs(runs, verl_logs, verl_jobs, verl_plans)
    if not fit and verl_logs:
        fit = ",".join(DEFAULT_FIT)
    chosen = fit.split(",") if fit else []
    if framework_output and not any(k in FRAMEWORK_PARAMETERS for k in chosen):
        raise SpecError("only used when --fit names framework.* fixed costs",
                        key="--framework-out")
    result = fit_profile(loaded, base, fit=fit.split(",") if fit else None, skip=skip,
                         name=Path(output).stem if output else None,
                         held_out=_runs(held_out) if held_out else ())
    fits_device = not fit or any(k not in FRAMEWORK_PARAMETERS for k in chosen)
    header = f"# Calibrated by `hybridflow calibrate` from {len(loaded)} run(s)."
    written = []
    path = None
    if fits_device:
        path = Path(output) if output else resolve_profile_path(profile_name).with_name(
            f"{result.profile.name}.yaml")
        write_profile_file(result.profile, path, header=header)
        written.append(path)
    framework_path = None
    if result.fixed_costs is not None and result.framework is not None:
        framework_path = Path(framework_output) if framework_output else Path(
            f"{Path(result.framework).stem}-calibrated.yaml")
        write_fixed_costs_profile(result.framework, result.fixed_costs, framework_path,
                                  header=header + " Use it as the job's `framework:`.")
        written.append(framework_path)
    summary = {"profile": str(path) if path else None,
               "framework_profile": str(framework_path) if framework_path else None,
               "values": result.values,
               "residual_before": result.residual_before,
               "residual_after": result.residual_after, "rows": result.rows,
               "runs": list(result.runs), "at_bounds": result.at_bounds,
               "objective_before": result.objective_before,
               "objective_after": result.objective_after,
               "held_out": None if result.held_out_after is None else {
                   key: {k: result_part[k] for k in ("median_abs_error_pct",
                                                     "max_abs_error_pct", "bias_pct",
                                                     "kendall_tau")}
                   for key, result_part in (("before", result.held_out_before),
                                            ("after", result.held_out_after))}}
    if as_json:
        _emit_json(summary)
        return
    click.echo(f"fitted {len(result.values)} parameters on {result.rows} stage timings from "
               f"{len(loaded)} run(s): relative RMS error {result.residual_before:.1%} -> "
               f"{result.residual_after:.1%}")
    for key, value in result.values.items():
        bound = result.at_bounds.get(key)
        click.echo(f"  {key:<32} {value:.4g}"
                   + (f"   at its {bound} bound" if bound else ""))
    for key, bound in result.at_bounds.items():
        click.echo(f"warning: {key} ended at its {bound} bound: the runs push it past the range "
                   "the model allows, so a mechanism is missing (or it does not matter for "
                   "these runs and should be left out with --fit)", err=True)
    if result.held_out_after is not None:
        before, after = result.held_out_before, result.held_out_after
        click.echo(f"held-out runs ({len(held_out)}): median |error| per plan "
                   f"{before['median_abs_error_pct']:.1f}% -> "
                   f"{after['median_abs_error_pct']:.1f}%, max {after['max_abs_error_pct']:.1f}%,"
                   f" bias {after['bias_pct']:+.1f}%")
    for written_path in written:
        click.echo(f"wrote {written_path}")


@cli.command()
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False))
@click.option("--profile", "profile_name", default=None,
              help="Profile to predict with (default: the device in each run's job).")
@click.option("--skip", type=click.IntRange(min=0), default=1, show_default=True,
              help="Leading iterations of each run to ignore (start-up costs).")
@_verl_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def accuracy(runs: tuple[str, ...], profile_name: str | None, skip: int,
             verl_logs: tuple[str, ...], verl_jobs: tuple[str, ...],
             verl_plans: tuple[str, ...], as_json: bool) -> None:
    """The simulator's error on executor runs or verl logs, per stage and per iteration."""
    from planner.calibration import accuracy as measure

    loaded = _all_runs(runs, verl_logs, verl_jobs, verl_plans)
    device = profile_name or loaded[0].job.cluster.only_group().device
    result = measure(loaded, _load_device(device), skip=skip)
    if as_json:
        _emit_json(result)
        return
    click.echo(f"profile {result['profile']} on {result['runs']} run(s) of "
               f"{result['plans']} plan(s) (error = predicted - measured; + is too slow):")
    for run in result["per_run"]:
        repeats = f" (median of {run['repeats']} runs)" if run["repeats"] > 1 else ""
        click.echo(f"  {run['run']:<32} measured {run['measured_iteration_seconds']:.3f} s, "
                   f"predicted {run['predicted_iteration_seconds']:.3f} s per iteration "
                   f"{run['error_pct']:+6.1f}%{repeats}")
    click.echo("  per stage, median |error| (bias): " + ", ".join(
        f"{node} {s['median_abs_error_pct']:.0f}% ({s['bias_pct']:+.0f}%)"
        for node, s in result["per_stage"].items()))
    click.echo("  per backend, median |error| of its stages (bias): " + ", ".join(
        f"{name} {s['median_abs_error_pct']:.0f}% ({s['bias_pct']:+.0f}%)"
        for name, s in result["per_backend"].items()))
    tau = "n/a" if result["kendall_tau"] is None else f"{result['kendall_tau']:.2f}"
    click.echo(f"per plan: median |error| {result['median_abs_error_pct']:.1f}%, max "
               f"{result['max_abs_error_pct']:.1f}%, bias {result['bias_pct']:+.1f}%; ranking "
               f"of plans (Kendall tau) {tau}")


# ----------------------------------------------------------------------------------------------
# validate


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def validate(as_json: bool) -> None:
    """Compare the cost models with published measurements."""
    from profiles.datafile import to_mapping
    from simulator.validation import run_validation

    table, groups = run_validation(bands=True)
    if as_json:
        _emit_json({
            "cases": table.to_dict(orient="records"),
            "groups": [{"group": g.group, "source": g.source, "cases": g.cases,
                        "mean_abs_error_pct": g.mean_abs_error_pct,
                        "median_abs_error_pct": g.median_abs_error_pct,
                        "max_abs_error_pct": g.max_abs_error_pct,
                        "bias_pct": g.bias_pct, "bias_direction": g.bias_direction,
                        "metric": g.metric,
                        "target_max_abs_error_pct": g.target_max_abs_error_pct,
                        "meets_target": g.meets_target,
                        "goal_median_abs_error_pct": g.goal_median_abs_error_pct,
                        "meets_goal": g.meets_goal,
                        "gate_mean_abs_error_pct": g.gate_mean_abs_error_pct,
                        "gate_max_abs_error_pct": g.gate_max_abs_error_pct,
                        "within_gate": g.within_gate,
                        "assumptions": list(g.assumptions),
                        "winners": list(g.winners),
                        "sample": g.sample_label,
                        "first_seen": None if g.first_seen is None else
                        to_mapping(g.first_seen),
                        "bands": [to_mapping(b) for b in g.bands]} for g in groups],
        })
    else:
        click.echo("error = (predicted - measured) / measured; bias = mean error, with what "
                   "its sign means for the group's metric")
        click.echo("out of sample (first seen, the cases added by a commit that changed no cost "
                   "model; simulator/data/validation_cases.yaml says how):")
        for g in groups:
            seen = g.first_seen
            if seen is not None and seen.cases_only:
                click.echo(f"  {g.group:<32} median |error| {seen.median_abs_error_pct:.1f}%, "
                           f"mean {seen.mean_abs_error_pct:.1f}%, max "
                           f"{seen.max_abs_error_pct:.1f}% at {seen.commit}; today "
                           f"{g.sample_label}: median {g.median_abs_error_pct:.1f}%")
        for g in groups:
            rows = table[table["group"] == g.group]
            click.echo(f"\n{g.group}  ({rows['metric'].iloc[0]})")
            click.echo(f"  source: {g.source}")
            for assumption in g.assumptions:
                click.echo(f"  assumption: {assumption}")
            click.echo(f"  {'case':<40} {'measured':>10} {'predicted':>10} {'error':>8}")
            for _, row in rows.iterrows():
                # A published stage timer of the case above (not in the group's statistics).
                label = f"  . {row['stage']}" if row["stage"] else row["case"]
                click.echo(f"  {label:<40} {row['measured']:>10.2f} "
                           f"{row['predicted']:>10.2f} {row['error_pct']:>+7.1f}%")
            target = ("" if g.target_max_abs_error_pct is None else
                      f"   target max <= {g.target_max_abs_error_pct:g}%: "
                      f"{'met' if g.meets_target else 'MISSED'}")
            goal = ("" if g.goal_median_abs_error_pct is None else
                    f"   goal median <= {g.goal_median_abs_error_pct:g}%: "
                    f"{'met' if g.meets_goal else 'MISSED'}")
            gate = (f"   gate {g.gate_mean_abs_error_pct:g}% / {g.gate_max_abs_error_pct:g}%: "
                    + ("held" if g.within_gate else "REGRESSED"))
            click.echo(f"  mean |error| {g.mean_abs_error_pct:.2f}%   median "
                       f"{g.median_abs_error_pct:.2f}%   max |error| "
                       f"{g.max_abs_error_pct:.2f}%   bias {g.bias_pct:+.2f}% ({g.bias_direction})"
                       f"{target}{goal}{gate}")
            seen = g.first_seen
            if seen is not None:
                how = "cases alone" if seen.cases_only else "with cost-model changes"
                click.echo(f"  first seen at {seen.commit} ({how}): mean |error| "
                           f"{seen.mean_abs_error_pct:.1f}%   median "
                           f"{seen.median_abs_error_pct:.1f}%   max {seen.max_abs_error_pct:.1f}%;"
                           f" today's figure is {g.sample_label}")
            for winner in g.winners:
                click.echo(f"  faster mode at {winner}")
            _echo_bands(g)
    if not all(g.passes for g in groups):
        sys.exit(EXIT_DOES_NOT_FIT)


def _echo_bands(group) -> None:
    """A group's error over each assumed input's plausible range (validation_bands)."""
    if not group.bands:
        return
    click.echo("  assumption bands (median |error| at each value; the other bands nominal):")
    for band in group.bands:
        values = ", ".join(f"{p.value or p.setting} {p.median_abs_error_pct:.1f}%"
                           for p in band.points)
        low, high = band.median_range
        max_low, max_high = band.max_range
        goal = f"; goal {band.goal}" if band.goal else ""
        where = f" ({band.key})" if band.key else ""
        click.echo(f"    {band.band}{where}: median {low:.1f}-{high:.1f}%, max "
                   f"{max_low:.1f}-{max_high:.1f}%{goal}")
        if band.key:
            click.echo(f"      at {values}")
            click.echo(f"      why this range: {' '.join(band.reason.split())}")


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


# ----------------------------------------------------------------------------------------------
# list


@cli.command("list")
@click.argument("what", type=click.Choice(["models", "devices", "algorithms"]))
def list_(what: str) -> None:
    """List model presets, device profiles or algorithms."""
    if what == "models":
        from simulator.specs.presets import MODEL_PRESETS

        for name, model in MODEL_PRESETS.items():
            moe = (f"  moe {model.moe.experts} experts top-{model.moe.top_k}, "
                   f"{model.active_param_count / 1e9:.2f}B active" if model.moe else "")
            click.echo(f"{name:<16} {model.param_count / 1e9:8.2f}B  layers {model.layers:<4} "
                       f"hidden {model.hidden:<6} heads {model.heads}/{model.kv_heads}{moe}")
    elif what == "devices":
        from profiles.device import available_profiles, load_profile

        names = available_profiles()
        width = max(12, *(len(n) for n in names))
        for name in names:
            p = load_profile(name)
            click.echo(f"{name:<{width}} {p.peak_flops('bf16') / 1e12:6.0f} TFLOP/s bf16  "
                       f"{p.memory_bytes / GIB:6.1f} GiB  {p.description}")
            measured = _held_out_accuracy(p)
            if measured:
                click.echo(f"{'':<{width}} {measured}")
    else:
        from simulator.specs.dataflow import DATAFLOWS

        for name, dataflow in DATAFLOWS.items():
            click.echo(f"{name:<10} roles: {', '.join(dataflow.roles):<32} {dataflow.description}")


cli.add_command(__import__("planner.export.command", fromlist=["export"]).export)
cli.add_command(__import__("planner.export.import_command",
                           fromlist=["import_launch"]).import_launch)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the CLI and turns input errors into one-line messages."""
    try:
        cli.main(args=argv, prog_name="hybridflow", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        # One line, like every other bad input (click's own show() adds the usage block).
        command = exc.ctx.command_path if exc.ctx else "hybridflow"
        click.echo(f"hybridflow: error: {exc.format_message()} "
                   f"(see `{command} --help`)", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_BAD_INPUT if exc.exit_code == 2 else exc.exit_code)
    except SpecError as exc:
        click.echo(f"hybridflow: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as exc:
        click.echo(f"hybridflow: error: {exc.filename or ''}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("HYBRIDFLOW_DEBUG"):
            raise
        click.echo(f"hybridflow: internal error: {type(exc).__name__}: {exc} "
                   "(set HYBRIDFLOW_DEBUG=1 for the traceback)", err=True)
        sys.exit(3)
