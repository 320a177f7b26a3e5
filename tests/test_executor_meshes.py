"""The trainer's and the 3D-HybridEngine's device meshes of a 16-GPU set (2 nodes of 8),
built with torch's fake process-group backend in a separate process: group membership,
tensor-parallel, micro-DP and generation-TP groups inside a node, one mesh per layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from executor.device import clear_meshes, shared_mesh

out = {}
for rank in range(16):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=16)
    train = shared_mesh((2, 8), ("dp", "tp"))        # training dp 2 x tp 8
    same = shared_mesh((2, 8), ("dp", "tp")) is train  # a second role on the same layout
    gen = shared_mesh((2, 2, 4), ("dp", "gen_tp", "micro_dp"))  # generation tp 2
    out[rank] = {"shared": same, **{
        name: dist.get_process_group_ranks(mesh.get_group(name))
        for mesh, names in ((train, ("dp", "tp")), (gen, ("gen_tp", "micro_dp")))
        for name in names}}
    clear_meshes()
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_meshes_group_ranks_inside_nodes_and_are_shared_per_layout() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    groups = {int(rank): value for rank, value in json.loads(result.stdout).items()}
    node = lambda rank: rank // 8  # noqa: E731
    for rank, mine in groups.items():
        assert mine["shared"]
        assert rank in mine["dp"] and rank in mine["tp"]
        assert mine["dp"] == [rank % 8, rank % 8 + 8]  # data parallel across the nodes
        assert mine["tp"] == list(range(node(rank) * 8, node(rank) * 8 + 8))
        # HybridFlow §5.3: micro-DP groups are consecutive ranks, generation-TP groups take
        # every micro_dp-th rank, both inside the training tp group, so inside the node.
        start = rank - rank % 4
        assert mine["micro_dp"] == list(range(start, start + 4))
        assert mine["gen_tp"] == [node(rank) * 8 + rank % 4, node(rank) * 8 + rank % 4 + 4]
        for name in ("tp", "micro_dp", "gen_tp"):
            assert {node(r) for r in mine[name]} == {node(rank)}, name
    # Distinct communicators of the set: 8 dp + 2 tp + 8 generation-TP + 4 micro-DP groups.
    distinct = {name: {tuple(g[name]) for g in groups.values()}
                for name in ("dp", "tp", "gen_tp", "micro_dp")}
    assert {name: len(v) for name, v in distinct.items()} == {"dp": 8, "tp": 2, "gen_tp": 8,
                                                               "micro_dp": 4}
