"""The GPU check kit (issue 31): the executor's worker code on one device, in this process,
without Ray, measured against what the planner predicts for it.

    python -m benchmarks.gpu_check --out gpu-check                 # one NVIDIA GPU
    python -m benchmarks.gpu_check --out gpu-check --device cpu    # the dry run CI runs

It needs torch, transformers, safetensors, numpy, pandas, scipy, matplotlib, click and pyyaml
(the usual CUDA PyTorch image) and nothing else: no Ray, no vLLM (used only if installed), no
network. The models are random-weight ones built from in-repo configs (Qwen2.5-0.5B and -1.5B,
Llama-3.2-1B with its RoPE scaling on a GPU; tiny ones of the same families on the CPU).

For each model, on one device:
- the process group's backend and the tensors' device (CUDA and NCCL on a GPU, never CPU or
  gloo);
- a training step (bf16 weights, fp32 master copies and Adam states, the Megatron scheme the
  planner counts) timed and its resident and peak memory, against ``hybridflow estimate
  train`` (``simulator.costs.training.train_step``) on the device profile;
- a log-prob pass against ``hybridflow estimate infer`` (``forward_pass``);
- the train -> generate transition and a generation of realistic lengths (the native engine)
  against ``hybridflow estimate generate`` (``generate``) at the lengths it produced, and the
  peak memory of transition plus generation against the planner's generation peak;
- the model written as a Hugging Face checkpoint (``--save-hf``) and read back: every tensor
  equal;
then ``hybridflow profile``'s compute benchmarks on this device, compared field by field with
the shipped profile.

Output: one table on stdout and in ``OUT/table.md``, everything in ``OUT/results.json``. The
exit status is 1 when a check fails (the device or backend, the reload); predicted against
measured is reported, not judged: no GPU measurement of these figures exists yet to set a
tolerance from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError:  # one line, not a traceback: the kit needs the image's torch
    sys.exit(f"gpu_check: error: {sys.executable} has no torch; run the kit with the Python "
             "of a CUDA PyTorch image (make gpu-check PYTHON=/path/to/python)")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from profiles.device import DeviceProfile, load_profile  # noqa: E402
from simulator.specs.model import ModelSpec, RopeScaling  # noqa: E402
from simulator.specs.parallel import GenerationConfig, ParallelConfig  # noqa: E402
from simulator.specs.presets import MODEL_PRESETS  # noqa: E402


@dataclass(frozen=True, slots=True)
class Workload:
    """The sizes one model is checked at."""

    train_sequences: int
    """Sequences of one optimizer step."""
    micro_batch: int
    """Sequences per micro-batch (training and the log-prob pass)."""
    seq_len: int
    """Tokens per training / log-prob sequence."""
    prompts: int
    """Prompts generated at once."""
    prompt_len: int
    """Tokens per prompt."""
    new_tokens: int
    """Most tokens generated per prompt."""
    steps: int = 3
    """Timed repetitions (after one warm-up) of the step and the pass."""


GPU_WORKLOAD = Workload(train_sequences=16, micro_batch=4, seq_len=1024, prompts=64,
                        prompt_len=256, new_tokens=512)
CPU_WORKLOAD = Workload(train_sequences=4, micro_batch=2, seq_len=32, prompts=4, prompt_len=8,
                        new_tokens=8, steps=1)

LLAMA_32_1B = ModelSpec(
    # huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json: 16 layers, hidden 2048,
    # intermediate 8192, 32 heads x 64, 8 KV heads, vocab 128256, tied, rope_theta 5e5, llama3
    # rope scaling (factor 32, low 1, high 4, original 8192).
    name="llama3.2-1b", layers=16, hidden=2048, ffn_hidden=8192, heads=32, kv_heads=8,
    vocab=128256, mlp="swiglu", tied_embeddings=True, max_seq_len=131072, rope_theta=5e5,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))
TINY_QWEN2 = ModelSpec(name="tiny-qwen2", layers=2, hidden=64, ffn_hidden=128, heads=4,
                       kv_heads=2, vocab=64, mlp="swiglu", tied_embeddings=True,
                       qkv_bias=True, max_seq_len=256, rope_theta=1e6, norm_eps=1e-6)
TINY_LLAMA31 = ModelSpec(name="tiny-llama3.1", layers=2, hidden=64, ffn_hidden=128, heads=4,
                         kv_heads=2, vocab=64, mlp="swiglu", tied_embeddings=False,
                         max_seq_len=256, rope_theta=5e5, rope_scaling=RopeScaling(
                             factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16))
GPU_MODELS = (MODEL_PRESETS["qwen2.5-0.5b"], MODEL_PRESETS["qwen2.5-1.5b"], LLAMA_32_1B)
CPU_MODELS = (TINY_QWEN2, TINY_LLAMA31)


@dataclass
class Check:
    """One line of the table: a hard check (``passed``) or a prediction against a measure."""

    model: str
    what: str
    measured: float | str
    predicted: float | str | None = None
    unit: str = ""
    passed: bool | None = None
    note: str = ""

    @property
    def error_pct(self) -> float | None:
        if isinstance(self.measured, int | float) and isinstance(self.predicted, int | float) \
                and self.measured:
            return 100.0 * (self.predicted - self.measured) / self.measured
        return None

    def row(self) -> dict[str, Any]:
        return {"model": self.model, "check": self.what, "measured": self.measured,
                "predicted": self.predicted, "unit": self.unit,
                "error_pct": self.error_pct, "passed": self.passed, "note": self.note}


@dataclass
class Report:
    device: str
    profile: str
    environment: dict[str, Any]
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> None:
        self.checks.append(check)
        print(f"  {_row_text(check)}", flush=True)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]


# ----- the device and the process group -------------------------------------------------


def join_group(device: str, directory: Path) -> str:
    """A one-rank process group on ``device`` (NCCL on a GPU, gloo on the CPU), as the
    executor's workers form theirs; returns the backend torch reports."""
    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    rendezvous = directory / "rendezvous"
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1,
                            **kwargs)
    return str(dist.get_backend())


