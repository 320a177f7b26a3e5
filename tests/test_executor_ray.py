"""The executor end to end on a local Ray cluster with virtual GPUs (CPU only, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from executor.batch import Batch  # noqa: E402
from executor.controller import WorkerGroup  # noqa: E402
from executor.generation import tp_shard_dim  # noqa: E402
from executor.model import build_model  # noqa: E402
from executor.run import ExecutionOptions, RunFailedError, role_configs  # noqa: E402
from executor.session import execute  # noqa: E402
from executor.task import SortDigits  # noqa: E402
from profiles.datafile import SpecError  # noqa: E402
from simulator.costs.transition import transition_volume_bytes  # noqa: E402
from simulator.plan import ColocatedSet, Plan, RolePlan  # noqa: E402
from simulator.specs.job import JobSpec, job_from_mapping  # noqa: E402
from simulator.specs.parallel import GenerationConfig, ParallelConfig  # noqa: E402
from simulator.specs.presets import MODEL_PRESETS  # noqa: E402
from tests.conftest import ROOT, SESSION_RAY_GPUS  # noqa: E402

GPUS = SESSION_RAY_GPUS


# The test process's Ray (tests/conftest.py): four virtual GPUs on this CPU machine.
pytestmark = pytest.mark.usefixtures("local_ray")


def job(algorithm: str, gpus: int, **workload: object) -> JobSpec:
    models = {"ppo": {"actor": "tiny-2l", "critic": "tiny-2l", "ref": "tiny-2l",
                      "reward": "tiny-2l"},
              "grpo": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"},
              "remax": {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "tiny-2l"},
              "safe-rlhf": {r: "tiny-2l" for r in ("actor", "critic", "ref", "reward",
                                                   "cost")}}[algorithm]
    work = {"prompts_per_iteration": 8, "prompt_length": 5, "response_length": 5,
            "mini_batches_per_epoch": 2, "train_micro_batch_size": 8,
            "infer_micro_batch_size": 16}
    if algorithm == "grpo":
        work["samples_per_prompt"] = 4
    work.update(workload)
    return job_from_mapping({"algorithm": algorithm, "models": models,
                             "cluster": {"nodes": 1, "gpus_per_node": gpus}, "workload": work})


def plan(job: JobSpec, sets: list[tuple[tuple[str, ...], int]],
         layouts: dict[str, tuple[int, int, str]], gen_tp: int = 1) -> Plan:
    first, colocated = 0, []
    for roles, gpus in sets:
        colocated.append(ColocatedSet(roles=roles, gpus=gpus, first_gpu=first))
        first += gpus
    roles = {}
    for role, (tp, dp, sharding) in layouts.items():
        par = ParallelConfig(tp=tp, dp=dp, sharding=sharding, micro_batch_size=8,
                             sequence_parallel=False)
        roles[role] = RolePlan(parallel=par, generation=GenerationConfig(tp=gen_tp)
                               if role == "actor" else None)
    return Plan(algorithm=job.algorithm, sets=tuple(colocated), roles=roles)


def run(job: JobSpec, plan: Plan, tmp_path: Path, steps: int = 2, **options: object):
    return execute(job, plan, ExecutionOptions(steps=steps, out=tmp_path / "run",
                                               reward_warmup_steps=2, **options))


PPO_ROLES = ("actor", "critic", "ref", "reward")


@pytest.mark.parametrize("placement", ["colocate", "split", "standalone"])
def test_ppo_runs_end_to_end(placement: str, tmp_path: Path) -> None:
    j = job("ppo", GPUS)
    if placement == "colocate":
        p = plan(j, [(PPO_ROLES, 2)], {r: (2, 1, "none") for r in PPO_ROLES})
    elif placement == "split":
        p = plan(j, [(("actor", "ref"), 2), (("critic", "reward"), 2)],
                 {"actor": (1, 2, "fsdp"), "ref": (2, 1, "none"),
                  "critic": (1, 2, "fsdp"), "reward": (1, 2, "none")})
    else:
        p = plan(j, [((r,), 1) for r in PPO_ROLES], {r: (1, 1, "none") for r in PPO_ROLES})
    result = run(j, p, tmp_path)
    out = tmp_path / "run"
    assert {"measurements.csv", "metrics.csv", "meta.json", "trace.json"} <= {
        f.name for f in out.iterdir()}
    rows = pd.read_csv(out / "measurements.csv")
    nodes = set(rows["node"])
    assert {"actor.generate", "actor.transition", "critic.infer", "ref.infer", "reward.infer",
            "advantage", "actor.train", "critic.train", "iteration"} <= nodes
    assert sorted(rows["iteration"].unique()) == [0, 1]
    stages = rows[rows["node"] != "iteration"]
    assert (stages["compute_seconds"] > 0).all()
    assert (stages["wall_seconds"] + 1e-6 >= stages["compute_seconds"]).all()
    generate = stages[stages["node"] == "actor.generate"]
    assert (generate["tokens"] > 8 * 5).all()  # prompts plus generated tokens
    assert len(result.metrics) == 2
    meta = json.loads((out / "meta.json").read_text())
    assert meta["plan"]["placement"] == p.placement and "torch" in meta["versions"]
    trace = json.loads((out / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {s.label() for s in p.sets} <= lanes
    if placement != "colocate":
        # Sets that do not share GPUs overlap in time.
        infer = stages[stages["operation"].isin(["values", "log_probs", "scores"])]
        first = infer[infer["iteration"] == 0]
        assert first["start_seconds"].max() < first["end_seconds"].min() + 1.0


@pytest.mark.parametrize("algorithm", ["grpo", "remax"])
def test_grpo_and_remax_run(algorithm: str, tmp_path: Path) -> None:
    j = job(algorithm, 2)
    roles = ("actor", "ref") if algorithm == "grpo" else ("actor", "ref", "reward")
    p = plan(j, [(roles, 2)], {r: (1, 2, "fsdp" if r == "actor" else "none") for r in roles})
    result = run(j, p, tmp_path)
    rows = pd.read_csv(tmp_path / "run" / "measurements.csv")
    if algorithm == "remax":
        assert "actor.generate_greedy" in set(rows["node"])
        assert "greedy_rule_score" in result.metrics[0]
    else:
        assert "actor_kl" in result.metrics[0]
        assert "reward.infer" in set(rows["node"])  # the rule, on the controller
        assert set(rows[rows["node"] == "reward.infer"]["set"]) == {"controller"}


@pytest.mark.parametrize("cost", ["model", "rule"])
def test_safe_rlhf_runs_with_a_cost_model_or_rule(cost: str, tmp_path: Path) -> None:
    from executor.algorithms import RLConfig, update_lagrange

    j = job("safe-rlhf", 2)
    if cost == "rule":
        j = job_from_mapping({**j.to_value(), "models": {
            **{r: "tiny-2l" for r in ("actor", "critic", "ref", "reward")}, "cost": "rule"}})
    roles = tuple(j.gpu_roles)
    p = plan(j, [(roles, 2)], {r: (1, 2, "fsdp" if r in ("actor", "critic") else "none")
                               for r in roles})
    rl = RLConfig(cost_threshold=0.1, lambda_lr=0.5)
    result = run(j, p, tmp_path, rl=rl)
    rows = pd.read_csv(tmp_path / "run" / "measurements.csv")
    cost_rows = rows[rows["node"] == "cost.infer"]
    assert len(cost_rows) == 2
    assert set(cost_rows["set"]) == ({"controller"} if cost == "rule" else {p.sets[0].label()})
    for metrics in result.metrics:
        assert 0.0 <= metrics["rule_cost"] <= 1.0 and metrics["actor_ptx_loss"] > 0
        # The multiplier follows Safe-RLHF's update from the cost the algorithm saw.
        assert metrics["lambda"] == pytest.approx(update_lagrange(
            metrics["lambda_before"], metrics["cost"], 0.1, 0.5))
    assert result.metrics[1]["lambda_before"] == result.metrics[0]["lambda"]
    if cost == "rule":
        assert all(m["cost"] == m["rule_cost"] for m in result.metrics)


def _actor_group(tp: int, gen_tp: int, mode: str, index: int) -> WorkerGroup:
    j = job("grpo", tp)
    p = plan(j, [(("actor", "ref"), tp)], {"actor": (tp, 1, "none"), "ref": (tp, 1, "none")},
             gen_tp=gen_tp)
    config = role_configs(j, p, ExecutionOptions(transition=mode))["actor"]  # type: ignore[arg-type]
    group = WorkerGroup(ray, index, ColocatedSet(roles=("actor",), gpus=tp))
    group.build(config)
    return group


def _generate(group: WorkerGroup, tp: int, gen_tp: int) -> tuple[Batch, list[dict]]:
    from executor.controller import RoleHandle
    from executor.protocols import RankLayout

    records: list = []
    handle = RoleHandle(group, "actor", RankLayout(world=tp, dp=1, tp=tp, gen_tp=gen_tp),
                        records.append, {})
    prompts = SortDigits().sample(8, torch.Generator().manual_seed(3))
    out = handle.generate(Batch({"prompts": prompts}, {"iteration": 0})).result()
    return out, records[0].infos


def _sharded_bytes(tp: int) -> int:
    """Bytes of the tensor-parallel weights in the job's dtype (bf16: the actor trains and
    generates in it)."""
    model = build_model(MODEL_PRESETS["tiny-2l"])
    return sum(p.numel() * 2 for n, p in model.named_parameters()
               if tp_shard_dim(n) is not None)


@pytest.mark.parametrize(("tp", "gen_tp"), [(2, 1), (4, 2), (4, 1)])
def test_transition_bytes_match_the_simulators_formula(tp: int, gen_tp: int) -> None:
    group = _actor_group(tp, gen_tp, "micro_dp", 0)
    try:
        _, infos = _generate(group, tp, gen_tp)
    finally:
        group.shutdown()
    sharded = _sharded_bytes(tp)
    expected = transition_volume_bytes("micro_dp", sharded, train_shards=tp,
                                       gen_shards=gen_tp, world=tp)
    for info in infos:
        record = info["transition"]
        assert record["bytes_received_per_gpu"] == pytest.approx(expected)
        # Zero redundancy: parameters on a GPU while generating = its generation shard
        # (M / t_g of the sharded weights) plus the replicated norms, nothing more.
        assert record["peak_param_bytes_per_gpu"] == record["generation_param_bytes"]


def test_hybrid_and_naive_transitions_give_the_same_generations() -> None:
    hybrid = _actor_group(2, 1, "micro_dp", 0)
    naive = _actor_group(2, 1, "naive", 1)
    try:
        a, a_infos = _generate(hybrid, 2, 1)
        b, b_infos = _generate(naive, 2, 1)
    finally:
        hybrid.shutdown()
        naive.shutdown()
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["old_log_probs"], b["old_log_probs"])
    hybrid_bytes = a_infos[0]["transition"]["bytes_received_per_gpu"]
    naive_bytes = b_infos[0]["transition"]["bytes_received_per_gpu"]
    # t = 2 -> t_g = 1: both must assemble the full model; naive also gathers the
    # replicated weights it never needed (HybridFlow-V: (t - 1) / t of the sharded weights).
    assert naive_bytes == pytest.approx(transition_volume_bytes(
        "train_group", _sharded_bytes(2), train_shards=2, gen_shards=1, world=2))
    assert hybrid_bytes <= naive_bytes
    assert b_infos[0]["transition"]["peak_param_bytes_per_gpu"] > \
        a_infos[0]["transition"]["peak_param_bytes_per_gpu"]


def test_same_seed_same_results(tmp_path: Path) -> None:
    j = job("grpo", 1)
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})
    first = run(j, p, tmp_path / "a", steps=2, seed=7)
    second = run(j, p, tmp_path / "b", steps=2, seed=7)
    keys = ("rule_score", "actor_policy_loss", "actor_grad_norm", "response_tokens")
    assert [[m[k] for k in keys] for m in first.metrics] == \
        [[m[k] for k in keys] for m in second.metrics]


def test_offloading_training_states_around_generation_changes_no_result(
        tmp_path: Path) -> None:
    """NeMo-RL's framework profile moves optimizer states and gradients to host memory while
    the set generates: the same seed gives the same iterations as without."""
    from dataclasses import replace

    j = job("grpo", 2)
    p = plan(j, [(("actor", "ref"), 2)], {"actor": (2, 1, "none"), "ref": (2, 1, "none")})
    plain = run(j, p, tmp_path / "a", steps=2, seed=7)
    offloading = replace(j, framework="nemo-rl")
    assert offloading.framework_profile.offload.optimizer
    moved = run(offloading, p, tmp_path / "b", steps=2, seed=7)
    generated = [r for r in moved.rows if r["operation"] == "generate"]
    assert generated and all(r["offloaded_bytes"] > 0 for r in generated)
    assert all(not r.get("offloaded_bytes") for r in plain.rows)
    keys = ("rule_score", "actor_policy_loss", "actor_grad_norm", "response_tokens")
    assert [[m[k] for k in keys] for m in plain.metrics] == \
        [[m[k] for k in keys] for m in moved.metrics]


def test_the_workloads_response_length_caps_generation(tmp_path: Path) -> None:
    # The task's answer needs 4 tokens (3 digits and EOS); the workload allows 2.
    j = job("grpo", 1, response_length=2)
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})
    result = run(j, p, tmp_path, steps=1, seed=0)
    metrics = result.metrics[0]
    counts = json.loads(metrics["response_length_counts"])
    assert max(int(length) for length in counts) == 2
    # Responses that used both tokens without an EOS were cut off by the cap.
    cut = sum(n for length, n in counts.items() if int(length) == 2)
    assert 0 < metrics["response_clip_ratio"] <= cut / sum(counts.values())
    assert metrics["response_tokens_max"] == 2
    assert metrics["entropy_estimate"] > 0 and metrics["tokens_per_s"] > 0
    assert metrics["score_min"] <= metrics["score"] <= metrics["score_max"]
    assert metrics["kl_to_reference"] == pytest.approx(0.0, abs=1e-2)  # no update yet
    # A synchronous run recomputes the old log-probs with the trainer (issue 31 defect 2):
    # the generator's agree with them here (the same fp32 kernels on one CPU).
    assert 0 <= metrics["rollout_log_prob_mismatch"] < 1e-3


@pytest.mark.parametrize("layout", [(2, 1, "none"), (1, 2, "fsdp")])
def test_the_trained_actor_is_saved_as_a_hugging_face_checkpoint(
        layout: tuple[int, int, str], tmp_path: Path) -> None:
    """--save-hf: the actor's shards gathered into one Llama checkpoint that transformers
    loads and generates with, computing what the executor's model computes."""
    transformers = pytest.importorskip("transformers")
    j = job("grpo", 2)
    p = plan(j, [(("actor", "ref"), 2)], {"actor": layout, "ref": layout})
    saved = tmp_path / "actor-hf"
    run(j, p, tmp_path, steps=2, save_hf=saved, save_hf_every=1)
    # Written after iteration 0, then replaced whole at the end: nothing partial left.
    assert sorted(x.name for x in tmp_path.iterdir() if "actor-hf" in x.name) == ["actor-hf"]
    model = transformers.LlamaForCausalLM.from_pretrained(saved, torch_dtype=torch.float32)
    ids = torch.tensor([[1, 4, 6, 5, 3]])
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 8)
    ours = build_model(MODEL_PRESETS["tiny-2l"], checkpoint=saved).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ours(ids), atol=1e-5)
    # The trained weights, not the initial ones.
    initial = build_model(MODEL_PRESETS["tiny-2l"], seed=0).state_dict()
    assert not torch.equal(ours.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           initial["model.layers.0.mlp.up_proj.weight"].bfloat16().float())


