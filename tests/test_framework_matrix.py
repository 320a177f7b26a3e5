"""Every plan the planner returns for a framework is one that framework runs, priced as it runs
it: frameworks (verl, OpenRLHF, NeMo-RL) x algorithms (PPO, GRPO with and without a KL term,
ReMax, where the framework has a trainer) x
cluster sizes (8, 16, 64, 256 GPUs) x modes (sync, one_step_off, async). For each, one plan is
searched in the framework's space; it exports with no error; the framework's own code accepts
the export (verl's Hydra tree and validate_config, OpenRLHF's parser and argument checks, see
``test_export_frameworks.py``); and importing the export gives back the same plan at the same
predicted time. All compositions run in this one process, one plan per job."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from planner.asynchronous import search_async
from planner.export import export_files, plan_layout
from planner.export.import_command import MODULES
from planner.export.importing import ImportContext
from planner.export.launch import read_launch
from planner.export.nemo_rl_import import import_nemo_rl
from planner.export.openrlhf_import import import_openrlhf
from planner.export.verl import parse_verl_files
from planner.export.verl_import import import_verl
from planner.planning import evaluate
from planner.search import Search, SearchOptions
from planner.space import SpaceOptions
from simulator.plan import Plan
from simulator.specs.job import JobSpec, job_from_mapping

SUMS = Path(__file__).resolve().parents[1] / "planner" / "examples" / "your-data" / "sums.py"

ALGORITHMS = {
    # name: (algorithm, kl, models, samples per prompt)
    "ppo": ("ppo", None, {"actor": "qwen2.5-1.5b", "critic": "qwen2.5-0.5b",
                          "ref": "qwen2.5-1.5b", "reward": "qwen2.5-0.5b"}, 1),
    "grpo": ("grpo", None, {"actor": "qwen2.5-1.5b", "ref": "qwen2.5-1.5b",
                            "reward": "rule"}, 8),
    "grpo-no-kl": ("grpo", "none", {"actor": "qwen2.5-1.5b", "reward": "rule"}, 8),
    "remax": ("remax", None, {"actor": "qwen2.5-1.5b", "ref": "qwen2.5-1.5b",
                              "reward": "qwen2.5-0.5b"}, 1),
}
FRAMEWORK_ALGORITHMS = {"verl": ("ppo", "grpo", "grpo-no-kl", "remax"),
                        "openrlhf": ("ppo", "grpo", "grpo-no-kl"),
                        "nemo-rl": ("grpo", "grpo-no-kl")}
SIZES = (8, 16, 64, 256)
MODES = ("sync", "one_step_off", "async")
CASES = [pytest.param(f, a, g, m, id=f"{f}-{a}-{g}gpu-{m}")
         for f, algorithms in FRAMEWORK_ALGORITHMS.items() for a in algorithms
         for g in SIZES for m in MODES]


def matrix_job(framework: str, name: str, gpus: int, mode: str,
               parallel: dict | None = None) -> JobSpec:
    algorithm, kl, models, samples = ALGORITHMS[name]
    data: dict = {
        "name": f"matrix-{framework}-{name}", "algorithm": algorithm, "framework": framework,
        "models": dict(models),
        "cluster": {"nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus),
                    "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 1024, "samples_per_prompt": samples,
                     "prompt_length": 512, "mini_batches_per_epoch": 4,
                     "response_length": {"distribution": "lognormal", "median": 300,
                                         "sigma": 0.8, "max": 2048}},
        "mode": mode}
    if kl is not None:
        data["kl"] = kl
    if mode == "async":
        data.update(max_staleness=2, partial_rollout=True)
    if models.get("reward") == "rule":
        data["reward_function"] = {"path": str(SUMS)}
    if parallel:
        data["parallel"] = parallel
    return job_from_mapping(data)


@cache
def planned(framework: str, name: str, gpus: int, mode: str) -> tuple[JobSpec, Plan]:
    """One plan of the job, searched in its framework's space (micro-batches of 1 or 2)."""
    job = matrix_job(framework, name, gpus, mode)
    options = SearchOptions(top_k=1, space=SpaceOptions(micro_batches=(1, 2)))
    if mode == "sync":
        best = Search(job, options).run().best
        assert best is not None, "no synchronous plan"
        plan = best.to_plan(job)
    else:
        found = search_async(job, mode, job.max_staleness or 1, options, top_k=1)  # type: ignore[arg-type]
        assert found, f"no {mode} plan"
        plan = found[0].plan
    return job, evaluate(job, None, "searched", plan=plan).plan


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face model directory, what verl's model config reads (nothing is
    downloaded)."""
    from tests.dataset_fixtures import make_tokenizer

    directory = make_tokenizer(tmp_path_factory.mktemp("matrix-model"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 4, "vocab_size": 38, "max_position_embeddings": 4096}))
    return directory


def framework_accepts(framework: str, files: dict[str, str], model: Path) -> None:
    """The framework's own code composes / parses the exported launch and passes its own
    checks (NeMo-RL, which needs Python 3.13 and Ray to check a config: the arithmetic it
    asserts at start-up)."""
    if framework == "nemo-rl":
        from planner.export.nemo_rl import nemo_rl_checks, parse_nemo_rl_overrides

        assert nemo_rl_checks(parse_nemo_rl_overrides(files["nemo_rl_overrides.txt"])) == []
    elif framework == "verl":
        from tests.test_export_frameworks import model_overrides, verl_config, verl_validate

        cfg = verl_config(files["verl_overrides.txt"], files["run_verl.sh"],
                          model_overrides(files, model))
        verl_validate(cfg)
    else:
        from tests.test_export_frameworks import openrlhf_parse

        openrlhf_parse([a for a in files["openrlhf_args.txt"].splitlines() if a])


def reimported(framework: str, job: JobSpec, files: dict[str, str], directory: Path
               ) -> tuple[JobSpec, Plan]:
    """The export read back by ``hybridflow import`` (the job gives what a launch does not
    say: the cluster, the models, the response-length distribution)."""
    for name, text in files.items():
        (directory / name).write_text(text)
    script = {"verl": "run_verl.sh", "openrlhf": "run_openrlhf.sh",
              "nemo-rl": "run_nemo_rl.sh"}[framework]
    launch = read_launch(directory / script, MODULES[framework])
    context = ImportContext(job=job)
    importer = {"verl": import_verl, "openrlhf": import_openrlhf,
                "nemo-rl": import_nemo_rl}[framework]
    return importer(launch, context)


def assert_round_trip(framework: str, job: JobSpec, plan: Plan, files: dict[str, str],
                      directory: Path) -> None:
    """Importing ``plan``'s export gives back the same role layouts at the same price."""
    back_job, back = reimported(framework, job, files, directory)
    assert back.roles == plan.roles
    again = evaluate(back_job, None, "searched", plan=back)
    assert again.iteration_seconds == pytest.approx(plan.predicted["iteration_seconds"],
                                                    rel=1e-9)


