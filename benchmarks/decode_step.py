"""Seconds per decode step of the native generation engine on one CPU thread, over batch sizes:
``python benchmarks/decode_step.py``. Shows how the step grows with the batch (the term the
`make accuracy` runs cannot identify, see the README). Prints a table; never asserts."""

from __future__ import annotations

import argparse
import time

import torch

from executor.generation import GenerationEngine, SamplingParams
from executor.model import build_model
from simulator.specs.presets import MODEL_PRESETS


def seconds_per_step(engine: GenerationEngine, batch: int, steps: int, repeats: int) -> float:
    """(time of ``steps`` + 1 tokens - time of 1 token) / ``steps``: the decode steps alone,
    without the prompt's prefill; best of ``repeats``."""
    prompts = torch.randint(4, 60, (batch, 5), generator=torch.Generator().manual_seed(0))
    never = 10**6  # an end-of-sequence id no sampled token can take: every step runs

    def timed(tokens: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            generator = torch.Generator().manual_seed(0)
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_new_tokens=tokens, eos_token_id=never),
                            generator)
            best = min(best, time.perf_counter() - start)
        return best

    return (timed(steps + 1) - timed(1)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-2l,tiny-4l")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<10} {'batch':>6} {'ms per decode step':>20}")
    for name in args.models.split(","):
        spec = MODEL_PRESETS[name]
        engine = GenerationEngine(spec)
        engine.load({n: p.detach() for n, p in build_model(spec).named_parameters()})
        for batch in (int(b) for b in args.batches.split(",")):
            ms = 1000 * seconds_per_step(engine, batch, args.steps, args.repeats)
            print(f"{name:<10} {batch:>6} {ms:>20.3f}")


if __name__ == "__main__":
    main()
