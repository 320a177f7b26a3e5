"""Export to verl and OpenRLHF (issue 15), without the frameworks installed: the files'
contents, the refusals, the CLI, and the round trip through our own reader of the exported
files (same placement, same parallel sizes). ``test_export_frameworks.py`` has verl's and
OpenRLHF's own code judge the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from planner.export import Layout, export_files, plan_layout
from planner.export.openrlhf import openrlhf_files, openrlhf_layout, parse_openrlhf_args
from planner.export.verl import parse_verl_files, verl_files, verl_layout
from planner.planning import plan_job
from planner.search import SearchOptions
from planner.space import SpaceOptions
from profiles.datafile import SpecError
from simulator.plan import ColocatedSet, Plan
from simulator.specs.job import JobSpec, job_from_mapping

SUMS = Path(__file__).resolve().parents[1] / "planner" / "examples" / "your-data" / "sums.py"
WORKLOAD = {"prompts_per_iteration": 64, "prompt_length": 64, "mini_batches_per_epoch": 4,
            "response_length": 128, "train_micro_batch_size": 2}


def job(algorithm: str = "ppo", gpus: int = 16, **extra: object) -> JobSpec:
    roles = {"ppo": ("actor", "critic", "ref", "reward"), "grpo": ("actor", "ref", "reward"),
             "remax": ("actor", "ref", "reward"),
             "safe-rlhf": ("actor", "critic", "ref", "reward", "cost")}[algorithm]
    data: dict = {"algorithm": algorithm, "models": {r: "tiny-4l" for r in roles},
                  "cluster": {"nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus)},
                  "workload": dict(WORKLOAD)}
    for key, value in extra.items():
        if key == "workload":
            data["workload"].update(value)
        else:
            data[key] = value
    return job_from_mapping(data)


@cache
def planned(name: str):
    """Planning results of the jobs the tests export (each searched once per session)."""
    if name == "ppo":  # planned in verl's space: it exports to verl as priced
        return plan_job(job("ppo"))
    if name == "ppo-anywhere":  # the executor's space: every standard placement
        return plan_job(job("ppo", framework="hybridflow"))
    if name == "ppo-fsdp":  # planned in OpenRLHF's space (one ZeRO stage, one tp)
        return plan_job(job("ppo", framework="openrlhf"))
    if name == "ppo-fsdp-anywhere":  # layouts OpenRLHF's one ZeRO stage runs, any placement
        pins = {r: {"tp": 1, "sharding": "fsdp"} for r in ("actor", "critic", "ref", "reward")}
        return plan_job(job("ppo", parallel=pins, framework="hybridflow"))
    if name == "ppo-verl-pools":  # searched within the placements verl can configure
        return plan_job(job("ppo"), SearchOptions(placements=(
            (("actor", "critic", "ref", "reward"),), (("actor", "critic", "ref"), ("reward",)))))
    if name == "ppo-one-step-off":
        return plan_job(job("ppo", mode="one_step_off"), SearchOptions(
            placements=((("actor", "critic", "ref"), ("reward",)),)))
    if name == "grpo-async":
        return plan_job(job("grpo", mode="async", max_staleness=2, partial_rollout=True,
                            models={"actor": "tiny-4l", "ref": "tiny-4l", "reward": "rule"},
                            reward_function={"path": str(SUMS)},
                            workload={"samples_per_prompt": 4}))
    if name == "grpo-async-fsdp":  # planned in OpenRLHF's space
        return plan_job(job("grpo", mode="async", max_staleness=2, partial_rollout=True,
                            models={"actor": "tiny-4l", "ref": "tiny-4l", "reward": "rule"},
                            reward_function={"path": str(SUMS)},
                            workload={"samples_per_prompt": 4}, framework="openrlhf"))
    if name == "grpo-moe":  # an MoE actor with expert parallelism in training and serving
        return plan_job(job("grpo", models={"actor": "tiny-moe-2l", "ref": "tiny-moe-2l",
                                            "reward": "rule"},
                            reward_function={"path": str(SUMS)},
                            workload={"samples_per_prompt": 4},
                            parallel={"actor": {"ep": 2, "generation_ep": 4},
                                      "ref": {"ep": 4}}),
                        SearchOptions(space=SpaceOptions(backend="megatron")))
    if name == "grpo-uneven-pp":  # 6 layers on 4 pipeline stages (1, 2, 2, 1)
        six = {"layers": 6, "hidden": 128, "ffn_hidden": 256, "heads": 8, "kv_heads": 4,
               "vocab": 64, "mlp": "swiglu", "tied_embeddings": True}
        return plan_job(job("grpo", models={"actor": six, "ref": six, "reward": "rule"},
                            reward_function={"path": str(SUMS)},
                            workload={"samples_per_prompt": 4},
                            parallel={"actor": {"pp": 4, "tp": 1, "sharding": "optimizer"},
                                      "ref": {"pp": 4, "tp": 1}}),
                        SearchOptions(space=SpaceOptions(backend="simulated")))
    raise KeyError(name)


def strategy(name: str, which: str) -> Plan:
    result = planned(name)
    if which == "searched":
        assert result.best is not None
        return result.best.plan
    outcome = next(s for s in result.strategies if s.name == which)
    assert outcome.result is not None, outcome.reason
    return outcome.result.plan


def job_of(plan: Plan) -> JobSpec:
    assert plan.job is not None
    return job_from_mapping(plan.job)


def verl_round_trip(plan: Plan) -> Layout:
    files = verl_files(plan, job_of(plan))
    return verl_layout(files["verl_overrides.txt"], files["run_verl.sh"],
                       job_of(plan).gpu_roles)


def openrlhf_round_trip(plan: Plan) -> Layout:
    files = openrlhf_files(plan, job_of(plan))
    return openrlhf_layout(files["openrlhf_args.txt"], job_of(plan).gpu_roles)


def with_sets(plan: Plan, groups: list[tuple[tuple[str, ...], int]]) -> Plan:
    """``plan`` with other sets (each role keeps its layout: sizes must still add up)."""
    sets, first = [], 0
    for roles, gpus in groups:
        sets.append(ColocatedSet(roles=roles, gpus=gpus, first_gpu=first))
        first += gpus
    return replace(plan, sets=tuple(sets))


# ----- verl -----


def test_verl_colocate_round_trips_and_carries_the_batch() -> None:
    plan = strategy("ppo", "colocate")
    assert verl_round_trip(plan) == plan_layout(plan)
    files = verl_files(plan, job_of(plan))
    lines = files["verl_overrides.txt"].splitlines()
    # The colocate strategy may leave GPUs idle (which layouts exist depends on whether
    # megatron-core is installed); the export carries the GPUs the plan uses.
    assert f"trainer.nnodes={max(1, plan.total_gpus // 8)}" in lines
    assert f"trainer.n_gpus_per_node={min(8, plan.total_gpus)}" in lines
    assert "data.train_batch_size=64" in lines
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16" in lines
    assert "algorithm.adv_estimator=gae" in lines
    gen = plan.roles["actor"].generation
    assert f"actor_rollout_ref.rollout.tensor_model_parallel_size={gen.tp}" in lines
    assert f"actor_rollout_ref.rollout.gpu_memory_utilization={gen.memory_utilization:g}" in lines
    assert all(line.count("=") >= 1 and " " not in line for line in lines)
    assert "--config-name ppo" in files["run_verl.sh"]
    assert '"${overrides[@]}" "$@"' in files["run_verl.sh"]


def test_verl_searched_plan_round_trips_or_names_what_verl_cannot_place() -> None:
    plan = strategy("ppo", "searched")
    try:
        layout = verl_round_trip(plan)
    except SpecError as exc:
        assert exc.key and exc.key.startswith(("sets", "roles"))
        assert "\n" not in str(exc)
    else:
        assert layout == plan_layout(plan)


def test_verl_searched_within_its_pools_round_trips() -> None:
    plan = strategy("ppo-verl-pools", "searched")
    assert plan.strategy == "searched"
    assert verl_round_trip(plan) == plan_layout(plan)


@pytest.mark.parametrize("which", ["standalone", "split"])
def test_verl_refuses_a_critic_or_reference_apart_from_the_actor(which: str) -> None:
    plan = strategy("ppo-anywhere", which)
    with pytest.raises(SpecError, match="one global pool") as info:
        verl_files(plan, job_of(plan))
    assert info.value.key is not None and info.value.key.startswith("sets[")
    assert "\n" not in str(info.value)


def test_verl_reward_pool_round_trips() -> None:
    plan = strategy("ppo", "colocate")
    # The reward model on 8 GPUs of its own, the rest on the other 8 (layouts resized).
    from simulator.specs.parallel import ParallelConfig

    roles = dict(plan.roles)
    for role, rp in roles.items():
        par = rp.parallel
        roles[role] = replace(rp, parallel=replace(par, dp=8 // (par.tp * par.pp)),
                              generation=rp.generation)
    roles["reward"] = replace(roles["reward"], parallel=ParallelConfig(tp=2, dp=4))
    split = replace(with_sets(plan, [(("actor", "critic", "ref"), 8), (("reward",), 8)]),
                    roles=roles)
    split.validate(job_of(plan))
    lines = verl_files(split, job_of(plan))["verl_overrides.txt"].splitlines()
    assert "reward.reward_model.enable_resource_pool=true" in lines
    assert "reward.reward_model.n_gpus_per_node=8" in lines
    assert "reward.reward_model.rollout.tensor_model_parallel_size=2" in lines
    assert verl_round_trip(split) == plan_layout(split)


def test_verl_one_step_off_and_fully_async() -> None:
    plan = strategy("ppo-one-step-off", "searched")
    assert plan.mode == "one_step_off" and plan.rollout is not None
    files = verl_files(plan, job_of(plan))
    assert "verl.experimental.one_step_off_policy.main_ppo" in files["run_verl.sh"]
    assert "hydra.searchpath=[pkg://verl.trainer.config]" in files["verl_overrides.txt"]
    assert verl_round_trip(plan) == plan_layout(plan)

    plan = strategy("grpo-async", "searched")
    assert plan.mode == "async"
    files = verl_files(plan, job_of(plan))
    lines = files["verl_overrides.txt"].splitlines()
    assert "verl.experimental.fully_async_policy.fully_async_main" in files["run_verl.sh"]
    assert "async_training.staleness_threshold=1" in lines  # staleness 2 = 1 + threshold
    assert "async_training.partial_rollout=true" in lines
    assert "algorithm.adv_estimator=grpo" in lines
    assert "reward.reward_model.enable=false" in lines
    assert "actor_rollout_ref.rollout.n=4" in lines
    assert verl_round_trip(plan) == plan_layout(plan)


def test_verl_async_refuses_a_reward_model_on_the_trainer_pool() -> None:
    plan = strategy("ppo-one-step-off", "searched")
    roles = [r for s in plan.sets for r in s.roles]
    merged = with_sets(plan, [(tuple(roles), sum(s.gpus for s in plan.sets))])
    with pytest.raises(SpecError, match="reward model"):
        verl_files(merged, job_of(plan))


def test_verl_refuses_safe_rlhf_and_an_indivisible_mini_batch() -> None:
    plan = strategy("ppo", "colocate")
    with pytest.raises(SpecError, match="mini-batches of whole prompts") as info:
        verl_files(plan, job("ppo", workload={"prompts_per_iteration": 66,
                                              "mini_batches_per_epoch": 4}))
    assert info.value.key == "job.workload.mini_batches_per_epoch"
    with pytest.raises(SpecError, match="no safe-rlhf trainer"):
        verl_files(plan, job("safe-rlhf"))


def test_verl_refuses_mixed_engines() -> None:
    plan = strategy("ppo", "colocate")
    from simulator.specs.parallel import ParallelConfig

    roles = dict(plan.roles)
    roles["actor"] = replace(roles["actor"], parallel=ParallelConfig(tp=1, dp=16,
                                                                     sharding="fsdp"))
    roles["critic"] = replace(roles["critic"], parallel=ParallelConfig(tp=2, dp=8,
                                                                       sharding="optimizer"))
    with pytest.raises(SpecError, match="one engine"):
        verl_files(replace(plan, roles=roles), job_of(plan))


def test_verl_reader_reads_what_the_writer_wrote() -> None:
    plan = strategy("ppo", "colocate")
    files = verl_files(plan, job_of(plan))
    module, config, values = parse_verl_files(files["verl_overrides.txt"], files["run_verl.sh"])
    assert module == "verl.trainer.main_ppo" and config.startswith("ppo_")
    assert values["data.train_batch_size"] == "64"


# ----- OpenRLHF -----


def test_openrlhf_colocate_round_trips() -> None:
    for which in ("colocate", "searched"):
        plan = strategy("ppo-fsdp", which)
        if len(plan.sets) > 1:
            continue  # a searched plan that splits is refused (below)
        assert openrlhf_round_trip(plan) == plan_layout(plan)
        args = parse_openrlhf_args(openrlhf_files(plan, job_of(plan))["openrlhf_args.txt"])
        assert args["train.colocate_all"] is True
        assert args["ds.zero_stage"] == {"fsdp": "3", "optimizer": "1"}.get(
            plan.roles["actor"].parallel.sharding, "1")
        assert args["rollout.batch_size"] == "64"
        assert args["train.batch_size"] == "16"  # 64 sequences in 4 mini-batches
        assert args["algo.advantage.estimator"] == "gae"


@pytest.mark.parametrize("which", ["standalone", "split"])
def test_openrlhf_refuses_sync_generation_apart_from_colocate_all(which: str) -> None:
    plan = strategy("ppo-fsdp-anywhere", which)
    with pytest.raises(SpecError, match="colocate_all") as info:
        openrlhf_files(plan, job_of(plan))
    assert info.value.key is not None and info.value.key.startswith("sets[")


def test_openrlhf_async_round_trips() -> None:
    plan = strategy("grpo-async", "searched")
    try:
        files = openrlhf_files(plan, job_of(plan))
    except SpecError as exc:  # a layout DeepSpeed's one stage cannot carry: named
        assert exc.key and exc.key.startswith(("roles", "sets"))
        return
    args = parse_openrlhf_args(files["openrlhf_args.txt"])
    assert args["train.async_enable"] is True and args["train.async_queue_size"] == "2"
    assert args["train.partial_rollout_enable"] is True
    assert args["reward.remote_url"] == str(SUMS)
    assert openrlhf_round_trip(plan) == plan_layout(plan)


def test_openrlhf_refuses_remax_and_pipelines() -> None:
    plan = strategy("ppo-fsdp", "colocate")
    with pytest.raises(SpecError, match="no remax trainer"):
        openrlhf_files(plan, job("remax"))
    from simulator.specs.parallel import ParallelConfig

    roles = dict(plan.roles)
    roles["actor"] = replace(roles["actor"], parallel=ParallelConfig(pp=2, dp=8,
                                                                     sharding="none"))
    with pytest.raises(SpecError, match="no pipeline parallelism") as info:
        openrlhf_files(replace(plan, roles=roles), job_of(plan))
    assert info.value.key == "roles.actor.parallel.pp"


# ----- the command -----


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True,
                          text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                          cwd=Path(__file__).resolve().parents[1], check=False)


def test_cli_writes_the_files_and_refuses_in_one_line(tmp_path: Path) -> None:
    plan = strategy("ppo", "colocate")
    plan.save(tmp_path / "plan.json")
    done = run_cli("export", str(tmp_path / "plan.json"), "--to", "verl", "--out",
                   str(tmp_path / "v"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "v" / "verl_overrides.txt").is_file()
    script = tmp_path / "v" / "run_verl.sh"
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0

    strategy("ppo-anywhere", "split").save(tmp_path / "split.json")
    done = run_cli("export", str(tmp_path / "split.json"), "--to", "verl")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "split.json: sets[1]" in done.stderr

    done = run_cli("export", str(tmp_path / "missing.json"), "--to", "openrlhf")
    assert done.returncode == 2 and done.stderr.count("\n") == 1

    value = json.loads((tmp_path / "plan.json").read_text())
    del value["job"]
    (tmp_path / "nojob.json").write_text(json.dumps(value))
    done = run_cli("export", str(tmp_path / "nojob.json"), "--to", "verl")
    assert done.returncode == 2 and "job" in done.stderr and done.stderr.count("\n") == 1

    done = run_cli("export", str(tmp_path / "plan.json"), "--to", "deepspeed-chat")
    assert done.returncode == 2 and done.stderr.count("\n") == 1


def test_export_files_names_an_unknown_target() -> None:
    plan = strategy("ppo", "colocate")
    with pytest.raises(SpecError, match="unknown target"):
        export_files(plan, job_of(plan), "nemo")


def test_verl_export_carries_expert_parallelism_and_openrlhf_refuses_it() -> None:
    plan = strategy("grpo-moe", "searched")
    assert plan.roles["actor"].parallel.ep == 2 and plan.roles["ref"].parallel.ep == 4
    lines = verl_files(plan, job_of(plan))["verl_overrides.txt"].splitlines()
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2" in lines
    assert "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1" in lines
    assert "actor_rollout_ref.ref.megatron.expert_model_parallel_size=4" in lines
    assert "actor_rollout_ref.rollout.expert_parallel_size=4" in lines
    assert verl_round_trip(plan) == plan_layout(plan)
    # DeepSpeed trains a mixture of experts without expert parallelism: the layout with
    # ep > 1 is refused, naming the key and the value that would work.
    with pytest.raises(SpecError, match="no expert parallelism: set ep: 1") as info:
        openrlhf_files(plan, job_of(plan))
    assert info.value.key == "roles.actor.parallel.ep"


def test_openrlhf_export_names_every_problem_at_once_with_its_key() -> None:
    """A plan from another framework's space that OpenRLHF cannot run: every reason in one
    line, each with the key that changes it, and the job setting that avoids them all."""
    job = job_from_mapping({
        "algorithm": "ppo", "framework": "hybridflow",
        "models": {"actor": "llama2-7b", "critic": "llama2-7b", "ref": "llama2-7b",
                   "reward": "llama2-7b"},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "device": "a100-80gb"},
        "workload": {"prompts_per_iteration": 1024, "prompt_length": 1024,
                     "response_length": 1024},
        "parallel": {"actor": {"pp": 2, "sharding": "optimizer"},
                     "critic": {"sharding": "fsdp"}}})
    plan = plan_job(job).best.plan
    with pytest.raises(SpecError) as info:
        openrlhf_files(plan, job)
    message = str(info.value)
    assert "\n" not in message and message.startswith("roles.actor.parallel.pp: 2 problems: ")
    assert "(1) roles.actor.parallel.pp: OpenRLHF 0.11 (DeepSpeed) has no pipeline" in message
    assert "(2) roles: OpenRLHF 0.11 uses one --ds.zero_stage" in message
    assert message.endswith("(or plan the job with framework: openrlhf, whose search leaves "
                            "these out)")
