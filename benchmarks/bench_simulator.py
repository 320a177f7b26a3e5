"""Simulator speed (``make bench``): cost-model evaluations per second (cold: every cache
cleared before each call; warm: cached) and event simulations per second for the default job.
Prints figures and the targets of issue 2; never asserts."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

from profiles.device import load_profile
from simulator.costs.generation import (
    ReplicaBatch,
    _fluid_plan,
    _rank_strata,
    decode,
    decode_exact,
    generate,
    replica_lengths,
)
from simulator.costs.inference import forward_pass
from simulator.costs.training import train_step
from simulator.costs.transformer import layer_cost
from simulator.default_plan import colocate_plan
from simulator.engine import simulate_des, simulate_paper
from simulator.predict import estimate_plan
from simulator.specs.job import default_job
from simulator.specs.lengths import _stratified, parse_lengths
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

TARGET_EVALS_PER_S = 50_000
TARGET_SIMULATION_MS = 2.0
CACHES = (train_step, forward_pass, decode, layer_cost)


def clear_caches() -> None:
    for fn in CACHES:
        fn.cache_clear()


def rate(fn: Callable[[], int], seconds: float = 2.0) -> float:
    """Calls of ``fn`` per second; ``fn`` returns how many evaluations it made."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += fn()
    return count / (time.perf_counter() - start)


def training_configs() -> list[tuple]:
    models = [MODEL_PRESETS[m] for m in ("llama2-7b", "llama2-13b", "codellama-34b",
                                         "llama2-70b")]
    out = []
    for model, tp, pp, dp, mbs, seq in itertools.product(models, (1, 2, 4, 8), (1, 2, 4),
                                                         (1, 2, 4, 8), (1, 2, 4),
                                                         (1024, 2048)):
        out.append((model, ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs), seq))
    return out


def bench_cost_models() -> dict[str, float]:
    """Cost-model evaluations per second, cold and warm.

    cold: every cost-model cache is cleared before EACH call, so every call computes its
    layer costs, collectives and memory from scratch (the first time the search meets a
    configuration). layers warm: the per-layer costs are cached but not the step (the search
    meets a new pipeline / data-parallel layout of a layer shape it has priced). warm: the
    call itself is cached (a repeat).
    """
    profile = load_profile("a100-80gb")
    configs = training_configs()
    cursor = itertools.cycle(configs)

    def cold_train() -> int:
        clear_caches()
        model, par, seq = next(cursor)
        train_step(model, profile, par, global_batch=128, seq_len=seq)
        return 1

    def layers_warm_train() -> int:
        train_step.cache_clear()
        model, par, seq = next(cursor)
        train_step(model, profile, par, global_batch=128, seq_len=seq)
        return 1

    def warm_train() -> int:
        for model, par, seq in configs[:200]:
            train_step(model, profile, par, global_batch=128, seq_len=seq)
        return 200

    def cold_infer() -> int:
        clear_caches()
        model, par, seq = next(cursor)
        forward_pass(model, profile, par, sequences=128, seq_len=seq, micro_batch=8)
        return 1

    lengths = tuple([1024] * 128)
    gen_models = itertools.cycle([(MODEL_PRESETS[m], tp) for m in ("llama2-7b", "llama2-13b")
                                  for tp in (1, 2, 4, 8)])

    def cold_generate() -> int:
        clear_caches()
        model, tp = next(gen_models)
        generate(model, profile, GenerationConfig(tp=tp), lengths=lengths, prompt_len=1024,
                 kv_budget_bytes=40e9)
        return 1

    for _ in configs:  # every layer shape priced once, for the 'layers warm' figure
        layers_warm_train()
    return {
        "train_step, cold (evals/s)": rate(cold_train),
        "train_step, layers warm (evals/s)": rate(layers_warm_train),
        "train_step, warm (evals/s)": rate(warm_train),
        "forward_pass, cold (evals/s)": rate(cold_infer),
        "generate 128 seqs, cold (evals/s)": rate(cold_generate),
    }


