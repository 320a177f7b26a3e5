"""How far the search's interpolation of decode seconds between the caps of its grid
(planner/frontier.py, ``_cap_grid``) is from pricing every cap: 40 random running caps in each
of three long-tailed batches. Prints; never asserts."""

from __future__ import annotations

import random
import statistics

from planner.frontier import _cap_grid
from profiles.device import load_profile
from simulator.costs.generation import ReplicaBatch, decode
from simulator.specs.lengths import LengthDistribution
from simulator.specs.parallel import GenerationConfig
from simulator.specs.presets import MODEL_PRESETS

LOGNORMAL = LengthDistribution(distribution="lognormal", median=600, sigma=0.7, max=2048)
MAX_ENTROPY = LengthDistribution(distribution="max_entropy", mean=700, max=2048)
CASES = [  # (model, lengths, responses, replicas, generation tp)
    ("llama2-70b", LOGNORMAL, 1_000_000, 16, 8),
    ("llama2-7b", LOGNORMAL, 8192, 8, 2),
    ("llama2-7b", MAX_ENTROPY, 65536, 16, 1),
]


def decode_seconds(model: str, gen: GenerationConfig, batch: ReplicaBatch, cap: int) -> float:
    return decode(MODEL_PRESETS[model], load_profile("a100-80gb"), gen, lengths=batch,
                  prompt_len=1024, cap=cap)[0]


def main() -> None:
    rng = random.Random(0)
    for model, lengths, responses, replicas, tp in CASES:
        gen = GenerationConfig(tp=tp, max_num_seqs=1024)
        batch = ReplicaBatch(distribution=lengths, total_sequences=responses,
                             replicas=replicas)
        errors = []
        for cap in rng.sample(range(17, 1024), 40):
            lo, hi = _cap_grid(cap, 1024)
            if lo == hi:
                continue
            exact = decode_seconds(model, gen, batch, cap)
            t = (cap - lo) / (hi - lo)
            low, high = decode_seconds(model, gen, batch, lo), decode_seconds(model, gen, batch,
                                                                              hi)
            errors.append(100 * abs(low + t * (high - low) - exact) / exact)
        print(f"{model} {lengths.distribution} {responses:,} responses / {replicas} replicas: "
              f"|error| median {statistics.median(errors):.3f}%, max {max(errors):.3f}% over "
              f"{len(errors)} caps")


if __name__ == "__main__":
    main()
