"""``hybridflow estimate``: the cost of one training step, inference pass or generation."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from profiles.datafile import SpecError

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    EXIT_DOES_NOT_FIT,
    SEQUENCES,
    TOKENS,
    _emit_json,
    _finite,
    _gib,
    _load_device,
    _memory_json,
    cli,
)


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