def test_validation_reward_on_held_out_prompts(tmp_path: Path) -> None:
    j = job("grpo", 1)
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})
    result = run(j, p, tmp_path, steps=3, seed=0, validate_every=2)
    validated = [m for m in result.metrics if "val_score" in m]
    assert [m["iteration"] for m in validated] == [1, 2]  # every 2nd and after the last
    for m in validated:
        assert 0.0 <= m["val_rule_score"] <= 1.0 and m["val_score"] == m["val_rule_score"]
    # Validation is outside the iterations: no stage of the timings is a validation.
    assert not [r for r in result.rows if r["node"] == "actor.validate"]


REWARD_FUNCTION = """
import json, os

def compute_score(prompt, response, row):
    # Log what the executor passed; fail on the second iteration when asked to.
    with open(os.environ["REWARD_LOG"], "a") as log:
        log.write(json.dumps([prompt, response, row]) + "\\n")
    calls = sum(1 for _ in open(os.environ["REWARD_LOG"]))
    if os.environ.get("REWARD_FAIL_AFTER") and calls > int(os.environ["REWARD_FAIL_AFTER"]):
        raise ValueError("the judge is down")
    return {"score": 1.0 if response == row["answer"] else 0.25}
"""


def test_the_users_reward_function_scores_decoded_texts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from simulator.specs.job import RewardFunction

    (tmp_path / "my_reward.py").write_text(REWARD_FUNCTION)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    j = replace(job("grpo", 1), reward_function=RewardFunction(
        path=str(tmp_path / "my_reward.py")))
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})
    result = run(j, p, tmp_path / "ok", steps=2, seed=0)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 * 8 * 4  # every sampled response of both iterations
    prompt, response, row = calls[0]
    assert prompt == " ".join(str(d) for d in row["digits"])  # text, not token ids
    assert all(part.isdigit() for part in response.split())
    scores = [1.0 if c[1] == c[2]["answer"] else 0.25 for c in calls[:32]]
    assert result.metrics[0]["score"] == pytest.approx(sum(scores) / len(scores))
    # A reward function that raises mid-run: the run stops with one line naming the row,
    # and the first iteration's records stay.
    monkeypatch.setenv("REWARD_FAIL_AFTER", str(len(calls) + 32))
    with pytest.raises(RunFailedError, match="row 0: the reward function raised ValueError: "
                                             "the judge is down; records of the 1 finished"):
        run(j, p, tmp_path / "failing", steps=3, seed=0)
    kept = json.loads((tmp_path / "failing" / "run" / "meta.json").read_text())
    assert kept["failure"]["operation"] == "reward function"
    assert (tmp_path / "failing" / "run" / "metrics.csv").read_text().count("\n") == 2


