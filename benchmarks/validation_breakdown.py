"""Where the time of each whole-step validation case goes, and how much an unpublished
response-length tail would add: ``python benchmarks/validation_breakdown.py``.

For every case of the ``rlhf_step`` groups in ``simulator/data/validation_cases.yaml``: the
measured step, the predicted one, each node's predicted seconds (with the generation's parts:
decode, fixed engine costs, offload), and the step again with the responses drawn from a
lognormal of the same mean (sigma 0.3, 0.6, 0.9) clipped at the sequence budget. The tail is
an assumption the sources do not publish; this only shows how much it can matter. Prints;
never asserts.
"""

from __future__ import annotations

import copy
import math

from profiles.datafile import read_mapping
from simulator.default_plan import colocate_plan
from simulator.engine import simulate
from simulator.predict import estimate_plan
from simulator.specs.job import job_from_mapping
from simulator.validation import CASES_FILE

SEQUENCE_BUDGET_TOKENS = 4096
"""Prompt + response budget of the NeMo-RL recipes (max_total_sequence_length)."""


def main() -> None:
    data = read_mapping(CASES_FILE)
    for group, spec in data.items():
        if spec.get("kind") != "rlhf_step":
            continue
        print(f"{group}")
        for case in spec["cases"]:
            job = job_from_mapping(case["job"])
            plan = colocate_plan(job)
            estimate = estimate_plan(job, plan)
            predicted = simulate(job, plan).iteration_seconds
            print(f"  {case['name']}: measured {case['measured']:.1f} s, predicted "
                  f"{predicted:.1f} s ({100 * (predicted / case['measured'] - 1):+.0f}%)")
            for name, node in estimate.nodes.items():
                parts = ", ".join(f"{key.removesuffix('_seconds')} {value:.1f}"
                                  for key, value in node.detail.items()
                                  if key.endswith("_seconds") and value > 0.05)
                print(f"    {name:<22} {node.seconds:8.1f} s   {parts}")
            if estimate.transition is not None:
                print(f"    {'actor.transition':<22} {estimate.transition.seconds:8.1f} s")
            workload = case["job"]["workload"]
            mean = float(workload["response_length"])
            cap = SEQUENCE_BUDGET_TOKENS - int(workload["prompt_length"])
            tails = []
            for sigma in (0.3, 0.6, 0.9):
                varied = copy.deepcopy(case["job"])
                varied["workload"]["response_length"] = {
                    "distribution": "lognormal", "median": mean / math.exp(sigma**2 / 2),
                    "sigma": sigma, "max": cap}
                tail_job = job_from_mapping(varied)
                seconds = simulate(tail_job, colocate_plan(tail_job)).iteration_seconds
                tails.append(f"sigma {sigma}: {seconds:.1f} s")
            print(f"    with a lognormal tail of the same mean (clipped at {cap}): "
                  + ", ".join(tails))


if __name__ == "__main__":
    main()
