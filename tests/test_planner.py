"""The auto-mapping search: exact against brute force, sane, and explains infeasible jobs."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from planner.planning import explain_infeasible, plan_job, smallest_cluster
from planner.search import Search, SearchOptions, brute_force, search
from planner.space import SpaceOptions, pack, placements, set_partitions, set_sizes
from simulator.engine import iteration_seconds, simulate
from simulator.predict import estimate_plan
from simulator.specs.job import JobSpec, RolePin, default_job, job_from_mapping, load_job
from simulator.specs.presets import MODEL_PRESETS


def tiny_job(algorithm: str, models: dict[str, str], gpus: int, device: str = "a100-80gb",
             framework: str = "hybridflow",
             **workload: object) -> JobSpec:
    work: dict[str, object] = {
        "prompts_per_iteration": 64, "prompt_length": 16, "mini_batches_per_epoch": 2,
        "response_length": {"distribution": "uniform", "min": 4, "max": 32}}
    work.update(workload)
    return job_from_mapping({"algorithm": algorithm, "models": models,
                             "cluster": {"nodes": max(1, gpus // 8),
                                         "gpus_per_node": min(8, gpus), "device": device},
                             "workload": work, "framework": framework})


def with_model(job: JobSpec, model: str, gpus: int, framework: str | None = None) -> JobSpec:
    resized = job.with_cluster(job.cluster.with_total_gpus(gpus))
    return replace(resized, models={r: MODEL_PRESETS[model] for r in job.models},
                   framework=framework or job.framework)


BRUTE_FORCE_CASES = {
    "grpo, rule reward, 16 GPUs": (
        tiny_job("grpo", {"actor": "tiny-4l", "ref": "tiny-4l", "reward": "rule"}, 16,
                 samples_per_prompt=4),
        SpaceOptions(micro_batches=(1, 2))),
    "ppo, four models, 8 GPUs": (
        tiny_job("ppo", {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-2l",
                         "reward": "tiny-2l"}, 8),
        SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")),
    "remax, 8 GPUs": (
        tiny_job("remax", {"actor": "tiny-4l", "ref": "tiny-2l", "reward": "tiny-2l"}, 8),
        SpaceOptions(micro_batches=(1,), recompute=("selective", "full"))),
    "ppo, 7B models, 16 GPUs": (
        replace(with_model(replace(default_job(), workload=replace(
            default_job().workload, prompts_per_iteration=256, prompt_length=512,
            response_length=default_job().workload.response_length.fixed(512))),
            "llama2-7b", 16, "hybridflow"), parallel={"ref": RolePin(sharding="fsdp"),
                                                      "reward": RolePin(sharding="fsdp")}),
        SpaceOptions(micro_batches=(2,), recompute=("selective",), backend="fsdp")),
    "safe-rlhf, five models, 8 GPUs": (
        replace(tiny_job("safe-rlhf", {r: "tiny-2l" for r in ("actor", "critic", "ref",
                                                               "reward", "cost")}, 8),
                parallel={r: RolePin(sharding="fsdp") for r in ("ref", "reward", "cost")}),
        SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")),
    # A profile with a per-call controller overhead: every edge, split or not, pays it.
    "remax, calibrated cpu profile, 4 GPUs": (
        tiny_job("remax", {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "tiny-2l"}, 4,
                 device="cpu-2core-calibrated", dtype="fp32", prompts_per_iteration=16),
        SpaceOptions(micro_batches=(4,), recompute=("selective",), backend="fsdp")),
}


@pytest.mark.parametrize("case", list(BRUTE_FORCE_CASES))
def test_search_finds_the_brute_force_optimum(case: str) -> None:
    job, space = BRUTE_FORCE_CASES[case]
    found = search(job, SearchOptions(space=space, top_k=3)).best
    reference = brute_force(job, space)
    assert found is not None and reference is not None
    assert found.sort_key() == reference.sort_key()  # same time, same plan
    # The plan the search returns simulates to the time it reported.
    # Every ranked plan simulates to the time the search reported for it.
    for candidate in search(job, SearchOptions(space=space, top_k=5)).ranking:
        plan = candidate.to_plan(job)
        assert iteration_seconds(job, estimate_plan(job, plan)) == pytest.approx(
            candidate.iteration_seconds, rel=1e-9)


def test_pruning_and_caching_do_not_change_the_answer() -> None:
    job, space = BRUTE_FORCE_CASES["ppo, four models, 8 GPUs"]
    fast = search(job, SearchOptions(space=space))
    slow = search(job, SearchOptions(space=space, prune=False, cache=False))
    assert fast.best.sort_key() == slow.best.sort_key()
    assert [c.sort_key() for c in fast.ranking] == [c.sort_key() for c in slow.ranking]
    assert fast.stats.candidates_evaluated < slow.stats.candidates_evaluated


def test_dropping_rows_a_leader_dominates_keeps_the_same_frontier() -> None:
    """set_frontier drops, block by block, the rows that an earlier row of smaller sum
    dominates (planner.frontier._Leaders): the rows pareto_mask keeps must not change, ties
    (equal rows, broken by a key) included."""
    import numpy as np

    from planner.frontier import _Leaders, pareto_mask

    rng = np.random.default_rng(7)
    for trial in range(20):
        rows = rng.integers(0, 6, size=(3000, 3)).astype(float)  # many exact ties
        keys = rng.permutation(len(rows))
        leaders = _Leaders(3)
        kept = np.concatenate([
            block[leaders.undominated([rows[block, j] for j in range(3)])]
            for block in np.array_split(np.arange(len(rows)), 7)])
        assert len(kept) < len(rows)

        def keys_of(among: np.ndarray, keys: np.ndarray = keys):
            return lambda picked: [int(keys[among[i]]) for i in picked]

        full = np.flatnonzero(pareto_mask(rows, key_of=keys_of(np.arange(len(rows)))))
        reduced = kept[pareto_mask(rows[kept], key_of=keys_of(kept))]
        assert sorted(full) == sorted(reduced), trial


def test_pareto_mask_keeps_what_a_row_by_row_sweep_keeps() -> None:
    """The sweep settles its live rows a block at a time: it must keep exactly the rows a
    plain sweep keeps, visiting rows by (sum, key, row) and dropping every later row within
    EPSILON of one it keeps; many survivors (anti-correlated columns) span many blocks and
    equal sums (rounded values) make the keys decide ties."""
    import numpy as np

    from planner.frontier import EPSILON, SWEEP_BLOCK, pareto_mask

    def plain_sweep(rows: np.ndarray, keys: list) -> set[int]:
        sums = rows.sum(axis=1)
        order = sorted(range(len(rows)), key=lambda r: (sums[r], keys[r], r))
        kept: list[int] = []
        for r in order:
            if not kept or not (rows[kept] <= rows[r] + EPSILON).all(axis=1).any():
                kept.append(r)
        return set(kept)

    rng = np.random.default_rng(11)
    for trial in range(4):
        a, b = np.round(rng.random(900), 2), np.round(rng.random(900), 2)
        rows = np.column_stack([a, b, np.round(2 - a - b + rng.random(900) / 20, 2)])
        keys = [int(k) for k in rng.integers(0, 50, len(rows))]
        expected = plain_sweep(rows, keys)
        assert len(expected) > 3 * SWEEP_BLOCK  # the sweep runs over several blocks
        for all_pairs in (False, True):
            kept = pareto_mask(rows, key_of=lambda picked, keys=keys: [keys[i] for i in picked],
                               all_pairs=all_pairs)
            assert set(np.flatnonzero(kept)) == expected, (trial, all_pairs)


def test_placements_are_bell_numbers() -> None:
    assert len(placements(("actor", "critic", "ref", "reward"))) == 15
    assert len(placements(("actor", "critic", "ref", "reward", "cost"))) == 52
    assert len(list(set_partitions(("a", "b", "c")))) == 5
    assert placements(("actor", "critic"))[0] == (("actor", "critic"),)  # colocate first


def test_set_shapes_and_packing() -> None:
    assert set_sizes(32, 8) == [1, 2, 4, 8, 16, 24, 32]
    assert set_sizes(4, 4) == [1, 2, 4]
    assert pack((16, 8, 8), 32, 8) == [0, 16, 24]
    assert pack((4, 8, 2, 2), 16, 8) == [8, 0, 12, 14]  # whole nodes first, then the rest
    assert pack((8, 8, 4), 16, 8) is None
    # Nodes of 6 or 3 GPUs: sub-node sets still find the holes, never straddling a node.
    assert pack((4, 4, 2, 2), 12, 6) == [0, 6, 4, 10]
    assert pack((2, 1, 2, 1), 6, 3) == [0, 2, 3, 5]
    assert pack((4, 4, 4), 12, 6) is None


def test_more_gpus_never_make_the_best_plan_slower() -> None:
    space = SpaceOptions(micro_batches=(1,), recompute=("selective",), backend="fsdp")
    base = tiny_job("ppo", {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-2l",
                            "reward": "tiny-2l"}, 8)
    times = []
    for gpus in (2, 4, 8, 16, 32):
        job = base.with_cluster(base.cluster.with_total_gpus(gpus))
        times.append(search(job, SearchOptions(space=space, top_k=1)).best.iteration_seconds)
    assert times == sorted(times, reverse=True)
    seven_b = [search(with_model(default_job(), "llama2-7b", g),
                      SearchOptions(top_k=1, space=SpaceOptions(micro_batches=(2,))))
               .best.iteration_seconds for g in (16, 32)]
    assert seven_b[1] <= seven_b[0]


def test_every_ranked_plan_fits_and_stays_within_the_cluster() -> None:
    job = default_job()
    result = plan_job(job, SearchOptions(top_k=5))
    assert len(result.ranking) == 5
    usable = job.cluster.profile().usable_memory_bytes
    for evaluated in (*result.ranking, *(s.result for s in result.strategies if s.result)):
        evaluated.plan.validate(job)
        assert evaluated.plan.total_gpus <= job.cluster.total_gpus
        assert evaluated.estimate.feasible
        assert all(m.peak.total <= usable for m in evaluated.estimate.memory)
        again = simulate(job, evaluated.plan)
        assert again.iteration_seconds == pytest.approx(evaluated.iteration_seconds)
    times = [e.iteration_seconds for e in result.ranking]
    assert times == sorted(times)
    assert result.best.iteration_seconds <= min(
        s.result.iteration_seconds for s in result.strategies if s.result)


@pytest.mark.parametrize(("model", "gpus"), [("llama2-13b", 8), ("codellama-34b", 16),
                                           ("llama2-70b", 32)])
def test_colocate_wins_on_small_clusters(model: str, gpus: int) -> None:
    # Four equal models on about the fewest GPUs that hold them: giving each model its own
    # GPUs does not fit, and sharing all GPUs beats splitting them (on a framework that can
    # place the models apart).
    job = with_model(default_job(), model, gpus, "hybridflow")
    result = plan_job(job, SearchOptions(top_k=2))
    assert result.best is not None
    assert result.best.plan.placement == "actor,critic,ref,reward"
    outcomes = {s.name: s for s in result.strategies}
    assert not outcomes["standalone"].feasible
    assert "does not fit" in outcomes["standalone"].reason


def test_infeasible_job_names_the_smallest_cluster_and_the_memory() -> None:
    job = with_model(default_job(), "llama2-70b", 8, "hybridflow")
    result = plan_job(job)
    assert result.best is None and result.ranking == ()
    assert "does not fit on 8 x a100-80gb" in result.infeasible_reason
    assert "optimizer" in result.infeasible_reason
    assert "The smallest cluster that fits: 32 GPUs" in result.infeasible_reason
    assert smallest_cluster(job) == 32
    assert "actor" in explain_infeasible(job)


GRPO_7B_ON_ONE_GPU_NODES = {
    "algorithm": "grpo", "framework": "verl",
    "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b", "reward": "rule"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "h100-80gb"},
    "workload": {"prompts_per_iteration": 512, "prompt_length": 1024, "samples_per_prompt": 8,
                 "response_length": {"distribution": "max_entropy", "mean": 1500,
                                     "max": 4096}}}
PPO_FOUR_7B_ON_ONE_GPU_NODES = {
    "algorithm": "ppo", "framework": "verl",
    "models": {"actor": "llama2-7b", "critic": "llama2-7b", "ref": "llama2-7b",
               "reward": "llama2-7b"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "a100-80gb"},
    "workload": {"prompts_per_iteration": 1024, "prompt_length": 1024,
                 "response_length": 1024, "mini_batches_per_epoch": 8}}


@pytest.mark.parametrize("mapping", [GRPO_7B_ON_ONE_GPU_NODES, PPO_FOUR_7B_ON_ONE_GPU_NODES],
                         ids=["grpo-7b", "ppo-4x7b"])
def test_the_smallest_cluster_named_is_the_smallest_that_plan_accepts(mapping) -> None:
    """The number in the refusal comes from the search's own check: `plan` accepts that
    many GPUs and refuses the size below it; the per-GPU need it quotes shrinks (never
    grows) as the cluster grows."""
    job = job_from_mapping(mapping)
    refusal = plan_job(job).infeasible_reason
    smallest = smallest_cluster(job)
    assert smallest is not None and f"The smallest cluster that fits: {smallest} GPUs" in refusal
    sizes = set_sizes(64, job.cluster.gpus_per_node)
    below = sizes[sizes.index(smallest) - 1]

    def on(gpus: int) -> JobSpec:
        return job.with_cluster(job.cluster.with_total_gpus(gpus))

    assert plan_job(on(smallest)).best is not None
    assert plan_job(on(below)).best is None

    def need_gib(gpus: int) -> float:
        return float(explain_infeasible(on(gpus)).split(" GiB per GPU while")[0].split()[-1])

    assert all(need_gib(g) >= need_gib(h) for g, h in itertools.pairwise(sizes)
               if h < smallest)


def test_pinned_roles_are_respected() -> None:
    job = replace(default_job(), parallel={"actor": RolePin(tp=4, generation_tp=2)})
    best = Search(job, SearchOptions(top_k=1)).run().best
    actor = {role: plan for point in best.points for role, plan in point.plans}["actor"]
    assert actor.parallel.tp == 4 and actor.generation.tp == 2


def test_the_framework_not_the_installed_engines_decides_the_layouts() -> None:
    import planner.space as space
    from simulator.plan import megatron_runs, torch_runs

    job = tiny_job("ppo", {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-4l",
                           "reward": "tiny-4l"}, 8)
    # hybridflow (the executor): both backends, whether megatron-core is installed here or
    # not; generation on the training shards, no generation pipeline.
    both = space.role_configs(job, "actor", 8)
    assert {p.training_backend for p in both} == {"torch", "megatron"}
    for plan in both:
        runs = torch_runs if plan.training_backend == "torch" else megatron_runs
        assert runs(plan.parallel) and plan.generation.pp == 1
        assert plan.parallel.tp % plan.generation.tp == 0
    assert any(p.parallel.pp > 1 for p in both)
    torch_only = space.role_configs(job, "actor", 8, SpaceOptions(backend="fsdp"))
    assert torch_only and all(p.training_backend == "torch" for p in torch_only)
    # verl: its FSDP engine has no tensor parallelism; vLLM takes any generation tp.
    verl = replace(job, framework="verl")
    layouts = space.role_configs(verl, "actor", 8)
    fsdp = [p for p in layouts if p.parallel.sharding == "fsdp"]
    assert fsdp and all(p.parallel.tp == 1 for p in fsdp)
    assert any(p.generation.tp > p.parallel.tp for p in layouts)
    assert {p.parallel.recompute for p in fsdp} == {"full", "none"}
    # Studies of the simulator see every layout it prices.
    studied = space.role_configs(job, "actor", 8, SpaceOptions(backend="simulated"))
    assert any(p.generation.pp > 1 for p in studied)
    assert any(p.parallel.sequence_parallel for p in studied)
    # The best plan's Megatron roles share one layout per set (one parallel state per process).
    best = search(job, SearchOptions(space=SpaceOptions(micro_batches=(1,),
                                                        recompute=("selective",)))).best
    assert best is not None
    best.to_plan(job).check_backends()


def test_a_verl_search_keeps_one_engine_and_its_placements() -> None:
    job = tiny_job("ppo", {"actor": "tiny-4l", "critic": "tiny-4l", "ref": "tiny-4l",
                           "reward": "tiny-4l"}, 16, framework="verl")
    result = search(job, SearchOptions(top_k=5, space=SpaceOptions(micro_batches=(1,))))
    assert result.ranking
    for candidate in result.ranking:
        plan = candidate.to_plan(job)
        assert plan.placement in ("actor,critic,ref,reward", "actor,critic,ref|reward")
        shardings = {plan.roles[r].parallel.sharding for r in ("actor", "critic")}
        backends = {plan.roles[r].training_backend for r in ("actor", "critic", "ref")}
        assert len(backends) == 1, plan.describe()
        assert not ("fsdp" in shardings and "optimizer" in shardings)


def test_forward_passes_and_transitions_do_not_read_the_training_micro_batch_or_recompute(
        ) -> None:
    """``evaluate_role`` shares these costs among layouts that differ only in the training
    micro-batch and recompute mode; this is what makes that sharing exact."""
    from simulator.costs.transition import transition
    from simulator.plan import RolePlan
    from simulator.predict import model_node
    from simulator.specs.parallel import GenerationConfig, ParallelConfig

    job = default_job()
    profile = job.cluster.profile()
    gen = GenerationConfig(tp=2)
    layouts = [ParallelConfig(tp=2, dp=4, sharding="optimizer", micro_batch_size=mb,
                              recompute=rc) for mb in (1, 4) for rc in ("none", "full")]
    infer = [model_node(job, job.dataflow.node("ref.infer"), RolePlan(parallel=p),
                        location=0) for p in layouts]
    assert len({(e.seconds, e.transient.total) for e in infer}) == 1
    for scheme in ("micro_dp", "train_group", "all_gpus"):
        assert len({transition(job.model("actor"), profile, p, gen, scheme=scheme).seconds
                    for p in layouts}) == 1


def test_plans_worth_a_second_look_get_a_warning() -> None:
    """A plan is valid but suspicious when an iteration takes hours (a batch with a zero too
    many) or when most of the cluster's GPU time is idle; the default job gets neither."""
    from planner.sanity import plan_warnings

    assert plan_warnings(default_job(), plan_job(default_job()).best) == []
    rule = {"algorithm": "grpo", "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b",
                                            "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
            "workload": {"prompts_per_iteration": 20000, "samples_per_prompt": 8,
                         "prompt_length": 512, "response_length": 1024}}
    long_job = job_from_mapping(rule)
    [long] = plan_warnings(long_job, plan_job(long_job).best)
    assert "an iteration takes" in long and "hours" in long
    assert "workload.prompts_per_iteration (20000)" in long
    small = {**rule, "models": {"actor": "qwen2.5-0.5b", "ref": "qwen2.5-0.5b",
                                "reward": "rule"},
             "cluster": {"nodes": 4, "gpus_per_node": 8, "device": "h100-80gb"},
             "workload": {"prompts_per_iteration": 8, "samples_per_prompt": 4,
                          "prompt_length": 64, "response_length": 64}}
    small_job = job_from_mapping(small)
    [idle] = plan_warnings(small_job, plan_job(small_job).best)
    assert "GPUs are idle" in idle and "of the 32 GPUs hold no model" in idle
    # One GPU: there is no smaller cluster to suggest.
    one = load_job(Path(__file__).resolve().parents[1] / "planner" / "examples"
                   / "tiny-grpo-cpu.yaml")
    [single] = plan_warnings(one, plan_job(one).best)
    assert "the GPU is idle" in single and "smaller cluster" not in single