def test_grpo_learns_to_sort_digits(tmp_path: Path) -> None:
    """60 GRPO iterations of a 2-layer, 64-wide model: the rule reward (fraction of correct
    positions) of the last 10 against the first 10. The test asks for a gain of at least 0.2,
    run for the fewest of 20, 30 and 40 iterations at which every seed 0-4 gains 1.5 times
    that, else the 60 it ran before that rule.

    2026-11-28 (benchmarks/learning.py's set-up, bf16, this project's 2-core machine): gains
    of 0.549, 0.402, 0.380, 0.314, 0.374 at 40, so 40. Measured again 2026-12-03, after the
    executor's changes since (the old log-probs recomputed by the trainer among them), gains
    at 20 / 30 / 40 / 50 / 60 iterations: seed 0 0.275 / 0.419 / 0.427 / 0.369 / 0.425, seed
    1 0.194 / 0.416 / 0.459 / 0.471 / 0.494, seed 2 0.226 / 0.420 / 0.412 / 0.434 / 0.430,
    seed 3 0.106 / 0.195 / 0.221 / 0.278 / 0.385, seed 4 0.272 / 0.322 / 0.358 / 0.404 /
    0.480. Seed 3 no longer gains 0.3 by 40 (nor 50), so the rule gives 60 again (seed 0:
    0.063 -> 0.488). The same set-up on one GPU without FSDP (cheaper per iteration; checked
    first by the same rule) gains 0.425, 0.290, 0.401, 0.566 and 0.134 at 40, seed 4 under
    the margin, so the test keeps FSDP."""
    j = job("grpo", 2, prompts_per_iteration=32, samples_per_prompt=8,
            train_micro_batch_size=64, infer_micro_batch_size=64)
    p = plan(j, [(("actor", "ref"), 2)], {"actor": (1, 2, "fsdp"), "ref": (1, 2, "none")})
    result = run(j, p, tmp_path, steps=60, seed=0)
    scores = [m["rule_score"] for m in result.metrics]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last > first + 0.2, (first, last)


