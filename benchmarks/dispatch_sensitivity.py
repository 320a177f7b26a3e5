"""How the NeMo-RL whole-step validation depends on the driver's pickling rate (the README's
table under "Whole GRPO steps"): ``python benchmarks/dispatch_sensitivity.py``.

Re-runs the two NeMo-RL dense groups of ``simulator/data/validation_cases.yaml``, each case
under its own profile (``nemo-rl-0.3`` or ``nemo-rl-0.5``, whose rates are the same) with
``controller.serialize_bytes_per_s`` scaled, and with the dispatch unpriced, and prints each
group's median |error| and the 70B case's training and log-prob stages. Prints; never
asserts."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from profiles.datafile import read_mapping
from profiles.framework import load_framework
from simulator.validation import CASES_FILE, run_validation

GROUPS = ("nemo_rl_v03_grpo_stages", "nemo_rl_grpo_h100_step")
FACTORS = (0.75, 1.0, 1.5, 2.0, 2.5, 3.0, None)
"""Multiples of the shipped rate; None: the dispatch not priced."""


def main() -> None:
    data = read_mapping(CASES_FILE)
    shipped = load_framework("nemo-rl-0.5").controller.serialize_bytes_per_s
    assert shipped is not None
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        print(f"{'rate GB/s':>10} {'v0.3 median':>12} {'v0.4/5 median':>14}   "
              "70B training / log-probs (measured 28 / 18 s)")
        for factor in FACTORS:
            controller = ({"infer_input_bytes_per_token": 0, "train_input_bytes_per_token": 0,
                           "infer_output_bytes_per_token": 0} if factor is None
                          else {"serialize_bytes_per_s": shipped * factor})
            scaled: dict[str, str] = {}  # each case's profile -> its scaled copy
            for base in {case["job"]["framework"] for group in GROUPS
                         for case in data[group]["cases"]}:
                profile = folder / f"rate-{factor}-{base}.yaml"
                profile.write_text(yaml.safe_dump({"base": base, "name": profile.stem,
                                                   "controller": controller}))
                scaled[base] = str(profile)
            groups = {}
            for group in GROUPS:
                spec = dict(data[group])
                spec["cases"] = [{**case, "job": {**case["job"],
                                                  "framework": scaled[case["job"]["framework"]]}}
                                 for case in spec["cases"]]
                groups[group] = spec
            cases = folder / "cases.yaml"
            cases.write_text(yaml.safe_dump(groups))
            frame, summaries = run_validation(cases)
            median = {s.group: s.median_abs_error_pct for s in summaries}
            blog = frame[(frame.group == GROUPS[0]) & frame.case.str.contains("70b")]
            train = blog[blog.case.str.endswith("policy_training")].predicted.iloc[0]
            logprobs = blog[blog.case.str.endswith("logprobs")].predicted.iloc[0]
            label = "unpriced" if factor is None else f"{shipped * factor / 1e9:.2f}"
            print(f"{label:>10} {median[GROUPS[0]]:11.1f}% {median[GROUPS[1]]:13.1f}%   "
                  f"{train:.1f} / {logprobs:.1f} s")


if __name__ == "__main__":
    main()
