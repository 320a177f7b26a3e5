"""Ranking plans by dollars: tokens per dollar, the cheapest plan that meets a deadline,
paying for the whole cluster or only the GPUs used."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.objective import Ranking, check_prices, cluster_dollars_per_second
from planner.planning import cheapest_meeting_deadline, plan_job
from planner.search import SearchOptions, brute_force, search
from planner.space import SpaceOptions
from profiles.datafile import SpecError
from simulator.specs.cluster import ClusterSpec, NodeGroup
from simulator.specs.job import default_job, job_from_mapping

TINY_SPACE = SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")


def tiny_job(groups: list[dict]):
    # hybridflow: the executor's space places models on any group (frameworks that size their
    # pools in nodes of one shape keep a plan on one group).
    return job_from_mapping({
        "algorithm": "ppo", "framework": "hybridflow",
        "models": {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-2l",
                   "reward": "tiny-2l"},
        "cluster": {"node_groups": groups},
        "workload": {"prompts_per_iteration": 64, "prompt_length": 16,
                     "mini_batches_per_epoch": 2,
                     "response_length": {"distribution": "uniform", "min": 4, "max": 32}}})


MIXED = [{"nodes": 1, "gpus_per_node": 4, "device": "a100-80gb"},
         {"nodes": 1, "gpus_per_node": 4, "device": "h20"}]


def test_paying_for_the_cluster_ranks_as_throughput_does() -> None:
    job = tiny_job(MIXED)
    fastest = search(job, SearchOptions(space=TINY_SPACE, top_k=3))
    cheapest = search(job, SearchOptions(space=TINY_SPACE, top_k=3,
                                         ranking=Ranking(objective="cost")))
    assert [c.sort_key()[2:] for c in cheapest.ranking] == \
        [c.sort_key()[2:] for c in fastest.ranking]
    rate = cluster_dollars_per_second(job.cluster)
    for c in cheapest.ranking:
        assert c.dollars_per_iteration == pytest.approx(c.iteration_seconds * rate)


@pytest.mark.parametrize("ranking", [
    Ranking(objective="cost", pay_for="used"),
    Ranking(objective="cost-at-deadline", pay_for="used", deadline_seconds_per_iteration=1.2),
    Ranking(objective="cost-at-deadline", pay_for="cluster", deadline_seconds_per_iteration=1.2),
], ids=["cost, pay for used", "cost at deadline, pay for used",
        "cost at deadline, pay for cluster"])
def test_cost_search_equals_brute_force(ranking: Ranking) -> None:
    job = tiny_job(MIXED)
    found = search(job, SearchOptions(space=TINY_SPACE, top_k=2, ranking=ranking))
    reference = brute_force(job, TINY_SPACE, ranking=ranking)
    assert found.best is not None and reference is not None
    assert found.best.sort_key() == reference.sort_key()
    if ranking.deadline_seconds_per_iteration is not None:
        assert all(c.iteration_seconds <= 1.2 for c in found.ranking)


def test_paying_for_used_gpus_prefers_fewer_cheaper_gpus() -> None:
    """A tiny job barely speeds up with more GPUs, so paying only for what it uses, the
    cheapest plan leaves GPUs idle while the fastest uses them all."""
    job = tiny_job(MIXED)
    fastest = search(job, SearchOptions(space=TINY_SPACE, top_k=1)).best
    cheapest = search(job, SearchOptions(space=TINY_SPACE, top_k=1, ranking=Ranking(
        objective="cost", pay_for="used"))).best
    assert sum(cheapest.sizes) < sum(fastest.sizes)
    assert cheapest.dollars_per_iteration < fastest.iteration_seconds * sum(
        size * (3.43088125 if group == 0 else 3.06) for size, group in
        zip(fastest.sizes, fastest.set_node_groups(), strict=True)) / 3600


def test_a_deadline_nothing_meets_says_how_fast_the_fastest_is() -> None:
    job = tiny_job(MIXED)
    result = plan_job(job, SearchOptions(space=TINY_SPACE, top_k=1, ranking=Ranking(
        objective="cost-at-deadline", deadline_seconds_per_iteration=0.01)))
    assert result.best is None
    assert "no plan meets the deadline of 0.01 s per iteration" in result.infeasible_reason
    assert "the fastest plan" in result.infeasible_reason


def test_a_groups_price_overrides_its_device_profiles() -> None:
    cheap = [dict(MIXED[0], price_per_gpu_hour=1.0), MIXED[1]]
    default, overridden = tiny_job(MIXED), tiny_job(cheap)
    assert cluster_dollars_per_second(overridden.cluster) == pytest.approx(
        (4 * 1.0 + 4 * 3.06) / 3600)
    assert cluster_dollars_per_second(default.cluster) > \
        cluster_dollars_per_second(overridden.cluster)


def test_a_cluster_without_prices_cannot_rank_by_cost() -> None:
    job = replace(default_job(), cluster=ClusterSpec(node_groups=(
        NodeGroup(nodes=1, gpus_per_node=2, device="cpu-2core"),)))
    with pytest.raises(SpecError) as error:
        check_prices(job)
    assert error.value.key == "cluster.price_per_gpu_hour"
    mixed = job.with_cluster(ClusterSpec(node_groups=(
        NodeGroup(nodes=1, device="a100-80gb"),
        NodeGroup(nodes=1, gpus_per_node=2, device="cpu-2core"))))
    with pytest.raises(SpecError) as error:
        check_prices(mixed)
    assert error.value.key == "cluster.node_groups[1].price_per_gpu_hour"


def test_ranking_needs_a_deadline_for_cost_at_deadline() -> None:
    with pytest.raises(SpecError) as error:
        Ranking(objective="cost-at-deadline")
    assert error.value.key == "deadline_seconds_per_iteration"
    with pytest.raises(SpecError):
        Ranking(objective="cost-at-deadline", deadline_seconds_per_iteration=-1.0)


def test_the_cheapest_size_meeting_a_deadline() -> None:
    base = tiny_job([{"nodes": 1, "gpus_per_node": 8, "device": "a100-80gb"}])
    options = SearchOptions(space=TINY_SPACE, top_k=1)
    results = [plan_job(base.with_cluster(base.cluster.with_total_gpus(g)), options)
               for g in (2, 4, 8)]
    seconds = [r.best.iteration_seconds for r in results]
    dollars = [r.best.dollars_per_iteration for r in results]
    deadline = max(seconds) * 2  # every size meets it: the cheapest one wins
    chosen = cheapest_meeting_deadline(results, deadline)
    assert chosen.best.dollars_per_iteration == min(dollars)
    tight = min(seconds)  # only the fastest size meets it
    assert cheapest_meeting_deadline(results, tight).best.iteration_seconds == tight
    assert cheapest_meeting_deadline(results, tight / 2) is None