def test_safe_rlhf_keeps_the_cost_under_its_threshold(tmp_path: Path) -> None:
    """120 Safe-RLHF iterations with rule reward and rule cost (writing the digit 4 costs 1),
    with the constraint (threshold 0.1) and without it (lambda fixed at 0), over the last 40
    iterations (80-119). The test asks for at most half the unconstrained cost and, under the
    constraint, a reward gain over the first 10 iterations of at least 0.05 (an earlier 0.25
    failed a CI run at seed 0 on this project's 2-core machine).

    Sized by a rule written before the data (2026-11-28): the fewest of 60, 90, 120 and 150
    iterations at which every seed 0-4 keeps 1.5 times the test's margins (cost ratio <= 1/3,
    gain >= 0.075), over the last 40 iterations. Ratio and gain by seed at 120: 0.12/0.106
    (seed 0: 0.060 -> 0.166), 0.18/0.478, 0.13/0.499, 0.07/0.472, 0.11/0.450; at 90 seed 0
    gained 0.065; at 150 (the size before): 0.13-0.25 and 0.109-0.530. Measured again
    2026-12-03 (the executor's changes since): 120 still the fewest; ratio / gain by seed at
    120: 0.128/0.344, 0.109/0.100, 0.089/0.258, 0.129/0.543, 0.128/0.357; at 90 seed 1
    gained 0.014; at 150 seed 0's ratio was 0.356."""
    from executor.algorithms import RLConfig

    models = {"actor": "tiny-2l", "critic": "tiny-2l", "ref": "tiny-2l", "reward": "rule",
              "cost": "rule"}
    j = job_from_mapping({**job("safe-rlhf", 2, prompts_per_iteration=32,
                                train_micro_batch_size=16,
                                infer_micro_batch_size=32).to_value(), "models": models})
    p = plan(j, [(("actor", "ref"), 1), (("critic",), 1)],
             {r: (1, 1, "none") for r in ("actor", "ref", "critic")})
    outcomes = {}
    for name, rl in (("constrained", RLConfig(cost_threshold=0.1)),
                     ("unconstrained", RLConfig(lambda_init=0.0))):
        metrics = run(j, p, tmp_path / name, steps=120, seed=0, rl=rl).metrics
        late = metrics[80:]
        outcomes[name] = (sum(m["rule_score"] for m in metrics[:10]) / 10,
                          sum(m["rule_score"] for m in late) / len(late),
                          sum(m["rule_cost"] for m in late) / len(late))
    first, last, cost = outcomes["constrained"]
    assert last > first + 0.05, outcomes
    assert cost <= 0.5 * outcomes["unconstrained"][2], outcomes