@pytest.mark.parametrize(("framework", "name", "gpus", "mode"), CASES)
def test_every_plan_exports_passes_the_framework_and_round_trips(
        framework: str, name: str, gpus: int, mode: str, tiny_model: Path,
        tmp_path: Path) -> None:
    job, plan = planned(framework, name, gpus, mode)
    assert plan.mode == mode
    files = export_files(plan, job, framework)
    if framework == "verl":
        module, _config, _values = parse_verl_files(files["verl_overrides.txt"],
                                                    files["run_verl.sh"])
        assert module.endswith({"sync": "main_ppo", "one_step_off": "main_ppo",
                                "async": "fully_async_main"}[mode])
    framework_accepts(framework, files, tiny_model)
    back_job, back = reimported(framework, job, files, tmp_path)
    assert plan_layout(back) == plan_layout(plan)
    assert back.roles == plan.roles, (back.describe(), plan.describe())
    assert [replace(s) for s in back.sets] == list(plan.sets)
    again = evaluate(back_job, None, "searched", plan=back)
    assert again.iteration_seconds == pytest.approx(plan.predicted["iteration_seconds"],
                                                    rel=1e-9)


def test_the_default_jobs_plan_exports_to_verl_and_to_openrlhf(tiny_model: Path) -> None:
    from planner.planning import plan_job
    from simulator.specs.job import default_job

    job = default_job()
    plan = plan_job(job, SearchOptions(top_k=1)).best.plan
    for framework in ("verl", "openrlhf"):
        files = export_files(plan, job, framework)
        framework_accepts(framework, files, tiny_model)


