"""Mixed clusters: node groups of different devices, each colocated set inside one group."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner.search import Search, SearchOptions, brute_force, search
from planner.space import SpaceOptions
from profiles.datafile import SpecError
from simulator.engine import iteration_seconds
from simulator.plan import ColocatedSet, load_plan, plan_from_mapping
from simulator.predict import estimate_plan
from simulator.specs.cluster import ClusterSpec, Network, NodeGroup
from simulator.specs.job import JobSpec, default_job, job_from_mapping


def tiny_mixed_job(algorithm: str, models: dict[str, str], groups: list[dict],
                   **cluster: object) -> JobSpec:
    work = {"prompts_per_iteration": 64, "prompt_length": 16, "mini_batches_per_epoch": 2,
            "response_length": {"distribution": "uniform", "min": 4, "max": 32}}
    # hybridflow: the executor's space places models on any group.
    return job_from_mapping({"algorithm": algorithm, "models": models,
                             "framework": "hybridflow",
                             "cluster": {"node_groups": groups, **cluster}, "workload": work})


def paper_ppo() -> JobSpec:
    """The default job on the executor's framework, which places models on any group (verl
    sizes its pools in nodes of one shape: one group per plan)."""
    return replace(default_job(), framework="hybridflow")


def mixed(*groups: tuple[int, str]) -> ClusterSpec:
    return ClusterSpec(node_groups=tuple(NodeGroup(nodes=n, device=d) for n, d in groups))


def test_identical_groups_plan_as_one_group() -> None:
    job = paper_ppo()  # 2 x 8 A100
    split = job.with_cluster(mixed((1, "a100-80gb"), (1, "a100-80gb")))
    assert len(split.cluster.pools()) == 1
    one = search(job, SearchOptions(top_k=3))
    two = search(split, SearchOptions(top_k=3))
    assert [c.sort_key() for c in two.ranking] == [c.sort_key() for c in one.ranking]
    plan_one, plan_two = one.best.to_plan(job), two.best.to_plan(split)
    assert plan_two.to_value() == plan_one.to_value()
    assert iteration_seconds(split, estimate_plan(split, plan_two)) == \
        iteration_seconds(job, estimate_plan(job, plan_one))


def test_a_slower_link_between_identical_groups_keeps_them_apart() -> None:
    cluster = replace(mixed((1, "a100-80gb"), (1, "a100-80gb")),
                      inter_group_network=Network(nics_per_node=1, nic_bandwidth_gbps=10))
    assert [p.index for p in cluster.pools()] == [0, 1]


MIXED_BRUTE_FORCE_CASES = {
    "ppo, a100 + h20 nodes of 4": (
        tiny_mixed_job("ppo", {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-2l",
                               "reward": "tiny-2l"},
                       [{"nodes": 1, "gpus_per_node": 4, "device": "a100-80gb"},
                        {"nodes": 1, "gpus_per_node": 4, "device": "h20"}]),
        SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")),
    "remax, h100 + a100 nodes, slow link between": (
        tiny_mixed_job("remax", {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "tiny-2l"},
                       [{"nodes": 1, "gpus_per_node": 2, "device": "h100-80gb"},
                        {"nodes": 1, "gpus_per_node": 4, "device": "a100-80gb"}],
                       inter_group_network={"nics_per_node": 1, "nic_bandwidth_gbps": 1}),
        SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")),
}


@pytest.mark.parametrize("case", list(MIXED_BRUTE_FORCE_CASES))
def test_search_equals_brute_force_on_mixed_clusters(case: str) -> None:
    job, space = MIXED_BRUTE_FORCE_CASES[case]
    found = search(job, SearchOptions(space=space, top_k=3))
    reference = brute_force(job, space)
    assert found.best is not None and reference is not None
    assert found.best.sort_key() == reference.sort_key()
    for candidate in found.ranking:
        plan = candidate.to_plan(job)
        plan.validate(job)
        assert iteration_seconds(job, estimate_plan(job, plan)) == pytest.approx(
            candidate.iteration_seconds, rel=1e-9)


def test_mixed_cluster_beats_each_of_its_single_device_parts() -> None:
    """PPO, four Llama-2-7B, paper workload, on one H100 node and two H20 nodes. H20s have
    more memory bandwidth than H100s (4.0 vs 3.35 TB/s) but a seventh of their dense BF16
    FLOPs: the best plan generates (and trains the actor) on the sixteen H20s while the
    H100 node runs the critic, reference and reward, whose passes are compute-bound. Either
    part alone must run all four models on its own GPUs."""
    job = paper_ppo()
    h100, h20 = (1, "h100-80gb"), (2, "h20")
    both = search(job.with_cluster(mixed(h100, h20)), SearchOptions(top_k=1)).best
    alone = [search(job.with_cluster(mixed(part)), SearchOptions(top_k=1)).best
             for part in (h100, h20)]
    assert both is not None and all(a is not None for a in alone)
    assert both.iteration_seconds < min(a.iteration_seconds for a in alone)
    assert set(both.node_groups) == {0, 1}  # it uses both groups
    actor_set = next(i for i, roles in enumerate(both.placement) if "actor" in roles)
    assert both.node_groups[actor_set] == 1


def test_each_set_is_priced_on_its_own_device() -> None:
    job = paper_ppo().with_cluster(mixed((1, "h100-80gb"), (1, "h20")))
    found = Search(job, SearchOptions(top_k=1)).run(
        placements_to_try=((("actor", "critic", "ref"), ("reward",)),))
    plan = found.best.to_plan(job)
    reward_set = plan.set_index("reward")
    seconds = {}
    for group in (0, 1):
        moved = replace(plan, sets=tuple(replace(s, node_group=group) if i == reward_set else s
                                         for i, s in enumerate(plan.sets)))
        seconds[group] = estimate_plan(job, moved).nodes["reward.infer"].seconds
    assert seconds[0] < seconds[1]  # the H100 runs the reward's forward pass faster


def test_batches_between_groups_cross_the_slower_link() -> None:
    base = paper_ppo()
    groups = (NodeGroup(nodes=1, device="a100-80gb"), NodeGroup(nodes=1, device="h100-80gb"))
    fast = base.with_cluster(ClusterSpec(node_groups=groups))
    slow = base.with_cluster(ClusterSpec(node_groups=groups, inter_group_network=Network(
        nics_per_node=1, nic_bandwidth_gbps=1)))
    placement = (("actor", "ref"), ("critic", "reward"))
    best = Search(fast, SearchOptions(top_k=1)).run(placements_to_try=(placement,)).best
    plan = best.to_plan(fast)
    apart = replace(plan, sets=(replace(plan.sets[0], node_group=0, first_gpu=0),
                                replace(plan.sets[1], node_group=1, first_gpu=0)))
    together = replace(apart, sets=(apart.sets[0], replace(apart.sets[1], node_group=0)))
    fast_edges = estimate_plan(fast, apart).transfers
    slow_edges = estimate_plan(slow, apart).transfers
    # The generated batch goes from the actor's group to the critic's: the slow link shows.
    assert slow_edges[("actor.generate", "critic.infer")] > \
        fast_edges[("actor.generate", "critic.infer")]
    # Within one group the inter-group link plays no part.
    assert estimate_plan(slow, together).transfers == estimate_plan(fast, together).transfers


def test_plan_file_names_each_sets_group(tmp_path) -> None:
    job = paper_ppo().with_cluster(mixed((1, "h100-80gb"), (2, "h20")))
    best = search(job, SearchOptions(top_k=1)).best
    plan = best.to_plan(job)
    path = tmp_path / "plan.json"
    plan.save(path)
    written = json.loads(path.read_text())
    assert [s["node_group"] for s in written["sets"]] == list(best.node_groups)
    assert load_plan(path).sets == plan.sets


def test_a_set_outside_its_group_is_refused() -> None:
    job = paper_ppo().with_cluster(mixed((1, "h100-80gb"), (1, "h20")))
    plan = search(job, SearchOptions(top_k=1)).best.to_plan(job)
    value = plan.to_value()
    value["sets"][0]["node_group"] = 5
    with pytest.raises(SpecError) as missing:
        plan_from_mapping(value).validate(job)
    assert missing.value.key == "sets[0].node_group"
    too_big = replace(plan, sets=(ColocatedSet(roles=plan.sets[0].roles, gpus=16),
                                  *plan.sets[1:]))
    with pytest.raises(SpecError, match="node group 0 has 8"):
        too_big.validate(job)