def test_bad_plans_fail_before_any_worker_starts(tmp_path: Path) -> None:
    j = job("ppo", 4)
    too_big = plan(j, [(PPO_ROLES, 8)], {r: (1, 8, "none") for r in PPO_ROLES})
    missing = Plan(algorithm="ppo", sets=(ColocatedSet(roles=("actor", "critic", "ref"),
                                                       gpus=2),),
                   roles={r: RolePlan(parallel=ParallelConfig(dp=2),
                                      generation=GenerationConfig() if r == "actor" else None)
                          for r in ("actor", "critic", "ref")})
    bad_tp = plan(j, [(PPO_ROLES, 3)], {r: (1, 3, "none") for r in PPO_ROLES})
    bad_tp = Plan(algorithm="ppo", sets=bad_tp.sets, roles={
        **bad_tp.roles, "critic": RolePlan(parallel=ParallelConfig(tp=3, dp=1))})
    actors_before = len(ray.util.state.list_actors()) if hasattr(ray.util, "state") else None
    cases = [(too_big, "the sets use 8 GPUs but the cluster has 4"),
             (missing, "'reward' is in no colocated set"),
             (bad_tp, "tp=3 does not divide the 4 attention heads")]
    for bad, message in cases:
        with pytest.raises(SpecError, match=message):
            run(j, bad, tmp_path)
    if actors_before is not None:
        assert len(ray.util.state.list_actors()) == actors_before


