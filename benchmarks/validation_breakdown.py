"""Where the time of each whole-step validation case goes:
``python benchmarks/validation_breakdown.py``.

For every case of the ``rlhf_step`` groups in ``simulator/data/validation_cases.yaml``: the
measured step, the predicted one, each node's predicted seconds with its parts (decode, the
engine's sleep and wake, offload, the reference swap), and the step again with every response
at the mean length, which shows how much the length distribution (an assumption where the
source publishes only the mean) decides. For a group that measures one stage timer
(``measures:``, the refit times) the measured and predicted figures are that stage's and its
parts are listed; for a case that is a published ratio (``relative_to:``) both stages and their
ratio. Prints; never asserts.
"""

from __future__ import annotations

import copy

from profiles.datafile import merged_mapping, read_mapping
from simulator.engine import simulate
from simulator.plan import job_as_planned
from simulator.predict import estimate_plan
from simulator.specs.job import job_from_mapping
from simulator.validation import (
    CASES_FILE,
    _priced_case,
    _stage_seconds,
    _with_framework_paths,
    case_plan,
)


def main() -> None:
    data = read_mapping(CASES_FILE)
    for group, spec in data.items():
        if spec.get("kind") != "rlhf_step":
            continue
        print(f"{group}")
        spec = _with_framework_paths(spec, CASES_FILE)
        for case in spec["cases"]:
            job = job_from_mapping(case["job"])
            plan = case_plan(job, case)
            estimate = estimate_plan(job_as_planned(job, plan), plan)
            measures = spec.get("measures")
            what = "step"
            if measures is not None:
                parts_of = spec["stage_parts"][measures]
                predicted = _stage_seconds(estimate, parts_of, str(CASES_FILE))
                what = f"{measures} ({' + '.join(parts_of)})"
            else:
                predicted = simulate(job, plan).iteration_seconds
            if "relative_to" in case:
                # A published ratio: this case's stage over the same job with those settings.
                other, _, _ = _priced_case(merged_mapping(case["job"], case["relative_to"]),
                                           case, str(CASES_FILE))
                reference = _stage_seconds(other, spec["stage_parts"][measures], str(CASES_FILE))
                print(f"  {case['name']}: {what} ratio measured {case['measured']:.3f}, "
                      f"predicted {predicted:.1f} s / {reference:.1f} s = "
                      f"{predicted / reference:.3f} "
                      f"({100 * (predicted / reference / case['measured'] - 1):+.0f}%)")
            else:
                print(f"  {case['name']} ({plan.mode}): {what} measured "
                      f"{case['measured']:.1f} s, predicted {predicted:.1f} s "
                      f"({100 * (predicted / case['measured'] - 1):+.0f}%)")
            for name, node in estimate.nodes.items():
                parts = ", ".join(f"{key.removesuffix('_seconds')} {value:.1f}"
                                  for key, value in node.detail.items()
                                  if key.endswith("_seconds") and value > 0.05)
                print(f"    {name:<22} {node.seconds:8.1f} s   {parts}")
            if estimate.transition is not None:
                print(f"    {'actor.transition':<22} {estimate.transition.seconds:8.1f} s")
            fixed = copy.deepcopy(case["job"])
            response = fixed["workload"]["response_length"]
            if measures is None and isinstance(response, dict) and "mean" in response:
                fixed["workload"]["response_length"] = round(response["mean"])
                fixed_job = job_from_mapping(fixed)
                seconds = simulate(fixed_job, case_plan(fixed_job, case)).iteration_seconds
                print(f"    every response at the mean length ({round(response['mean'])}): "
                      f"{seconds:.1f} s")


if __name__ == "__main__":
    main()