def test_the_accuracy_banner_shows_the_validation_groups_of_the_jobs_kind(tmp_path) -> None:
    """A dense synchronous job's report quotes the dense, synchronous validation groups, not
    the MoE ones nor the asynchronous one; an MoE job's quotes the MoE groups."""
    from planner.report import write_plan_report
    from simulator.validation import run_validation

    _, groups = run_validation()
    dense_sync = {g.group for g in groups
                  if g.applies_to(mixture_of_experts=False, asynchronous=False)}
    assert "verl_async_modes_h20" not in dense_sync
    assert "megatron_bridge_moe_h100_bf16" not in dense_sync
    assert "korthikanti_2022_table5" in dense_sync
    write_plan_report(plan_job(default_job()), tmp_path / "dense")
    banner = next(line for line in (tmp_path / "dense/report.md").read_text().splitlines()
                  if line.startswith("> "))
    assert "for dense jobs" in banner and "korthikanti_2022_table5" in banner
    assert "verl_async_modes_h20" not in banner and "moe" not in banner
    moe = {g.group for g in groups
           if g.applies_to(mixture_of_experts=True, asynchronous=False)}
    assert moe and all("moe" in name or name == "nemo_rl_v03_refit" for name in moe)
    # A group of dense and MoE cases (the refit times) speaks to jobs of both kinds.
    assert "nemo_rl_v03_refit" in dense_sync