def test_cli_plans_and_executes_a_tiny_job(tmp_path: Path) -> None:
    """``plan`` then ``execute`` as a user types them. Both run in this process (as
    ``python -m planner`` calls ``planner.cli.main``), so ``execute`` joins the test process's
    Ray instead of starting its own; a refused run is a child process, to show that it fails
    before any Ray starts."""
    from tests.test_cli import run as in_process

    config = tmp_path / "job.yaml"
    config.write_text(
        "algorithm: grpo\n"
        "models: {actor: tiny-2l, ref: tiny-2l, reward: rule}\n"
        "cluster: {nodes: 1, gpus_per_node: 2}\n"
        "workload: {prompts_per_iteration: 8, prompt_length: 5, response_length: 5,\n"
        "           samples_per_prompt: 4, mini_batches_per_epoch: 2}\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, text=True,
                              capture_output=True, timeout=600)

    planned = in_process("plan", "--config", str(config), "--backend", "fsdp", "--out",
                         str(tmp_path / "report"), "--json")
    assert planned.returncode == 0, planned.stderr
    ran = in_process("execute", str(tmp_path / "report" / "plan.json"), "--steps", "2",
                     "--out", str(tmp_path / "run"), "--json")
    assert ran.returncode == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["steps"] == 2 and len(summary["rule_score"]) == 2
    assert (tmp_path / "run" / "measurements.csv").exists()
    # Every run ends with the plan's prediction (for the lengths it produced) beside the
    # measured medians, per stage and whole; meta.json keeps both.
    stages = {row["node"]: row for row in summary["predicted_vs_measured"]}
    assert {"actor.generate", "actor.train", "ref.infer", "iteration"} <= set(stages)
    whole = stages["iteration"]
    assert whole["error_pct"] == pytest.approx(
        100 * (whole["predicted_seconds"] - whole["measured_seconds"])
        / whole["measured_seconds"])
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["predicted_vs_measured"]["stages"] == summary["predicted_vs_measured"]
    shown = in_process("execute", str(tmp_path / "report" / "plan.json"), "--steps", "1",
                       "--out", str(tmp_path / "run-1"))
    assert shown.returncode == 0, shown.stderr
    assert "predicted (a100-80gb profile, the run's lengths) vs measured" in shown.stdout
    assert shown.stdout.strip().splitlines()[-1].lstrip().startswith("iteration")
    bad = cli("execute", str(tmp_path / "report" / "plan.json"), "--steps", "0")
    assert bad.returncode == 2 and "Started a local Ray" not in bad.stderr
    assert ray.is_initialized()  # the in-process runs left the test process's Ray running


def test_profile_execute_calibrate_accuracy_loop(tmp_path: Path) -> None:
    """profile -> execute -> calibrate -> accuracy, with --quick settings (the commands in
    this process, as ``python -m planner`` runs them)."""
    from tests.test_cli import run as cli

    profile = tmp_path / "here.yaml"
    measured = cli("profile", "--quick", "--out", str(profile))
    assert measured.returncode == 0, measured.stderr
    assert profile.exists() and profile.with_suffix(".measurements.csv").exists()
    j = job("grpo", 2, dtype="fp32")
    runs = []
    for index, layout in enumerate([(1, 1, "none"), (1, 2, "fsdp")]):
        gpus = layout[1]
        p = plan(j, [(("actor", "ref"), gpus)], {"actor": layout, "ref": layout})
        run(j, p, tmp_path / f"r{index}", steps=4)
        runs.append(str(tmp_path / f"r{index}" / "run"))
    calibrated = tmp_path / "fitted.yaml"
    fit = cli("calibrate", *runs, "--profile", str(profile), "-o", str(calibrated),
              "--fit", "kernel_launch_seconds,fsdp_unit_seconds,shared_host_slowdown,"
              "train_compute,infer_compute", "--json")
    assert fit.returncode == 0, fit.stderr
    summary = json.loads(fit.stdout)
    # The fit lowers what it minimises (log errors); the relative RMS it also reports is a
    # different measure and may move either way on two short runs.
    assert summary["objective_after"] < summary["objective_before"]
    assert calibrated.exists()
    result = cli("accuracy", *runs, "--profile", str(calibrated), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"median_abs_error_pct", "max_abs_error_pct", "kendall_tau", "rows"} <= set(report)
    assert {"actor.generate", "ref.infer", "actor.train", "iteration"} <= {
        r["node"] for r in report["rows"]}
    broken = cli("accuracy", str(tmp_path), "--profile", str(calibrated))
    assert broken.returncode == 2 and "meta.json" in broken.stderr


