"""Where a plan's GPUs are on the Ray cluster: plan node k (GPUs k*g .. k*g + g - 1 of a
cluster of g-GPU nodes) is the k-th Ray node with GPUs, ordered by address and node id.

Every worker's bundle is pinned to its node by Ray's node-id label, so a set the simulator
priced as inside one node lands inside that node, and the mapping is checked before any
worker starts. A local Ray with a single node (this machine, virtual GPUs) holds every plan
node: the run says so, since its node layout cannot be reproduced there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from profiles.datafile import SpecError
from simulator.plan import Plan

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its node id (Ray >= 2.49 label selectors)."""


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str
    address: str
    gpus: int


@dataclass(frozen=True, slots=True)
class NodeMap:
    """Ray node of every plan node a plan uses."""

    nodes: dict[int, RayNode]
    shared_machine: bool
    """All plan nodes on one Ray node (a local run)."""

    def bundle_nodes(self, plan: Plan, set_index: int, gpus_per_node: int) -> list[str]:
        """The Ray node id of each GPU (bundle) of a set (the rollout set after the training
        sets), in rank order."""
        s = plan.located_sets()[set_index]
        return [self.nodes[gpu // gpus_per_node].node_id
                for gpu in range(s.first_gpu, s.first_gpu + s.gpus)]


def gpu_nodes(ray_nodes: list[dict[str, Any]]) -> list[RayNode]:
    """Alive Ray nodes with GPUs (``ray.nodes()`` entries), by address then node id."""
    out = [RayNode(node_id=n["NodeID"], address=n.get("NodeManagerAddress", ""),
                   gpus=int(n.get("Resources", {}).get("GPU", 0)))
           for n in ray_nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
    return sorted(out, key=lambda n: (n.address, n.node_id))


def map_plan_nodes(plan: Plan, gpus_per_node: int, ray_nodes: list[RayNode], *,
                   local: bool) -> NodeMap:
    """Plan node -> Ray node; raises SpecError (before anything starts) when the cluster
    cannot hold the plan as laid out."""
    used: dict[int, int] = {}
    for s in plan.located_sets():
        for gpu in range(s.first_gpu, s.first_gpu + s.gpus):
            used[gpu // gpus_per_node] = used.get(gpu // gpus_per_node, 0) + 1
    if not ray_nodes:
        raise SpecError("the Ray cluster has no node with GPUs", key="--address")
    if local and len(ray_nodes) == 1 and len(used) > 1:
        only = ray_nodes[0]
        if only.gpus < sum(used.values()):
            raise SpecError(f"the plan uses {sum(used.values())} GPUs, this machine's Ray has "
                            f"{only.gpus}", key="sets")
        return NodeMap(nodes={k: only for k in used}, shared_machine=True)
    plan_nodes = sorted(used)
    if plan_nodes[-1] >= len(ray_nodes):
        raise SpecError(f"the plan places GPUs on node {plan_nodes[-1]} (nodes of "
                        f"{gpus_per_node} GPUs) but the Ray cluster has {len(ray_nodes)} "
                        "node(s) with GPUs", key="sets")
    mapping = {k: ray_nodes[k] for k in plan_nodes}
    for k in plan_nodes:
        if mapping[k].gpus < used[k]:
            raise SpecError(f"plan node {k} needs {used[k]} GPUs; Ray node {mapping[k].address} "
                            f"({mapping[k].node_id[:12]}) has {mapping[k].gpus}", key="sets")
    return NodeMap(nodes=mapping, shared_machine=False)
