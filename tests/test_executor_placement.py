"""Plan nodes onto Ray nodes: the mapping and its checks (pure), and a fake two-node Ray
cluster (``ray.cluster_utils.Cluster``, two raylets of 2 virtual GPUs) on which each set's
workers land on the node the plan gives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.placement import RayNode, gpu_nodes, map_plan_nodes
from profiles.datafile import SpecError
from simulator.plan import ColocatedSet, Plan, RolePlan
from simulator.specs.parallel import GenerationConfig, ParallelConfig

ROOT = Path(__file__).resolve().parents[1]


def _two_set_plan() -> Plan:
    par = ParallelConfig(tp=1, dp=2, sequence_parallel=False)
    return Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor",), gpus=2, first_gpu=0),
                                        ColocatedSet(roles=("ref",), gpus=2, first_gpu=2)),
                roles={"actor": RolePlan(parallel=par, generation=GenerationConfig()),
                       "ref": RolePlan(parallel=par)})


def test_plan_nodes_map_to_ray_nodes_in_order_and_are_checked() -> None:
    nodes = gpu_nodes([
        {"NodeID": "b", "NodeManagerAddress": "10.0.0.2", "Alive": True,
         "Resources": {"GPU": 2.0}},
        {"NodeID": "a", "NodeManagerAddress": "10.0.0.1", "Alive": True,
         "Resources": {"GPU": 2.0}},
        {"NodeID": "c", "NodeManagerAddress": "10.0.0.3", "Alive": True, "Resources": {}},
        {"NodeID": "d", "NodeManagerAddress": "10.0.0.0", "Alive": False,
         "Resources": {"GPU": 8.0}}])
    assert [n.node_id for n in nodes] == ["a", "b"]  # GPU nodes alive, by address
    plan = _two_set_plan()
    mapping = map_plan_nodes(plan, 2, nodes, local=False)
    assert mapping.bundle_nodes(plan, 0, 2) == ["a", "a"]
    assert mapping.bundle_nodes(plan, 1, 2) == ["b", "b"]
    with pytest.raises(SpecError, match=r"sets: the plan places GPUs on node 1 .* the Ray "
                                        r"cluster has 1 node"):
        map_plan_nodes(plan, 2, nodes[:1], local=False)
    with pytest.raises(SpecError, match=r"sets: plan node 1 needs 2 GPUs; Ray node 10.0.0.2"):
        map_plan_nodes(plan, 2, [nodes[0], RayNode("b", "10.0.0.2", 1)], local=False)
    # A local single-node Ray holds every plan node (and says so).
    local = map_plan_nodes(plan, 2, [RayNode("x", "127.0.0.1", 4)], local=True)
    assert local.shared_machine and local.bundle_nodes(plan, 1, 2) == ["x", "x"]


CLUSTER = """
import json, subprocess, sys
from ray.cluster_utils import Cluster

store = 150 * 1024 * 1024  # small: the test session's own Ray holds a large one
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 3, "num_gpus": 2, "object_store_memory": store})
cluster.add_node(num_cpus=3, num_gpus=2, object_store_memory=store)
cluster.wait_for_nodes()
try:
    result = subprocess.run([sys.executable, "-m", "planner", "execute", sys.argv[1],
                             "--config", sys.argv[2], "--steps", "1", "--out", sys.argv[3],
                             "--reward-warmup", "0", "--address", cluster.address,
                             "--no-worker-logs"], capture_output=True, text=True, timeout=600)
    print(json.dumps({"returncode": result.returncode, "stderr": result.stderr[-3000:]}))
finally:
    cluster.shutdown()
"""


def test_sets_land_on_their_planned_nodes_of_a_two_node_cluster(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({
        "algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"},
        "cluster": {"nodes": 2, "gpus_per_node": 2},
        "workload": {"prompts_per_iteration": 4, "samples_per_prompt": 2,
                     "mini_batches_per_epoch": 2}}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_two_set_plan().to_value()))
    out = tmp_path / "run"
    # One authentication mode for the cluster and its client, whatever an earlier Ray in this
    # process left in the environment.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-c", CLUSTER, str(plan), str(job), str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(result.stdout.strip().splitlines()[-1])
    assert run["returncode"] == 0, run["stderr"]
    meta = json.loads((out / "meta.json").read_text())
    placed = meta["worker_nodes"]  # per set, each rank's Ray node id
    assert len(set(placed[0])) == 1 and len(set(placed[1])) == 1
    assert placed[0][0] != placed[1][0]  # the two sets on the two nodes
    assert meta["node_map"] == {"0": placed[0][0], "1": placed[1][0]}