def attention_of(device: str) -> str:
    """The attention the planner prices: torch's scaled_dot_product_attention runs a flash
    kernel on a GPU, the unfused math on the CPU."""
    return "flash" if device == "cuda" else "unfused"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> float | str:
    return float(torch.cuda.max_memory_allocated()) if device == "cuda" else "n/a (CPU)"


def timed(device: str, fn: Any, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after one warm-up, and the last result."""
    result = fn()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return seconds[len(seconds) // 2], result


# ----- one model ----------------------------------------------------------------------------


def check_model(spec: ModelSpec, work: Workload, profile: DeviceProfile, device: str,
                dtype: str, report: Report, directory: Path) -> None:
    """Every check of one model on this device."""
    from executor.trainer import OptimConfig, Trainer
    from simulator.costs.inference import forward_pass
    from simulator.costs.training import train_step

    name = spec.name
    print(f"{spec.describe()}", flush=True)
    par = ParallelConfig(tp=1, dp=1, sharding="none", sequence_parallel=False,
                         recompute="none", micro_batch_size=work.micro_batch)
    reset_peak(device)
    before = float(torch.cuda.memory_allocated()) if device == "cuda" else 0.0
    trainer = Trainer(spec, par, value_head=False, seed=0, trainable=True,
                      optim=OptimConfig(lr=1e-6), dtype=dtype)
    weight = next(trainer.model.parameters())
    report.add(Check(name, "weights on the device", str(weight.device),
                     passed=weight.device.type == device,
                     note="a GPU run must never fall back to the CPU"))
    predicted = train_step(spec, profile, par, global_batch=work.train_sequences,
                           seq_len=work.seq_len, dtype=dtype, value_head=False,
                           gpus_per_node=1, attention=attention_of(device))
    resident = predicted.memory.total - predicted.memory.activations
    if device == "cuda":
        report.add(Check(name, "resident training state (weights, master, Adam, grads)",
                         float(torch.cuda.memory_allocated()) - before, resident, "bytes"))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (work.train_sequences, work.seq_len),
                        generator=generator).to(weight.device)

    def loss_fn(model: Trainer, batch: dict) -> tuple[torch.Tensor, dict]:
        log_probs = model.token_log_probs(batch["input_ids"])
        loss = -log_probs.mean()
        return loss, {"loss": loss.detach()}

    batches = [{"input_ids": ids[s]} for s in trainer.micro_batches(len(ids), work.micro_batch)]
    reset_peak(device)
    step_seconds, metrics = timed(device, lambda: trainer.step(batches, loss_fn), work.steps)
    report.add(Check(name, f"training step ({work.train_sequences} x {work.seq_len} tokens, "
                     f"micro-batch {work.micro_batch})", step_seconds, predicted.seconds, "s"))
    report.add(Check(name, "training step peak memory", peak_bytes(device),
                     predicted.memory.total if device == "cuda" else None, "bytes"))
    report.add(Check(name, "training loss finite", float(metrics["loss"]),
                     passed=math.isfinite(float(metrics["loss"]))))
    infer = forward_pass(spec, profile, par, sequences=work.train_sequences,
                         seq_len=work.seq_len, micro_batch=work.micro_batch, dtype=dtype,
                         value_head=False, gpus_per_node=1, attention=attention_of(device))
    pass_seconds, _ = timed(device, lambda: trainer.infer(ids, work.micro_batch, values=False),
                            work.steps)
    report.add(Check(name, f"log-prob pass ({work.train_sequences} x {work.seq_len})",
                     pass_seconds, infer.seconds, "s"))
    check_generation(spec, work, profile, device, dtype, trainer, report)
    check_save_hf(spec, trainer, dtype, report, directory)


def check_generation(spec: ModelSpec, work: Workload, profile: DeviceProfile, device: str,
                     dtype: str, trainer: Any, report: Report) -> None:
    """The transition into the native engine and one generation, against the planner."""
    from executor.generation import SamplingParams
    from executor.hybrid_engine import HybridEngine
    from simulator.costs.generation import generate, generation_weight_bytes, workspace_bytes

    name = spec.name
    gen = GenerationConfig(tp=1, max_num_seqs=max(work.prompts, 1), memory_utilization=0.9)
    hybrid = HybridEngine(trainer, gen, backend="native", seed=0)
    prompts = torch.randint(4, spec.vocab, (work.prompts, work.prompt_len),
                            generator=torch.Generator().manual_seed(1))
    device_prompts = prompts.to(next(trainer.model.parameters()).device)
    params = SamplingParams(max_new_tokens=work.new_tokens, eos_token_id=-1)
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    hybrid.to_generation()
    synchronize(device)
    transition_seconds = time.perf_counter() - start
    sampler = torch.Generator(device=device_prompts.device).manual_seed(0)
    start = time.perf_counter()
    out = hybrid.engine.generate(device_prompts, params, sampler)
    synchronize(device)
    generate_seconds = time.perf_counter() - start
    peak = peak_bytes(device)
    hybrid.to_training()
    lengths = tuple(int(n) for n in out.lengths.tolist())
    limit = min(gen.memory_utilization * profile.memory_bytes, profile.usable_memory_bytes)
    budget = (limit - generation_weight_bytes(spec, gen, dtype)
              - workspace_bytes(spec, gen, dtype))
    # The executor's native engine: eager PyTorch, no CUDA graphs (hybridflow.yaml).
    predicted = generate(spec, profile, gen, lengths=lengths, prompt_len=work.prompt_len,
                         kv_budget_bytes=budget, dtype=dtype, gpus_per_node=1,
                         cuda_graphs=False)
    report.add(Check(name, "train -> generate transition", transition_seconds, None, "s",
                     note="one GPU: the weights are aliased, nothing moves"))
    report.add(Check(name, f"generation ({work.prompts} x ({work.prompt_len} + up to "
                     f"{work.new_tokens}) tokens, {sum(lengths)} generated)",
                     generate_seconds, predicted.seconds, "s"))
    if device == "cuda":
        resident = trainer.resident_bytes()
        report.add(Check(name, "transition + generation peak memory", peak,
                         resident + predicted.memory.total, "bytes",
                         note="training state + the planner's generation peak"))


def check_save_hf(spec: ModelSpec, trainer: Any, dtype: str, report: Report,
                  directory: Path) -> None:
    """``--save-hf``: write the trained weights as a Hugging Face checkpoint, read it back
    with the executor's loader and compare every tensor; transformers too when it knows the
    family."""
    from executor.model import build_model, write_hf_checkpoint
    from executor.trainer import compute_dtype
    from simulator.specs.model import from_hf_config

    state = {k: v.detach().to("cpu") for k, v in trainer.hf_state().items()}
    target = directory / f"hf-{spec.name}"
    write_hf_checkpoint(target, spec, state, compute_dtype(dtype))
    reloaded = build_model(from_hf_config(target), checkpoint=target)
    back = {n: p.detach().to(compute_dtype(dtype)) for n, p in reloaded.named_parameters()}
    equal = set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    report.add(Check(spec.name, "save-hf checkpoint reloads equal", "equal" if equal
                     else "differs", passed=equal))
    try:
        import transformers
    except ImportError:
        return
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        target, output_loading_info=True, dtype=compute_dtype(dtype))
    clean = not info["missing_keys"] and not info["unexpected_keys"]
    report.add(Check(spec.name, "transformers loads it (no missing or unexpected weight)",
                     type(model).__name__, passed=clean))


# ----- hybridflow profile -------------------------------------------------------------------


def check_profile(device: str, shipped: DeviceProfile, report: Report, quick: bool) -> None:
    """``hybridflow profile``'s compute benchmarks on this device (one device: no collective
    to time), field by field against the shipped profile."""
    from executor.profiler import Measurements, ProfileSettings, measure_compute

    settings = ProfileSettings(device=device, world_size=1, quick=quick, name="gpu-check")
    measured = measure_compute(settings, Measurements())
    name = f"profile vs {shipped.name}"
    for dtype, peak in sorted(measured["peaks"].items()):
        shipped_peak = shipped.peak_flops_per_s.get(dtype)
        report.add(Check(name, f"peak {dtype} matmul", float(peak), shipped_peak, "FLOP/s",
                         note="measured best of the grid; shipped: datasheet"))
    report.add(Check(name, "memory bandwidth", float(measured["bandwidth"]),
                     shipped.memory_bandwidth_bytes_per_s, "bytes/s"))
    report.add(Check(name, "kernel launch", float(measured["launch"]),
                     shipped.overheads.kernel_launch_seconds, "s"))


# ----- output -------------------------------------------------------------------------------


def _value_text(value: Any, unit: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if unit == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if unit in ("FLOP/s", "bytes/s"):
        return f"{value:.3g} {unit}"
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.1f} us"
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.4g}"


def _row_text(check: Check) -> str:
    status = {True: "ok", False: "FAILED", None: ""}[check.passed]
    error = f"{check.error_pct:+.0f}%" if check.error_pct is not None else ""
    return (f"| {check.model} | {check.what} | {_value_text(check.measured, check.unit)} | "
            f"{_value_text(check.predicted, check.unit)} | {error} | {status} |")


def table(report: Report) -> str:
    lines = [f"GPU check kit on {report.device} (planner profile {report.profile}); "
             f"torch {report.environment['torch']}, CUDA {report.environment['cuda']}, "
             f"backend {report.environment['backend']}", "",
             "| model | check | measured | predicted | error | |", "|---|---|---|---|---|---|"]
    lines += [_row_text(c) for c in report.checks]
    return "\n".join(lines) + "\n"


def write_outputs(report: Report, out: Path) -> None:
    """``table.md`` and ``results.json`` under ``out`` (each written whole, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": report.device, "profile": report.profile,
               "environment": report.environment,
               "checks": [c.row() for c in report.checks],
               "failed": [f"{c.model}: {c.what}" for c in report.failed]}
    for filename, text in (("table.md", table(report)),
                           ("results.json", json.dumps(payload, indent=2) + "\n")):
        partial = out / f".{filename}.partial"
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, out / filename)