def test_a_hybrid_sharded_plan_exports_passes_verl_and_round_trips(tiny_model: Path,
                                                                    tmp_path: Path) -> None:
    # verl's FSDP engine in groups of one node (fsdp_size 8) on 64 GPUs: the export writes the
    # group, verl composes it, and the import reads it back at the same price.
    job = matrix_job("verl", "grpo", 64, "sync",
                     parallel={"actor": {"fsdp_size": 8}, "ref": {"fsdp_size": 16}})
    plan, files = verl_round_trip(job, "fsdp", tiny_model, tmp_path)
    assert (plan.roles["actor"].parallel.fsdp_size, plan.roles["ref"].parallel.fsdp_size) \
        == (8, 16)
    assert "actor_rollout_ref.actor.fsdp_config.fsdp_size=8" in files["verl_overrides.txt"]


def verl_round_trip(job: JobSpec, backend: str, model: Path,
                    directory: Path) -> tuple[Plan, dict[str, str]]:
    """The job's best plan on one engine family: exported to verl, accepted by verl's own
    config code, and imported back as the same plan at the same predicted time."""
    options = SearchOptions(top_k=1, space=SpaceOptions(micro_batches=(1,), backend=backend))
    best = Search(job, options).run().best
    assert best is not None
    plan = evaluate(job, None, "searched", plan=best.to_plan(job)).plan
    files = export_files(plan, job, "verl")
    framework_accepts("verl", files, model)
    assert_round_trip("verl", job, plan, files, directory)
    return plan, files


def test_a_context_parallel_plan_exports_passes_verl_and_round_trips(tiny_model: Path,
                                                                      tmp_path: Path) -> None:
    # Long sequences on verl's Megatron engine with context parallelism pinned: the export
    # writes context_parallel_size, verl composes it, and the import reads it back at the same
    # price.
    job = long_grpo("verl", parallel={"actor": {"cp": 2}})
    plan, files = verl_round_trip(job, "megatron", tiny_model, tmp_path)
    assert plan.roles["actor"].parallel.cp == 2
    assert "actor_rollout_ref.actor.megatron.context_parallel_size=2" \
        in files["verl_overrides.txt"]


def test_an_sglang_plan_exports_passes_verl_and_round_trips(tiny_model: Path,
                                                             tmp_path: Path) -> None:
    # The job's rollout engine is SGLang: the export names it, verl's own config code takes
    # it, and the import reads it back (the engine included) at the same price.
    job = replace(matrix_job("verl", "grpo", 16, "sync"), rollout_engine="sglang")
    plan, files = verl_round_trip(job, "fsdp", tiny_model, tmp_path)
    assert "actor_rollout_ref.rollout.name=sglang" in files["verl_overrides.txt"]
    assert plan.roles["actor"].generation.pp == 1


def long_grpo(framework: str, **extra: object) -> JobSpec:
    """GRPO on 16 H100s with responses up to 16k tokens (where context parallelism is
    searched)."""
    return job_from_mapping({
        "name": f"matrix-{framework}-long", "algorithm": "grpo", "framework": framework,
        "models": {"actor": "qwen2.5-1.5b", "ref": "qwen2.5-1.5b", "reward": "rule"},
        "reward_function": {"path": str(SUMS)},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 64, "samples_per_prompt": 8,
                     "prompt_length": 2048, "mini_batches_per_epoch": 4,
                     "response_length": {"distribution": "lognormal", "median": 8000,
                                         "sigma": 0.6, "max": 16384}}, **extra})


