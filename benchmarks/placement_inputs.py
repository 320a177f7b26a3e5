"""The HybridFlow placement study's verdicts over the inputs the paper does not state.

The paper (arXiv 2409.19256v2, Sec. 8.3, Figs. 12-13) measured split and standalone placements
ahead of colocation for PPO with four 13B models at 96 and 128 A100s. This prints the winner
and the three standard placements' throughput at 16-128 GPUs (``hybridflow compare --backend
simulated``) at every corner of three unstated inputs, each over its plausible range. The
corners were written down before any was priced:

- the system: verl 0.7.0's defaults (the example's ``framework: verl``) or the paper's own as
  verl's first release configures it (``simulator/data/hybridflow-paper-2024.yaml``);
- the network: "200 Gbps" between machines read as one 200 Gb/s NIC per node, or eight;
- the kernels: as modelled, or training and inference 1.5x slower (NeMo-RL's training and
  log-prob passes measured 1.4-1.7x slower than this model prices them, docs/validation.md),
  applied as the A100 profile's ``train_compute`` and ``infer_compute`` corrections.

Run: ``python benchmarks/placement_inputs.py [--model 13b|34b]`` (about 25 s per corner on a
2-core machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAPER_SYSTEM = ROOT / "simulator" / "data" / "hybridflow-paper-2024.yaml"
A100 = ROOT / "profiles" / "devices" / "a100-80gb.yaml"
SIZES = "16,32,64,96,128"
SLOWER_KERNELS = {"train_compute": 1.5, "infer_compute": 1.5}


def corner_job(model: str, system: str, nics: int, slower: bool, tmp: Path) -> Path:
    """The example job with one corner's inputs, written under ``tmp``."""
    job = yaml.safe_load((ROOT / "planner" / "examples"
                          / f"hybridflow-paper-{model}.yaml").read_text(encoding="utf-8"))
    if system == "paper-2024":
        job["framework"] = str(PAPER_SYSTEM)
    job["cluster"]["network"] = {"nics_per_node": nics, "nic_bandwidth_gbps": 200}
    if slower:
        device = yaml.safe_load(A100.read_text(encoding="utf-8"))
        device["corrections"] = {**device.get("corrections", {}), **SLOWER_KERNELS}
        device_file = tmp / "a100-80gb-slower-kernels.yaml"
        device_file.write_text(yaml.safe_dump(device, sort_keys=False), encoding="utf-8")
        job["cluster"]["device"] = str(device_file)
    path = tmp / f"{model}-{system}-{nics}nic-{'slow' if slower else 'model'}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path


def verdicts(job_file: Path, out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "planner", "compare", "--config",
                           str(job_file), "--gpus", SIZES, "--backend", "simulated", "--json",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def winner(result: dict) -> str:
    best = result["best"]
    if best is None:
        return "none fits"
    placement = best["placement"]  # "actor,reward|critic,ref"
    return "colocate" if "|" not in placement else placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("13b", "34b"), default="13b")
    args = parser.parse_args()
    print(f"PPO, four llama2-{args.model}, A100-80GB: winner at {SIZES} GPUs "
          "(colocate / standalone / split tokens/s at the largest size)")
    with tempfile.TemporaryDirectory() as tmp:
        for system, nics, slower in itertools.product(("verl", "paper-2024"), (1, 8),
                                                      (False, True)):
            job_file = corner_job(args.model, system, nics, slower, Path(tmp))
            results = verdicts(job_file, Path(tmp) / "out")
            last = {s["name"]: s["throughput_tokens_per_s"] for s in results[-1]["strategies"]}
            largest = " / ".join(f"{last[n]:,.0f}" if last.get(n) else "-"
                                 for n in ("colocate", "standalone", "split"))
            print(f"  {system:<10} {nics} NIC/node  kernels "
                  f"{'x1.5' if slower else 'x1.0'}: "
                  + ", ".join(winner(r) for r in results) + f"   ({largest})", flush=True)


if __name__ == "__main__":
    main()