def test_a_refusal_names_the_pin_that_leaves_a_role_no_layout() -> None:
    """A pin the framework (or the --backend asked for) cannot run is named as such, not
    reported as a job that does not fit in any allocation."""
    base = {"algorithm": "grpo", "framework": "verl",
            "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b", "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
            "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 4}}
    fsdp_only = SearchOptions(space=SpaceOptions(backend="fsdp"))
    job = job_from_mapping({**base, "parallel": {"actor": {"pp": 2}}})
    assert plan_job(job).best is not None  # verl's Megatron engine runs pp 2
    reason = plan_job(job, fsdp_only).infeasible_reason
    assert reason == ("no layout in verl's space with --backend fsdp runs actor with "
                      "parallel.actor.pp: 2: remove or change that pin")
    both = job_from_mapping({**base, "parallel": {"actor": {"pp": 2, "ulysses": 2}}})
    reason = plan_job(both).infeasible_reason
    assert reason.startswith("no layout in verl's space runs actor with these pins together: "
                             "parallel.actor.pp: 2, parallel.actor.ulysses: 2")


def test_the_grid_of_running_caps_brackets_every_cap() -> None:
    """The search prices long-tailed batches at a fixed geometric grid of caps (steps of
    1/16, up to the replica's limit) and interpolates between the two grid points around a
    cap: a grid point is always itself (priced exactly whichever cap asked first), and no
    grid point passes the limit (max_num_seqs or the replica's responses)."""
    from planner.frontier import CAP_GRID_FROM, CAP_GRID_STEP, _cap_grid

    for limit in (40, 1000, 1024):
        for cap in range(1, limit + 1):
            lo, hi = _cap_grid(cap, limit)
            assert lo <= cap <= hi <= limit
            assert _cap_grid(lo, limit) == (lo, lo) and _cap_grid(hi, limit) == (hi, hi)
            if cap <= CAP_GRID_FROM or cap == limit:
                assert lo == hi == cap
            else:
                assert hi - lo <= max(2, CAP_GRID_STEP * lo + 2)
    # Caps near one another share their grid points (what makes the grid cheap).
    priced = {point for cap in range(100, 1025) for point in _cap_grid(cap, 1024)}
    assert len(priced) < 45  # of 925 caps



def test_the_report_prices_the_whole_weight_update_not_only_the_transition(tmp_path) -> None:
    """A colocated actor's update before generation is the transition plus the engine's
    wake-up (and states moved to host where the framework offloads them)."""
    from planner.report import write_plan_report

    result = plan_job(default_job())
    write_plan_report(result, tmp_path)
    line = next(x for x in (tmp_path / "report.md").read_text().splitlines()
                if "whole weight update" in x)
    wake = result.best.estimate.nodes["actor.generate"].detail["wake_seconds"]
    total = wake + result.best.estimate.transition.seconds
    assert f"priced at {total:.2f} s" in line and "nemo_rl_v03_refit" in line