def test_a_context_parallel_plan_exports_passes_nemo_rl_and_round_trips(tmp_path: Path) -> None:
    # NeMo-RL's Megatron policy with context parallelism pinned on the actor: the reference,
    # which runs in the policy's model, takes the same cp; the export pads sequences to
    # 2 x cp (x tp) as NeMo-RL asserts, and the import reads it back at the same price.
    from planner.export.nemo_rl import nemo_rl_checks, parse_nemo_rl_overrides

    job = long_grpo("nemo-rl", parallel={"actor": {"cp": 2}})
    options = SearchOptions(top_k=1, space=SpaceOptions(micro_batches=(1,), backend="megatron"))
    best = Search(job, options).run().best
    assert best is not None
    plan = evaluate(job, None, "searched", plan=best.to_plan(job)).plan
    actor, ref = plan.roles["actor"].parallel, plan.roles["ref"].parallel
    assert (actor.cp, ref.cp) == (2, 2)
    files = export_files(plan, job, "nemo-rl")
    values = parse_nemo_rl_overrides(files["nemo_rl_overrides.txt"])
    assert values["policy.megatron_cfg.context_parallel_size"] == "2"
    assert int(values["policy.make_sequence_length_divisible_by"]) % (4 * actor.tp) == 0
    assert nemo_rl_checks(values) == []
    values["policy.make_sequence_length_divisible_by"] = str(actor.tp)
    assert any("not a multiple" in p for p in nemo_rl_checks(values))
    assert_round_trip("nemo-rl", job, plan, files, tmp_path)


def test_an_openrlhf_plan_with_token_budgets_exports_parses_and_round_trips(
        tiny_model: Path, tmp_path: Path) -> None:
    # PPO's actor and critic share one --train.micro_batch_size / --train.max_tokens_per_gpu,
    # and every experience pass one --rollout.max_tokens_per_gpu: the search keeps them
    # equal, the export writes them once, OpenRLHF's parser takes them, the import reads them.
    job = matrix_job("openrlhf", "ppo", 16, "sync")
    options = SearchOptions(top_k=20, space=SpaceOptions(micro_batches=(1, 2)))
    found = Search(job, options).run().ranking
    budgeted = [c.to_plan(job) for c in found
                if c.to_plan(job).roles["actor"].parallel.micro_batch_tokens]
    assert budgeted, "no plan with token budgets among the top 20"
    plan = evaluate(job, None, "searched", plan=budgeted[0]).plan
    actor, critic = (plan.roles[r].parallel for r in ("actor", "critic"))
    assert (actor.micro_batch_size, actor.micro_batch_tokens) == \
        (critic.micro_batch_size, critic.micro_batch_tokens)
    assert len({rp.parallel.infer_micro_batch_tokens for rp in plan.roles.values()}) == 1
    files = export_files(plan, job, "openrlhf")
    from tests.test_export_frameworks import openrlhf_parse

    args = openrlhf_parse([a for a in files["openrlhf_args.txt"].splitlines() if a])
    assert args.train.dynamic_batch_enable
    assert args.train.max_tokens_per_gpu == actor.micro_batch_tokens
    assert args.rollout.max_tokens_per_gpu == actor.infer_micro_batch_tokens
    assert_round_trip("openrlhf", job, plan, files, tmp_path)


def test_an_openrlhf_plan_with_ring_attention_exports_parses_and_round_trips(
        tmp_path: Path) -> None:
    # 16k-token sequences: the search tries one --ds.ring_attn_size for every model; the
    # export writes it with its head stride, OpenRLHF's parser and checks take it, and the
    # import reads it back at the same price.
    job = long_grpo("openrlhf", parallel={"actor": {"cp": 2}})
    best = Search(job, SearchOptions(top_k=1, space=SpaceOptions(micro_batches=(1,)))).run().best
    assert best is not None
    plan = evaluate(job, None, "searched", plan=best.to_plan(job)).plan
    assert {rp.parallel.cp for rp in plan.roles.values()} == {2}
    files = export_files(plan, job, "openrlhf")
    from tests.test_export_frameworks import openrlhf_parse

    args = openrlhf_parse([a for a in files["openrlhf_args.txt"].splitlines() if a])
    assert (args.ds.ring_attn_size, args.ds.ring_attn_head_stride) == (2, 1)
    assert args.ds.packing_samples
    assert_round_trip("openrlhf", job, plan, files, tmp_path)