def data_job(tmp_path: Path, algorithm: str, gpus: int, rows: int, epochs: int = 1,
             **data: object) -> JobSpec:
    """A job on the user's data: additions with a word-level tokenizer made by the test, a
    reward function that checks the sum."""
    from tests.dataset_fixtures import (
        REWARD_FUNCTION,
        addition_rows,
        make_tokenizer,
        write_jsonl,
    )

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    write_jsonl(tmp_path / "train.jsonl", addition_rows(rows))
    write_jsonl(tmp_path / "val.jsonl", addition_rows(4, seed=9, chat=True))
    (tmp_path / "sums.py").write_text(REWARD_FUNCTION)
    models = {"actor": "tiny-2l", "ref": "tiny-2l", "reward": "rule"}
    if algorithm == "ppo":
        models["critic"] = "tiny-2l"
    work = {"prompts_per_iteration": 4, "prompt_length": 12, "response_length": 3,
            "mini_batches_per_epoch": 2, "train_micro_batch_size": 4,
            "infer_micro_batch_size": 4}
    if algorithm == "grpo":
        work["samples_per_prompt"] = 2
    return job_from_mapping({
        "algorithm": algorithm, "models": models,
        "cluster": {"nodes": 1, "gpus_per_node": gpus}, "workload": work,
        "reward_function": {"path": "sums.py"},
        "data": {"train_files": "train.jsonl", "val_files": "val.jsonl",
                 "tokenizer": str(tokenizer), "epochs": epochs, **data}},
        base_dir=tmp_path)


def test_grpo_on_the_users_data_with_their_reward_and_tokenizer(tmp_path: Path) -> None:
    """Prompts of different lengths from a JSONL file, left-padded; the reward function gets
    the decoded texts and the rows; the response cap holds; the data position advances until
    the epoch is used up; the actor comes out with the tokenizer, and transformers loads it."""
    transformers = pytest.importorskip("transformers")
    j = data_job(tmp_path, "grpo", 1, rows=10)
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})
    saved = tmp_path / "actor-hf"
    result = run(j, p, tmp_path, steps=4, seed=0, save_hf=saved, validate_every=1)
    # 10 rows, 4 prompts per iteration, one epoch: two iterations, then the data is used up.
    assert [m["iteration"] for m in result.metrics] == [0, 1]
    assert [(m["data_epoch"], m["data_offset"]) for m in result.metrics] == [(0, 0), (0, 4)]
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["data_position"] == {"epoch": 0, "offset": 8, "rows": 10, "seed": 0}
    assert meta["data"]["train_prompts"] == 10
    for m in result.metrics:
        assert m["response_tokens_max"] <= 3  # the workload's response cap
        assert 0 < m["prompt_tokens"] <= m["prompt_tokens_max"] <= 12
        assert 0.0 <= m["score"] <= 1.0 and m["score"] == m["rule_score"]
        assert 0.0 <= m["val_score"] <= 1.0
    # Tokens counted without the prompts' padding.
    generations = [r for r in result.rows if r["node"] == "actor.generate"]
    lengths = json.loads(result.metrics[0]["response_length_counts"])
    responses = sum(int(n) * c for n, c in lengths.items())
    assert generations[0]["tokens"] == pytest.approx(
        result.metrics[0]["prompt_tokens"] * 8 + responses)
    # Predicted vs measured (and calibration) price each iteration's own prompt lengths.
    from planner.calibration import iteration_job, load_run, run_summary

    loaded = load_run(tmp_path / "run")
    assert loaded.prompt_tokens[1] == round(result.metrics[1]["prompt_tokens"])
    assert iteration_job(loaded, 1, "cpu-2core").workload.prompt_length == \
        loaded.prompt_tokens[1]
    assert {r["node"] for r in run_summary(loaded, j.cluster.profile())} >= {
        "actor.generate", "iteration"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved, local_files_only=True)
    assert tokenizer.chat_template and tokenizer.eos_token == "</s>"
    model = transformers.LlamaForCausalLM.from_pretrained(saved, torch_dtype=torch.float32)
    ids = tokenizer("What is 2 + 3 ?", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=2, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 2
    ours = build_model(MODEL_PRESETS["tiny-2l"], checkpoint=saved).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ours(ids), atol=1e-5)


