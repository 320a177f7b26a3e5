"""benchmarks/placement_inputs.py: each corner of the placement study's unstated inputs is the
example job with exactly that corner's system, network and kernels (the pricing itself runs
in the benchmark, about 25 s a corner)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from simulator.specs.job import load_job
from tests.conftest import EXAMPLES, ROOT


def _benchmark():
    path = ROOT / "benchmarks" / "placement_inputs.py"
    spec = importlib.util.spec_from_file_location("placement_inputs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("system", "nics", "slower"),
                         [("verl", 1, False), ("paper-2024", 8, True)])
def test_each_corner_changes_only_its_inputs(system: str, nics: int, slower: bool,
                                             tmp_path: Path) -> None:
    bench = _benchmark()
    example = load_job(EXAMPLES / "hybridflow-paper-13b.yaml")
    job = load_job(bench.corner_job("13b", system, nics, slower, tmp_path))
    assert job.framework_profile.name == ("verl" if system == "verl"
                                          else "hybridflow-paper-2024")
    assert job.cluster.only_group().effective_network().nics_per_node == nics
    profile = job.cluster.profile()
    assert profile.correction("train_compute") == (1.5 if slower else 1.0)
    assert profile.correction("infer_compute") == (1.5 if slower else 1.0)
    assert profile.memory_bytes == example.cluster.profile().memory_bytes
    assert (job.models, job.workload, job.cluster.total_gpus) == \
        (example.models, example.workload, example.cluster.total_gpus)


def test_a_winner_is_named_by_its_sets() -> None:
    bench = _benchmark()
    assert bench.winner({"best": {"placement": "actor,critic,ref,reward"}}) == "colocate"
    assert bench.winner({"best": {"placement": "actor,reward|critic,ref"}}) == \
        "actor,reward|critic,ref"
    assert bench.winner({"best": None}) == "none fits"