# ----- the command --------------------------------------------------------------------------


def run(out: Path, device: str, profile_name: str | None, skip_profile: bool) -> Report:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda, but torch sees no CUDA device "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                         "use --device cpu for the dry run")
    if profile_name is None:
        profile_name = "cpu-2core" if device == "cpu" else (
            "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-80gb")
    profile = load_profile(profile_name)
    models, work = (GPU_MODELS, GPU_WORKLOAD) if device == "cuda" else (CPU_MODELS,
                                                                       CPU_WORKLOAD)
    # The GPU check runs in bf16 as RLHF runs do; the CPU dry run in fp32 (CPU bf16 kernels
    # are slow and not what it proves).
    dtype = "bf16" if device == "cuda" else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        backend = join_group(device, Path(tmp))
        environment = {
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "backend": backend, "dtype": dtype,
            "vllm": _installed("vllm"), "ray": _installed("ray"),
        }
        report = Report(device=device, profile=profile.name, environment=environment)
        print(f"GPU check kit: {environment}", flush=True)
        expected = "nccl" if device == "cuda" else "gloo"
        report.add(Check("process group", "collective backend", backend,
                         passed=backend == expected, note=f"expected {expected}"))
        started = time.perf_counter()
        try:
            for spec in models:
                check_model(spec, work, profile, device, dtype, report, Path(tmp))
                if device == "cuda":
                    torch.cuda.empty_cache()  # the model's trainer is gone: its memory too
            if not skip_profile:
                check_profile(device, profile, report, quick=device == "cpu")
        finally:
            dist.destroy_process_group()
        environment["seconds"] = time.perf_counter() - started
    write_outputs(report, out)
    return report


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for table.md and results.json")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--profile", default=None,
                        help="device profile predicted with (default: h100-80gb, or h200 on "
                             "an H200; cpu-2core on the CPU)")
    parser.add_argument("--skip-profile", action="store_true",
                        help="leave out the hybridflow profile benchmarks")
    args = parser.parse_args(argv)
    report = run(Path(args.out), args.device, args.profile, args.skip_profile)
    print()
    print(table(report))
    if report.failed:
        print("FAILED: " + "; ".join(f"{c.model}: {c.what}" for c in report.failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