def bench_generation_scaling() -> dict[str, float]:
    """Milliseconds of one cold evaluation (lengths built, caches cleared) of the decode of 1k,
    64k and 1M responses per iteration on one generation replica (Llama-2-7B, tp 1, A100;
    lognormal lengths, median 400, sigma 1, at most 8192 tokens; 512-token prompts; cap 256).
    before: the path before issue 14, every stratified length listed (``sample``), shuffled,
    and the exact event loop over them; after: ``decode`` of the ``ReplicaBatch`` (the exact
    loop up to EXACT_SEQUENCES responses, the fluid model above)."""
    profile = load_profile("a100-80gb")
    model, gen = MODEL_PRESETS["llama2-7b"], GenerationConfig(tp=1)
    dist = parse_lengths({"distribution": "lognormal", "median": 400, "sigma": 1.0,
                          "max": 8192}, "response_length")

    def before(total: int) -> None:
        listed = list(dist.sample(total)[::-1])
        random.Random(0).shuffle(listed)
        decode_exact(model, profile, gen, lengths=tuple(listed), prompt_len=512, cap=256)

    def after(total: int) -> None:
        decode(model, profile, gen, lengths=ReplicaBatch(dist, total, 1), prompt_len=512,
               cap=256)

    out = {}
    for total in (1024, 65536, 1 << 20):
        for name, evaluate in (("before", before), ("after", after)):
            for cache in (decode, replica_lengths, _rank_strata, _fluid_plan, _stratified):
                cache.cache_clear()
            start = time.perf_counter()
            evaluate(total)
            out[f"decode of {total:,} responses, {name} (ms)"] = (
                (time.perf_counter() - start) * 1000)
    return out


def bench_simulation() -> dict[str, float]:
    job = default_job()
    plan = colocate_plan(job)
    estimate = estimate_plan(job, plan)
    n_des = 0
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        simulate_des(job, plan, estimate)
        n_des += 1
    des_ms = (time.perf_counter() - start) / n_des * 1000
    n_paper = 0
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        simulate_paper(job, plan, estimate)
        n_paper += 1
    paper_ms = (time.perf_counter() - start) / n_paper * 1000
    clear_caches()
    start = time.perf_counter()
    estimate_plan(job, plan)
    cold_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    for _ in range(100):
        estimate_plan(job, plan)
    warm_ms = (time.perf_counter() - start) * 10
    return {
        "event simulations of one PPO iteration per second": 1000 / des_ms,
        "event simulation of one PPO iteration (ms)": des_ms,
        "paper stage cost of one PPO iteration (ms)": paper_ms,
        "predict all nodes of a plan, cold caches (ms)": cold_ms,
        "predict all nodes of a plan, warm caches (ms)": warm_ms,
    }


def main() -> None:
    print("Simulator benchmark (default job: PPO, 4 x Llama-2-7B, 16 x A100-80GB)\n")
    costs = bench_cost_models()
    for name, value in costs.items():
        print(f"  {name:<48} {value:>12,.0f}")
    simulation = bench_simulation()
    for name, value in simulation.items():
        print(f"  {name:<48} {value:>12.3f}")
    print("\nGeneration cost vs responses per iteration (issue 14):")
    for name, value in bench_generation_scaling().items():
        print(f"  {name:<52} {value:>8.1f}")
    evals = costs["train_step, cold (evals/s)"]
    sim_ms = simulation["event simulation of one PPO iteration (ms)"]
    print("\nTargets (issue 2):")
    print(f"  >= {TARGET_EVALS_PER_S:,} cost-model evaluations/s (train_step, cold): "
          f"{evals:,.0f} -> {'met' if evals >= TARGET_EVALS_PER_S else 'MISSED'}")
    print(f"  <= {TARGET_SIMULATION_MS} ms per simulated PPO iteration: {sim_ms:.3f} ms -> "
          f"{'met' if sim_ms <= TARGET_SIMULATION_MS else 'MISSED'}")


if __name__ == "__main__":
    main()
