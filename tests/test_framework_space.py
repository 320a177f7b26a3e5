"""The framework's space: what each shipped profile lets the search try, the job-wide
variants, placement rules, batch checks, and the mechanisms of the dimensions it adds
(states kept in host memory between calls)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.search import Search, SearchOptions, allowed_placements, placement_refusal
from planner.space import role_configs
from profiles.datafile import SpecError, from_mapping
from profiles.device import load_profile
from profiles.framework import load_framework
from profiles.framework_space import FrameworkSpace, PlacementRules
from simulator.plan import RolePlan
from simulator.predict import model_node, role_state
from simulator.specs.job import job_from_mapping
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS


def ppo(framework: str, gpus: int = 16, **extra: object):
    return job_from_mapping({
        "algorithm": "ppo", "framework": framework,
        "models": {"actor": "qwen2.5-1.5b", "critic": "qwen2.5-0.5b", "ref": "qwen2.5-1.5b",
                   "reward": "qwen2.5-0.5b"},
        "cluster": {"nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus),
                    "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 256, "prompt_length": 256,
                     "response_length": 512, "mini_batches_per_epoch": 4},
        **extra})


def test_placement_patterns_project_onto_the_jobs_roles() -> None:
    rules = PlacementRules(sync=("actor,critic,ref|reward",))
    assert rules.allows((("actor", "ref"),), ("actor", "ref"), trainer=False)
    assert rules.allows((("actor", "critic", "ref"), ("reward",)),
                        ("actor", "critic", "ref", "reward"), trainer=False)
    assert not rules.allows((("actor",), ("critic", "ref", "reward")),
                            ("actor", "critic", "ref", "reward"), trainer=False)
    with pytest.raises(SpecError, match="unknown role 'policy'"):
        PlacementRules(sync=("policy,ref",))


def test_each_framework_places_what_its_configuration_sets_up() -> None:
    verl, openrlhf, ours = ppo("verl"), ppo("openrlhf"), ppo("hybridflow")
    assert {"|".join(",".join(g) for g in p) for p in allowed_placements(verl)} == {
        "actor,critic,ref,reward", "actor,critic,ref|reward"}
    assert len(allowed_placements(openrlhf)) == 1
    assert len(allowed_placements(ours)) == 15
    # A study places anything; the refusal names the framework and what it can place.
    reason = placement_refusal(verl, (("actor", "ref"), ("critic", "reward")))
    assert reason and "verl" in reason and "--backend simulated" in reason
    assert placement_refusal(verl, (("actor", "ref"), ("critic", "reward")), study=True) is None


def test_job_wide_settings_hold_across_every_role_of_a_plan() -> None:
    # OpenRLHF: one tp, one ZeRO stage, one gradient-checkpointing flag for every model.
    job = ppo("openrlhf", 16)
    found = Search(job, SearchOptions(top_k=5)).run()
    assert found.ranking
    for candidate in found.ranking:
        plan = candidate.to_plan(job)
        assert len({rp.parallel.tp for rp in plan.roles.values()}) == 1
        trained = [plan.roles[r].parallel for r in ("actor", "critic")]
        assert len({p.sharding for p in trained if p.dp > 1}) <= 1
        assert len({p.recompute for p in trained}) == 1
        frozen = {plan.roles[r].parallel.sharding for r in ("ref", "reward")}
        assert frozen == ({"fsdp"} if trained[0].sharding == "fsdp" else {"none"})


def test_verl_batch_checks_keep_layouts_verl_would_refuse_out() -> None:
    # 256 prompts in 4 mini-batches: 64 sequences per mini-batch cannot split over 128 ranks.
    job = ppo("verl", 128)
    layouts = role_configs(job, "actor", 128)
    assert layouts and all(64 % rp.parallel.dp == 0 for rp in layouts)


def test_a_profile_without_a_space_constrains_nothing() -> None:
    assert not FrameworkSpace().constrained
    space = from_mapping(FrameworkSpace, {"engines": {"fsdp": {"family": "torch"}}})
    assert space.engines_for("actor")[0][0] == "fsdp"
    with pytest.raises(SpecError, match="unknown batch rule"):
        from_mapping(FrameworkSpace, {"batch_rules": ["nope"]})
    with pytest.raises(SpecError, match="not FSDP-style"):
        from_mapping(FrameworkSpace, {"engines": {"m": {"family": "megatron",
                                                        "trained_sharding": ["fsdp"]}}})


def test_states_kept_in_host_memory_between_calls_cost_two_copies_per_call() -> None:
    job = ppo("verl", 8)
    par = ParallelConfig(tp=1, dp=8, sharding="fsdp", recompute="full")
    kept = replace(par, offload_params=True)
    resident, _ = role_state(job, "ref", par)
    offloaded, _ = role_state(job, "ref", kept)
    assert offloaded.params == 0 and resident.params > 0
    node = job.dataflow.node("ref.infer")
    on_gpu = model_node(job, node, RolePlan(parallel=par), location=0)
    on_host = model_node(job, node, RolePlan(parallel=kept), location=0)
    link = load_profile("h100-80gb").host_link
    # In before the pass, out after it, at the pinned rate (verl's .to(non_blocking=True)).
    assert on_host.seconds - on_gpu.seconds == pytest.approx(
        2 * resident.params / link.pinned_bytes_per_s)
    assert on_host.transient.params == pytest.approx(resident.params)
    # A trained model's update brings its optimizer states too.
    train = job.dataflow.node("actor.train")
    both = replace(par, offload_params=True, offload_optimizer=True)
    state, _ = role_state(job, "actor", par)
    gpu = model_node(job, train, RolePlan(parallel=par), location=0)
    host = model_node(job, train, RolePlan(parallel=both), location=0)
    assert host.seconds - gpu.seconds == pytest.approx(
        2 * (state.params + state.optimizer) / link.pinned_bytes_per_s)


def test_verl_searches_offload_and_exports_it() -> None:
    from planner.export.verl import verl_overrides

    job = ppo("verl", 8)
    kinds = {(rp.parallel.offload_params, rp.parallel.offload_optimizer)
             for rp in role_configs(job, "ref", 8)}
    assert kinds == {(False, False), (True, False)}
    assert (True, True) in {(rp.parallel.offload_params, rp.parallel.offload_optimizer)
                            for rp in role_configs(job, "actor", 8)}
    assert all(not rp.parallel.offload_params
               for rp in role_configs(replace(job, framework="hybridflow"), "ref", 8))
    plan = Search(job, SearchOptions(top_k=1)).run().best.to_plan(job)
    ref = plan.roles["ref"]
    roles = dict(plan.roles, ref=replace(ref, parallel=replace(ref.parallel,
                                                               offload_params=True)))
    _, _, lines = verl_overrides(replace(plan, roles=roles), job)
    engine = "fsdp_config" if plan.roles["actor"].parallel.sharding == "fsdp" else "megatron"
    assert f"actor_rollout_ref.ref.{engine}.param_offload=true" in lines


def test_the_space_does_not_depend_on_what_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    job = ppo("verl", 16)
    before = role_configs(job, "actor", 16)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else real(name, *a))
    assert role_configs(job, "actor", 16) == before
    assert any(rp.training_backend == "megatron" for rp in before)
    assert load_framework("verl").space.shared_engine == ("actor", "critic", "ref")


def test_a_token_budget_splits_each_ranks_tokens_into_balanced_micro_batches() -> None:
    from simulator.packing import token_budget_batch

    # 64 sequences of 1,500 tokens on average over 8 ranks: 12,000 tokens per rank, a budget
    # of 5,000 -> 3 micro-batches of 8/3 sequences (verl: ceil(tokens / budget)).
    batch = token_budget_batch(64, 1500.0, 4000, budget_tokens=5000, data_parallel=8)
    assert batch.micro_batches == 3
    assert batch.sequences_per_micro_batch == pytest.approx(8 / 3)
    assert batch.largest_bin_tokens == 4000
    # Never more micro-batches than sequences.
    assert token_budget_batch(8, 1500.0, 2000, budget_tokens=2000,
                              data_parallel=8).micro_batches == 1


def test_verl_searches_token_budgets_for_varying_lengths_only() -> None:
    job = ppo("verl", 8)
    assert all(rp.parallel.micro_batch_tokens == 0 for rp in role_configs(job, "actor", 8))
    varying = job_from_mapping({**job.to_value(), "workload": {
        **job.to_value()["workload"],
        "response_length": {"distribution": "lognormal", "median": 200, "sigma": 0.8,
                            "max": 1024}}})
    budgets = {rp.parallel.micro_batch_tokens for rp in role_configs(varying, "actor", 8)}
    longest = varying.workload.max_sequence_tokens
    assert {0, longest, 2 * longest, 4 * longest} == budgets
    # Fewer, fuller micro-batches than one sequence each: a budget of four longest
    # sequences trains faster than micro-batches of one sequence.
    node = varying.dataflow.node("actor.train")
    par = ParallelConfig(tp=1, dp=8, sharding="fsdp", recompute="full")
    one = model_node(varying, node, RolePlan(parallel=par), location=0)
    budget = model_node(varying, node, RolePlan(parallel=replace(
        par, micro_batch_tokens=4 * longest, infer_micro_batch_tokens=8 * longest)),
        location=0)
    assert budget.seconds < one.seconds


def test_ulysses_splits_each_sequence_and_pays_four_all_to_alls_per_layer() -> None:
    """sp ranks share each sequence: per rank, a micro-batch's compute and activations are
    1 / sp of it, sp times as many micro-batches run, and each layer adds the q/k/v and output
    all-to-alls forward and backward (and forward again under full recompute)."""
    from simulator.costs.training import train_step
    from simulator.costs.ulysses import ulysses_forward_seconds

    model = MODEL_PRESETS["qwen2.5-7b"]
    h100 = load_profile("h100-80gb")
    plain = ParallelConfig(tp=1, dp=8, sharding="fsdp", recompute="full", micro_batch_size=1)
    split = replace(plain, ulysses=4)
    assert split.data_shards == 2 and split.short().endswith("-sp4")
    one = train_step(model, h100, plain, global_batch=16, seq_len=32768)
    four = train_step(model, h100, split, global_batch=16, seq_len=32768)
    assert four.micro_batches == 4 * one.micro_batches
    assert four.memory.activations == pytest.approx(one.memory.activations / 4, rel=0.05)
    exchange = ulysses_forward_seconds(model, h100, tokens=32768 / 4, tp=1, sp=4, dtype="bf16",
                                       gpus_per_node=8, busy_ranks_per_node=8)
    assert exchange > 0
    with pytest.raises(SpecError, match="must divide dp"):
        ParallelConfig(tp=1, dp=6, sharding="fsdp", ulysses=4)
    with pytest.raises(SpecError, match="whole heads"):
        ParallelConfig(tp=1, dp=8, ulysses=8).check_model(model, gpus_per_node=8)  # 28 heads


def test_verl_offers_ulysses_for_long_sequences_and_round_trips_it(tmp_path) -> None:
    from planner.export import export_files
    from planner.export.importing import ImportContext
    from planner.export.launch import read_launch
    from planner.export.verl_import import import_verl

    short = ppo("verl", 8)
    assert {rp.parallel.ulysses for rp in role_configs(short, "actor", 8)} == {1}
    long = job_from_mapping({
        "algorithm": "grpo", "framework": "verl", "kl": "none",
        "models": {"actor": "qwen2.5-7b", "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 8,
                     "prompt_length": 2048, "response_length": 20480,
                     "mini_batches_per_epoch": 4},
        "parallel": {"actor": {"ulysses": 4}}})
    assert {1, 2, 4} <= {rp.parallel.ulysses
                         for rp in role_configs(replace(long, parallel={}), "actor", 8)}
    plan = Search(long, SearchOptions(top_k=1)).run().best.to_plan(long)
    assert plan.roles["actor"].parallel.ulysses == 4
    files = export_files(plan, long, "verl")
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4" in \
        files["verl_overrides.txt"].splitlines()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    _, back = import_verl(read_launch(tmp_path / "run_verl.sh", ("verl.trainer.main_ppo",)),
                          ImportContext(job=long))
    assert back.roles == plan.roles


def test_a_token_budget_counts_the_ranks_that_share_a_micro_batch() -> None:
    from simulator.predict import shard_budget_tokens

    verl, openrlhf = (load_framework(f).training for f in ("verl", "openrlhf"))
    tp2 = ParallelConfig(tp=2, dp=4, sharding="optimizer")
    # verl: per GPU of a sequence's split (Ulysses / context parallel); OpenRLHF: per GPU of
    # the model-parallel group, AutoTP ranks included.
    assert shard_budget_tokens(1000, tp2, verl) == 1000
    assert shard_budget_tokens(1000, tp2, openrlhf) == 2000
    sp2 = ParallelConfig(tp=1, dp=8, sharding="fsdp", ulysses=2)
    assert shard_budget_tokens(1000, sp2, verl) == 2000


def test_openrlhf_forms_every_models_micro_batches_one_way() -> None:
    from planner.export.openrlhf import openrlhf_args
    from planner.space import SpaceOptions, batching_variants

    job = ppo("openrlhf", 16, workload={
        "prompts_per_iteration": 256, "prompt_length": 256, "mini_batches_per_epoch": 4,
        "response_length": {"distribution": "lognormal", "median": 300, "sigma": 0.8,
                            "max": 2048}})
    options = SpaceOptions(micro_batches=(1, 2))
    # Two trained models: one (micro_batch_size, budget) for both, by count or by budget.
    assert set(batching_variants(job, options)) == {
        ((1, 0), False), ((2, 0), False), ((1, 2304), True), ((1, 4608), True)}
    found = Search(job, SearchOptions(top_k=10, space=options)).run()
    for candidate in found.ranking:
        plan = candidate.to_plan(job)
        trained = {(plan.roles[r].parallel.micro_batch_size,
                    plan.roles[r].parallel.micro_batch_tokens) for r in ("actor", "critic")}
        assert len(trained) == 1
        forward = {rp.parallel.infer_micro_batch_tokens for rp in plan.roles.values()}
        assert len(forward) == 1 and (forward.pop() > 0) == (trained.pop()[1] > 0)
    # A hand-edited plan with two micro-batches is refused at the critic's key.
    plan = found.ranking[0].to_plan(job)
    critic = plan.roles["critic"]
    edited = replace(critic.parallel, micro_batch_size=critic.parallel.micro_batch_size + 1,
                     micro_batch_tokens=0)
    plan.roles["critic"] = replace(critic, parallel=edited)
    with pytest.raises(SpecError, match=r"one --train\.micro_batch_size") as info:
        openrlhf_args(plan, job)
    assert info.value.key == "roles.critic.parallel.micro_batch_size"
    # verl keeps choosing per model (no one_batching).
    assert batching_variants(ppo("verl", 16), options) == ()


def test_sglang_generates_without_pipelines() -> None:
    # verl passes SGLang no pipeline size: the search offers generation pp 1 only, where with
    # vLLM it pipelines once tensor parallelism fills a node.
    job = replace(ppo("verl", 16), models={
        "actor": MODEL_PRESETS["llama3-70b"], "critic": MODEL_PRESETS["qwen2.5-0.5b"],
        "ref": MODEL_PRESETS["llama3-70b"], "reward": MODEL_PRESETS["qwen2.5-0.5b"]})
    vllm = {rp.generation.pp for rp in role_configs(job, "actor", 16)}
    sglang = {rp.generation.pp for rp in role_configs(replace(job, rollout_engine="sglang"),
                                                      "actor", 16)}
    assert vllm == {1, 2} and sglang == {1}