def test_a_resumed_data_run_takes_up_its_data_where_it_stopped(tmp_path: Path) -> None:
    """The data position is part of a checkpoint: a run stopped after 3 iterations and
    resumed to 6 reads the same prompts in the same order as 6 iterations in one go (into
    the second epoch, reshuffled), scores them the same and ends with the same weights."""
    from safetensors.torch import load_file

    j = data_job(tmp_path, "grpo", 1, rows=16, epochs=2)
    p = plan(j, [(("actor", "ref"), 1)], {"actor": (1, 1, "none"), "ref": (1, 1, "none")})

    def options(out: str, steps: int, **more: object) -> ExecutionOptions:
        return ExecutionOptions(steps=steps, seed=2, out=tmp_path / out, reward_warmup_steps=0,
                                save_hf=tmp_path / f"{out}-hf", **more)

    whole = execute(j, p, options("whole", 6))
    execute(j, p, options("half", 3, checkpoint_every=3))
    resumed = execute(j, p, options("half", 6, checkpoint_every=3, resume=tmp_path / "half"))
    position = [(m["data_epoch"], m["data_offset"]) for m in resumed.metrics]
    assert position == [(0, 0), (0, 4), (0, 8), (0, 12), (1, 0), (1, 4)]
    assert position == [(m["data_epoch"], m["data_offset"]) for m in whole.metrics]
    for mine, theirs in zip(resumed.metrics, whole.metrics, strict=True):
        for key in ("prompt_tokens", "score", "actor_policy_loss", "response_tokens"):
            assert mine[key] == theirs[key], key
    a, b = load_file(tmp_path / "whole-hf" / "model.safetensors"), \
        load_file(tmp_path / "half-hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_on_the_users_data_under_tensor_parallelism_writes_the_critic(
        tmp_path: Path) -> None:
    """Left-padded prompts through DTensor tensor parallelism (training, inference and
    generation at tp 2); the critic is written as a token-classification checkpoint whose
    values transformers reproduces."""
    transformers = pytest.importorskip("transformers")
    j = data_job(tmp_path, "ppo", 2, rows=16, epochs=2, prompt_too_long="truncate",
                 max_prompt_length=7)
    roles = ("actor", "critic", "ref")
    p = plan(j, [(roles, 2)], {r: (2, 1, "none") for r in roles}, gen_tp=2)
    critic_dir = tmp_path / "critic-hf"
    result = run(j, p, tmp_path, steps=5, seed=1, save_hf=tmp_path / "actor-hf",
                 save_hf_critic=critic_dir)
    # 16 rows, 4 per iteration, 2 epochs: all 5 iterations run, the second epoch reshuffled.
    assert [(m["data_epoch"], m["data_offset"]) for m in result.metrics] == [
        (0, 0), (0, 4), (0, 8), (0, 12), (1, 0)]
    assert all(m["prompt_tokens_max"] <= 7 for m in result.metrics)  # truncated
    assert all(abs(m["critic_value_loss"]) < 1e3 for m in result.metrics)
    critic = transformers.LlamaForTokenClassification.from_pretrained(
        critic_dir, torch_dtype=torch.float32)
    ours = build_model(MODEL_PRESETS["tiny-2l"], value_head=True, checkpoint=critic_dir).eval()
    ids = torch.tensor([[8, 9, 30, 10, 31, 8]])
    with torch.no_grad():
        assert torch.allclose(critic(ids).logits.squeeze(-1), ours(ids), atol=1e-5)


@pytest.mark.parametrize(("layout", "dtype"), [((1, 2, "fsdp"), "fp32"),
                                               ((2, 1, "none"), "bf16")])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(
        layout: tuple[int, int, str], dtype: str, tmp_path: Path) -> None:
    """Checkpoints (torch DCP, sharded as trained: FSDP shards, or tensor-parallel pieces
    with bf16 weights and fp32 master copies) and the controller's state: 2 iterations, a
    resume to 4, and the same weights, bit for bit, as 4 iterations in one go."""
    from safetensors.torch import load_file

    j = job("grpo", 2, dtype=dtype)
    p = plan(j, [(("actor", "ref"), 2)], {"actor": layout, "ref": layout})
    whole = execute(j, p, ExecutionOptions(steps=4, seed=5, out=tmp_path / "whole",
                                           checkpoint_every=2,
                                           save_hf=tmp_path / "whole-hf"))
    half = tmp_path / "half"
    execute(j, p, ExecutionOptions(steps=2, seed=5, out=half, checkpoint_every=2))
    kept = sorted(x.name for x in (half / "checkpoints").iterdir())
    assert kept == ["iter_000002"]  # complete checkpoints only, no partial left
    assert {x.name for x in (half / "checkpoints" / "iter_000002").iterdir()} >= {
        "actor", "controller.json"}
    resumed = execute(j, p, ExecutionOptions(steps=4, seed=5, out=half, checkpoint_every=2,
                                             resume=half, save_hf=tmp_path / "half-hf"))
    a, b = load_file(tmp_path / "whole-hf" / "model.safetensors"), \
        load_file(tmp_path / "half-hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["iteration"] for m in resumed.metrics] == [0, 1, 2, 3]
    for mine, theirs in zip(resumed.metrics, whole.metrics, strict=True):
        for key in ("score", "actor_policy_loss", "actor_grad_norm", "response_tokens"):
            assert mine[key] == theirs[key], key
    rows = pd.read_csv(half / "measurements.csv")
    assert sorted(rows[rows["node"] == "iteration"]["iteration"]) == [0, 1, 2, 3]
    meta = json.loads((half / "meta.json").read_text())
    assert meta["resumed_from"].endswith("iter_000002")
    assert [c["iterations_done"] for c in meta["checkpoints_written"]] == [4]
