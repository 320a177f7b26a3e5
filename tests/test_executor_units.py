"""Executor pieces that need torch but no Ray: model, generation, batches, protocols, RL math."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from executor import algorithms as rl  # noqa: E402
from executor.batch import Batch  # noqa: E402
from executor.generation import (  # noqa: E402
    GenerationEngine,
    SamplingParams,
    shard_for_generation,
)
from executor.model import build_model  # noqa: E402
from executor.protocols import (  # noqa: E402
    Protocol,
    RankLayout,
    collect_ranks,
    dispatch,
    protocol_of,
)
from executor.roles import ActorRole, CriticRole  # noqa: E402
from executor.task import EOS, SortDigits  # noqa: E402
from profiles.datafile import SpecError  # noqa: E402
from simulator.specs.model import from_hf_config  # noqa: E402
from simulator.specs.presets import MODEL_PRESETS  # noqa: E402

torch.set_num_threads(1)


# Tiny configs of the Hugging Face families the executor builds (issue 31, defect 1): Qwen2 has
# biases on q, k and v but not on o_proj (a Llama config with attention_bias would add one),
# Llama-3.1 scales its rotary frequencies (positions beyond original / high_freq_factor differ),
# Qwen3 RMS-normalises each query and key head.
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1e6}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_theta": 5e5, "max_position_embeddings": 256,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_theta": 1e6}),
}


def _hf_reference(family: str, transformers):
    config_class, model_class, extra = HF_FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # biases and norms away from their initial 0 and 1
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_model_matches_hugging_face(family: str, tmp_path: Path) -> None:
    """A Hugging Face checkpoint of each family loads into the executor's model with the same
    logits (over 40 positions: past Llama-3.1's scaled wavelengths)."""
    transformers = pytest.importorskip("transformers")
    reference = _hf_reference(family, transformers)
    reference.save_pretrained(tmp_path)
    ours = build_model(from_hf_config(tmp_path), checkpoint=tmp_path).eval()
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        assert torch.allclose(reference(ids).logits, ours(ids), atol=1e-5)


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_written_checkpoints_reload_in_transformers_as_the_same_model(family: str,
                                                                     tmp_path: Path) -> None:
    """What the executor writes (--save-hf, and the config vLLM starts from) is the same
    model to transformers: its own class, no missing or unexpected weight, the same logits,
    and the same spec read back."""
    transformers = pytest.importorskip("transformers")
    from executor.model import write_hf_checkpoint

    reference = _hf_reference(family, transformers)
    reference.save_pretrained(tmp_path / "source")
    spec = from_hf_config(tmp_path / "source")
    ours = build_model(spec, checkpoint=tmp_path / "source").eval()
    state = {n: p.detach() for n, p in ours.named_parameters()}
    write_hf_checkpoint(tmp_path / "written", spec, state, torch.float32)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "written", output_loading_info=True, dtype=torch.float32)
    assert type(reloaded).__name__ == HF_FAMILIES[family][1]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        assert torch.allclose(reloaded.eval()(ids).logits, ours(ids), atol=1e-5)
    again = from_hf_config(tmp_path / "written")
    for field in ("qkv_bias", "qk_norm", "rope_scaling", "rope_theta", "head_dim_value",
                  "kv_heads", "tied_embeddings"):
        assert getattr(again, field) == getattr(spec, field), field


@pytest.mark.parametrize("family", ["qwen3", "llama3.1"])
def test_native_generation_runs_qk_norms_and_scaled_rotary_as_the_model(family: str,
                                                                        tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _hf_reference(family, transformers).save_pretrained(tmp_path)
    spec = from_hf_config(tmp_path)
    model = build_model(spec, checkpoint=tmp_path).eval()
    engine = GenerationEngine(spec)
    engine.load({n: p.detach() for n, p in model.named_parameters()})
    prompts = torch.randint(4, 60, (3, 20))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, eos_token_id=EOS),
                          torch.Generator().manual_seed(0))
    sequence = torch.cat([prompts, out.responses], dim=1)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(sequence)[:, 19:-1], -1).gather(
            -1, out.responses[:, :, None]).squeeze(-1)
    mask = torch.arange(12)[None] < out.lengths[:, None]
    assert torch.allclose(log_probs[mask], out.log_probs[mask], atol=1e-4)


def test_checkpoint_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"no \*.safetensors files"):
        build_model(MODEL_PRESETS["tiny-2l"], checkpoint=tmp_path)


@pytest.mark.parametrize("preset", ["tiny-4l", "tiny-gpt-2l"])
def test_models_have_the_specs_parameter_count(preset: str) -> None:
    spec = MODEL_PRESETS[preset]
    for value_head in (False, True):
        model = build_model(spec, value_head=value_head)
        assert sum(p.numel() for p in model.parameters()) == spec.params(value_head=value_head)


@pytest.mark.parametrize("preset", ["tiny-4l", "tiny-gpt-2l"])
def test_generation_log_probs_are_the_models_and_tp_shards_agree(preset: str) -> None:
    spec = MODEL_PRESETS[preset]
    model = build_model(spec, seed=1).eval()
    weights = {n: p.detach() for n, p in model.named_parameters()}
    engine = GenerationEngine(spec)
    engine.load(weights)
    prompts = torch.randint(4, 14, (3, 6))
    params = SamplingParams(max_new_tokens=8, eos_token_id=EOS)
    out = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    sequence = torch.cat([prompts, out.responses], dim=1)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(sequence)[:, 5:-1], -1).gather(
            -1, out.responses[:, :, None]).squeeze(-1)
    mask = torch.arange(8)[None] < out.lengths[:, None]
    assert torch.allclose(log_probs[mask], out.log_probs[mask], atol=1e-5)
    # Shards of a tp=2 split put back together are the original weights.
    shards = [shard_for_generation(weights, 2, r) for r in range(2)]
    assert torch.equal(torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards],
                                 dim=1), weights["model.layers.0.self_attn.o_proj.weight"])


def test_greedy_generation_is_deterministic_and_stops_at_eos() -> None:
    spec = MODEL_PRESETS["tiny-2l"]
    engine = GenerationEngine(spec)
    engine.load({n: p.detach() for n, p in build_model(spec, seed=2).named_parameters()})
    prompts = torch.randint(4, 14, (4, 5))
    params = SamplingParams(max_new_tokens=6, eos_token_id=EOS, greedy=True)
    a = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    b = engine.generate(prompts, params, torch.Generator().manual_seed(99))
    assert torch.equal(a.responses, b.responses)
    for row, length in zip(a.responses, a.lengths, strict=True):
        assert (row[length:] == 0).all()


def test_batch_split_concat_pad_repeat() -> None:
    batch = Batch({"x": torch.arange(6), "y": torch.arange(12).view(6, 2)}, {"k": 1})
    parts = batch.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert torch.equal(Batch.concat(parts)["y"], batch["y"])
    padded, extra = batch.pad_rows(4)
    assert (len(padded), extra) == (8, 2)
    assert torch.equal(batch.repeat(2)["x"][:4], torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="do not split into 4"):
        batch.split(4)
    ragged = Batch.concat([Batch({"t": torch.ones(1, 2)}), Batch({"t": torch.ones(1, 3)})])
    assert ragged["t"].shape == (2, 3)  # right-padded to the longest


def test_protocols_follow_the_hybrid_engine_groups() -> None:
    # HybridFlow Fig. 8b: training 1-4-2 on 8 GPUs, generation tp 2: generation TP groups
    # {G1,G3}, {G2,G4}, ...; micro-DP groups {G1,G2}, {G3,G4}, ... (0-based below).
    layout = RankLayout(world=8, dp=2, tp=4, gen_tp=2)
    assert layout.micro_dp == 2 and layout.replicas == 4
    assert [layout.gen_tp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.replica_of(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    batch = Batch({"x": torch.arange(8)})
    chunks, assignment = dispatch(Protocol.MICRO_DP, layout, batch)
    assert len(chunks) == 4 and assignment == [0, 1, 0, 1, 2, 3, 2, 3]
    assert collect_ranks(Protocol.MICRO_DP, layout) == [0, 1, 4, 5]
    chunks, assignment = dispatch(Protocol.THREE_D, layout, batch)
    assert len(chunks) == 2 and assignment == [0, 0, 0, 0, 1, 1, 1, 1]
    assert collect_ranks(Protocol.THREE_D, layout) == [0, 4]
    assert protocol_of(ActorRole, "generate") is Protocol.MICRO_DP
    assert protocol_of(CriticRole, "update") is Protocol.THREE_D
    with pytest.raises(AttributeError, match="not a worker operation"):
        protocol_of(ActorRole, "hybrid")


def test_gae_matches_hand_computation() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, returns = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # lambda = gamma = 1: advantage = total future reward - value.
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    assert torch.allclose(returns, torch.ones(1, 3))
    adv, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=0.0)
    # lambda = 0: one-step TD errors r + V(s') - V(s).
    assert torch.allclose(adv, torch.tensor([[0.1, 0.1, 0.3]]))
    masked = torch.tensor([[1.0, 1.0, 0.0]])
    adv, _ = rl.gae(rewards, values, masked, gamma=1.0, lam=1.0)
    assert adv[0, 2] == 0


def test_group_and_baseline_advantages_and_losses() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mask = torch.ones(4, 2)
    adv = rl.group_advantages(scores, 2, mask)
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] == adv[3, 0] == 0
    base = rl.baseline_advantages(scores, torch.full((4,), 0.5), mask)
    assert torch.equal(base[:, 1], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))  # ratio 2 on the first token: clipped
    loss, stats = rl.policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert (rl.kl_k3(torch.randn(10), torch.randn(10)) >= 0).all()
    shaped = rl.kl_penalty_rewards(torch.tensor([1.0]), torch.zeros(1, 3), torch.zeros(1, 3),
                                   torch.tensor([[1.0, 1.0, 0.0]]), 0.1)
    assert torch.equal(shaped, torch.tensor([[0.0, 1.0, 0.0]]))


def test_sort_digits_rule() -> None:
    task = SortDigits(digits=3, values=5)
    prompts = torch.tensor([[1, 6, 4, 5, 3]])  # digits 2, 0, 1
    assert torch.equal(task.targets(prompts), torch.tensor([[4, 5, 6, EOS]]))
    assert task.score(prompts, torch.tensor([[4, 5, 6, EOS]])).item() == 1.0
    assert task.score(prompts, torch.tensor([[4, 5, 9, 0]])).item() == 0.5
    assert task.score(prompts, torch.tensor([[4]])).item() == 0.25


def test_safe_rlhf_cost_rule_multiplier_and_scores() -> None:
    task = SortDigits(digits=3, values=5)  # the forbidden digit is 4 (token 8)
    prompts = torch.tensor([[1, 8, 4, 5, 3]] * 4)
    responses = torch.tensor([[4, 5, 8, EOS, 0], [4, 5, EOS, 8, 0], [4, 5, 6, EOS, 0],
                              [4, 5, 6, 6, 8]])
    # Written before EOS costs 1 (wherever it is); after EOS it is padding and costs nothing.
    assert task.cost(prompts, responses).tolist() == [1.0, 0.0, 0.0, 1.0]
    # The multiplier rises above the threshold, falls below it, and stays positive.
    assert rl.update_lagrange(1.0, 0.5, 0.2, 0.5) > 1.0
    assert 0.0 < rl.update_lagrange(1.0, 0.0, 0.2, 0.5) < 1.0
    assert rl.update_lagrange(1.0, 0.2, 0.2, 0.5) == 1.0
    assert rl.update_lagrange(2.0, 0.7, 0.2, 0.1) == pytest.approx(2.0 * math.exp(0.1))
    # A cost stuck above the threshold drives lambda to its bound, never to an overflow.
    multiplier = 1.0
    for _ in range(50):
        multiplier = rl.update_lagrange(multiplier, 1.0, 0.0, 0.5, maximum=10.0)
    assert multiplier == 10.0
    assert rl.update_lagrange(0.0, 1.0, 0.0, 0.5) == 0.0  # lambda 0: the constraint is off
    scores = rl.safe_scores(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), 1.0)
    assert scores.tolist() == [0.5, 0.0]
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    assert rl.language_model_loss(lp, torch.tensor([[1.0, 1.0, 0.0]])).item() == \
        pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)


def test_plan_json_written_by_planner_is_read_by_executor_validation(tmp_path: Path) -> None:
    from executor.run import ExecutionOptions, validate_for_execution
    from simulator.plan import plan_from_mapping
    from simulator.specs.job import job_from_mapping

    job = job_from_mapping({"algorithm": "grpo", "models": {"actor": "tiny-2l",
                                                            "ref": "tiny-2l", "reward": "rule"},
                            "cluster": {"nodes": 1, "gpus_per_node": 2},
                            "workload": {"prompts_per_iteration": 8, "samples_per_prompt": 2,
                                         "mini_batches_per_epoch": 2}})
    plan = {"format": "hybridflow-plan", "version": 1, "algorithm": "grpo",
            "sets": [{"roles": ["actor", "ref"], "gpus": 2}],
            "roles": {"actor": {"parallel": {"tp": 2, "pp": 1, "dp": 1, "sharding": "optimizer",
                                             "sequence_parallel": False},
                                "generation": {"tp": 1}},
                      "ref": {"parallel": {"tp": 2, "dp": 1, "sequence_parallel": False}}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    options = ExecutionOptions()
    # Left out, the training backend is the one that runs the layout: Megatron here.
    assert plan_from_mapping(plan).roles["actor"].training_backend == "megatron"
    plan["roles"]["actor"]["training_backend"] = "torch"
    with pytest.raises(SpecError, match="distributed optimizer needs the Megatron backend"):
        validate_for_execution(job, plan_from_mapping(plan), options)
    plan["roles"]["actor"]["parallel"]["sharding"] = "none"
    plan["roles"]["actor"]["parallel"]["pp"] = 2
    plan["roles"]["actor"]["parallel"]["tp"] = 1
    with pytest.raises(SpecError, match="needs pipeline parallelism"):
        validate_for_execution(job, plan_from_mapping(plan), options)


def test_protocols_with_pipeline_stages_follow_megatrons_rank_order() -> None:
    # pp 2 x dp 2 x tp 2: rank = (pp * dp + dp_index) * tp + tp_index.
    layout = RankLayout(world=8, dp=2, tp=2, pp=2, gen_tp=1)
    assert [layout.coordinates(r) for r in (0, 3, 4, 7)] == [(0, 0, 0), (0, 1, 1), (1, 0, 0),
                                                                (1, 1, 1)]
    batch = Batch({"x": torch.arange(8)})
    _, assignment = dispatch(Protocol.THREE_D, layout, batch)
    assert assignment == [0, 0, 1, 1, 0, 0, 1, 1]  # each replica spans both stages
    assert collect_ranks(Protocol.THREE_D, layout) == [0, 2]
    # Generation tp 1: a micro-DP group is a replica's 2 tp ranks x 2 stages.
    assert layout.micro_dp == 4 and layout.replicas == 8
    assert [layout.replica_of(r) for r in range(8)] == [0, 1, 4, 5, 2, 3, 6, 7]
    # Generation tp 2: the tp ranks of a stage generate together; stages are replicas.
    wide = RankLayout(world=8, dp=2, tp=2, pp=2, gen_tp=2)
    assert [wide.gen_tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert [wide.replica_of(r) for r in range(8)] == [0, 0, 2, 2, 1, 1, 3, 3]
    assert collect_ranks(Protocol.MICRO_DP, wide) == [0, 4, 2, 6]


def test_role_plans_name_the_backend_that_runs_them() -> None:
    from simulator.plan import ColocatedSet, Plan, RolePlan
    from simulator.specs.parallel import ParallelConfig

    assert RolePlan(parallel=ParallelConfig(tp=2, dp=2, sharding="fsdp",
                                            sequence_parallel=False)).training_backend == "torch"
    assert RolePlan(parallel=ParallelConfig(pp=2)).training_backend == "megatron"
    assert RolePlan(parallel=ParallelConfig(dp=2, sharding="optimizer")).training_backend \
        == "megatron"
    with pytest.raises(SpecError, match="training_backend: unknown training backend 'jax'"):
        RolePlan(parallel=ParallelConfig(), training_backend="jax")
    bad = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor",), gpus=2),),
               roles={"actor": RolePlan(parallel=ParallelConfig(pp=2), training_backend="torch")})
    with pytest.raises(SpecError, match=r"roles\.actor\.training_backend: the torch backend "
                                        r"cannot run pp2-tp1-dp1"):
        bad.check_backends()
    # Context parallelism is priced, not executed: the Megatron backend's local layer spec has
    # no context-parallel attention.
    ring = ParallelConfig(dp=2, cp=2, sharding="optimizer")
    assert RolePlan(parallel=ring).training_backend == "megatron"
    bad = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor",), gpus=2),),
               roles={"actor": RolePlan(parallel=ring)})
    with pytest.raises(SpecError, match="no context parallelism"):
        bad.check_backends()


def test_backends_are_chosen_per_role_and_unavailable_ones_rejected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import executor.backends as backends
    from executor.backends import GENERATION_BACKENDS, TRAINING_BACKENDS, GenerationBackend
    from executor.generation import GenerationEngine
    from executor.run import ExecutionOptions, validate_for_execution
    from simulator.plan import ColocatedSet, Plan, RolePlan
    from simulator.specs.job import job_from_mapping
    from simulator.specs.parallel import GenerationConfig, ParallelConfig

    assert isinstance(GenerationBackend, type)
    assert issubclass(GenerationEngine, GenerationBackend)
    assert "torch" in TRAINING_BACKENDS and {"native", "vllm"} <= set(GENERATION_BACKENDS)
    base = {"algorithm": "grpo", "models": {"actor": "tiny-2l", "ref": "tiny-2l",
                                            "reward": "rule"},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "workload": {"prompts_per_iteration": 8, "samples_per_prompt": 2,
                         "mini_batches_per_epoch": 2}}
    plan = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=1),),
                roles={"actor": RolePlan(parallel=ParallelConfig(),
                                         generation=GenerationConfig()),
                       "ref": RolePlan(parallel=ParallelConfig())})
    job = job_from_mapping({**base, "backends": {"actor": {"generation": "vllm"}}})
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    with pytest.raises(SpecError, match=r"backends\.actor\.generation: vLLM is not installed: "
                                        r"install it with `make engines`"):
        validate_for_execution(job, plan, ExecutionOptions())
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    # tiny-2l's heads have 16 dimensions; vLLM's CPU attention starts at 32.
    with pytest.raises(SpecError, match=r"backends\.actor\.generation: vLLM's CPU attention "
                                        r"supports head sizes"):
        validate_for_execution(job, plan, ExecutionOptions())
    with pytest.raises(SpecError, match=r"backends\.ref\.generation: only the actor"):
        job_from_mapping({**base, "backends": {"ref": {"generation": "vllm"}}})
    with pytest.raises(SpecError, match=r"backends\.actor\.training: must be one of"):
        job_from_mapping({**base, "backends": {"actor": {"training": "jax"}}})
    megatron = job_from_mapping({**base, "backends": {"actor": {"training": "megatron"}}})
    monkeypatch.setattr(backends, "megatron_installed", lambda: False)
    with pytest.raises(SpecError, match=r"backends\.actor\.training: Megatron-core is not "
                                        r"installed: install it with `make engines`"):
        validate_for_execution(megatron, plan, ExecutionOptions())
    monkeypatch.setattr(backends, "megatron_installed", lambda: True)
    # Megatron-core needs CUDA: a local run on a machine without it is refused before a
    # worker starts, naming what would run it; a remote cluster's devices are its own.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SpecError, match=r"backends\.actor\.training: actor train\(s\) with "
                       r"Megatron-core, which needs a CUDA device.*--worker-setup "
                       r"tests\.compat\.megatron_cpu:install"):
        validate_for_execution(megatron, plan, ExecutionOptions())
    remote = ExecutionOptions(address="ray://head:10001")
    validate_for_execution(megatron, plan, remote)
    # Sequence parallelism: Megatron runs it, the torch backend does not.
    sp = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=2),),
              roles={"actor": RolePlan(parallel=ParallelConfig(tp=2, sequence_parallel=True),
                                       generation=GenerationConfig()),
                     "ref": RolePlan(parallel=ParallelConfig(tp=2))})
    two_gpus = {**base, "cluster": {"nodes": 1, "gpus_per_node": 2}}
    validate_for_execution(job_from_mapping({**two_gpus, "backends": {"actor": {
        "training": "megatron"}, "ref": {"training": "megatron"}}}), sp, remote)
    with pytest.raises(SpecError, match=r"roles\.actor\.parallel\.sequence_parallel: the "
                                        r"torch backend runs tensor parallelism without"):
        validate_for_execution(job_from_mapping({**two_gpus, "backends": {"actor": {
            "training": "torch"}}}), sp, ExecutionOptions())
    # Megatron roles of one set share Megatron's per-process parallel state.
    mixed = Plan(algorithm="grpo", sets=(ColocatedSet(roles=("actor", "ref"), gpus=2),),
                 roles={"actor": RolePlan(parallel=ParallelConfig(tp=2, sequence_parallel=False),
                                          generation=GenerationConfig()),
                        "ref": RolePlan(parallel=ParallelConfig(tp=1, dp=2),
                                        training_backend="megatron")})
    with pytest.raises(SpecError, match=r"sets\[0\]: Megatron roles of one colocated set "
                                        r"share one \(tp, pp, vpp, cp\) layout"):
        validate_for_execution(job_from_mapping({**two_gpus, "backends": {"actor": {
            "training": "megatron"}}}), mixed, remote)
    validate_for_execution(job_from_mapping({**base, "backends": {"actor": {
        "training": "torch", "generation": "native"}}}), plan, ExecutionOptions())


def test_worker_groups_refuse_tensor_parallel_groups_across_nodes() -> None:
    from executor.controller import WorkerGroup

    group = object.__new__(WorkerGroup)
    group.index = 0
    group.nodes = ["10.0.0.1"] * 4 + ["10.0.0.2"] * 4
    group.check_groups_share_nodes(4, "tp=4")  # two whole groups per node: fine
    group.check_groups_share_nodes(2, "tp=2")
    group.nodes = ["10.0.0.1"] * 3 + ["10.0.0.2"] * 5
    with pytest.raises(SpecError, match=r"ranks 0-3 \(tp=4\) landed on nodes"):
        group.check_groups_share_nodes(4, "tp=4")


def test_batches_travel_as_cpu_arrays_and_move_to_the_worker_device() -> None:
    import pickle

    batch = Batch({"ids": torch.arange(6).view(3, 2)}, {"k": 1})
    moved = batch.to("cpu")
    assert moved["ids"] is batch["ids"]  # no copy where already there
    back = pickle.loads(pickle.dumps(batch))
    assert torch.equal(back["ids"], batch["ids"]) and back.meta == {"k": 1}


def test_the_workers_gpu_index_comes_from_rays_gpu_ids() -> None:
    from executor.device import local_gpu_index

    # Ray's GPU id -> the worker's CUDA index (Ray usually narrows CUDA_VISIBLE_DEVICES).
    assert local_gpu_index([5], "5") == 0
    assert local_gpu_index([5], "4,5") == 1
    assert local_gpu_index([5], None) == 5
    assert local_gpu_index([], None) == 0


def test_a_failed_groups_workers_are_killed_without_asking_them_to_stop(monkeypatch) -> None:
    """After a failure a rank may sit in a collective with the failed one: a shutdown call
    would queue behind it for the collective's timeout, so the workers are killed outright;
    a graceful stop asks each to close its process groups first."""
    import importlib

    from executor.controller import WorkerGroup

    # The module, not ray.util's function of the same name.
    placement = importlib.import_module("ray.util.placement_group")

    calls: list[str] = []

    class Method:
        def remote(self) -> str:
            calls.append("shutdown")
            return "ref"

    class Worker:
        shutdown = Method()

    class Ray:
        def get(self, refs, timeout=None) -> None:
            calls.append("wait")

        def kill(self, worker) -> None:
            calls.append("kill")

    monkeypatch.setattr(placement, "remove_placement_group", lambda group: calls.append("free"))
    group = object.__new__(WorkerGroup)
    group.ray, group.workers, group.placement_group = Ray(), [Worker(), Worker()], None
    group.shutdown(graceful=False)
    assert calls == ["kill", "kill", "free"]
    calls.clear()
    group.shutdown()
    assert calls == ["shutdown", "shutdown", "wait", "kill", "kill", "free"]


def test_every_sets_workers_start_before_any_set_is_waited_for(monkeypatch) -> None:
    """A run asks Ray for the workers of all its sets first, then waits for each set to
    form, then builds every set's roles with one wait: the sets' processes start and their
    models build side by side (a 4-set plan no longer starts in four rounds)."""
    import executor.run_workers as run_workers
    from simulator.plan import ColocatedSet, Plan, RolePlan
    from simulator.specs.parallel import ParallelConfig

    events: list[str] = []

    class Group:
        def __init__(self, ray, index, colocated, setup, node_ids, form=True):
            assert form is False
            self.index, self.colocated = index, colocated
            self.workers = [SimpleNamespace(code_location=SimpleNamespace(
                remote=lambda: "code"))]
            events.append(f"ask {index}")

        def form(self) -> None:
            events.append(f"form {self.index}")

        def start_build(self, config) -> list[str]:
            return [f"build {self.index} {config}"]

    class Ray:
        def nodes(self) -> list:
            return [{"NodeID": "n0", "NodeManagerAddress": "10.0.0.1", "Alive": True,
                     "Resources": {"GPU": 4}}]

        def get(self, refs):
            events.append(f"wait {refs}")
            return {} if refs == "code" else refs

    class BuiltError(Exception):
        pass

    def stop_here(self):
        raise BuiltError

    monkeypatch.setattr(run_workers, "WorkerGroup", Group)
    monkeypatch.setattr(run_workers.RunWorkers, "_role_handles", stop_here)
    roles = ("actor", "critic", "ref", "reward")
    plan = Plan(algorithm="ppo",
                sets=tuple(ColocatedSet(roles=(r,), gpus=1, first_gpu=i)
                           for i, r in enumerate(roles)),
                roles={r: RolePlan(parallel=ParallelConfig()) for r in roles})
    job = SimpleNamespace(gpu_roles=roles, cluster=SimpleNamespace(gpus_per_node=4))
    workers = run_workers.RunWorkers(Ray(), job, plan, {r: r for r in roles})
    with pytest.raises(BuiltError):
        workers.start(SimpleNamespace(address=None, worker_setup=None), task=None)
    assert events == ["ask 0", "ask 1", "ask 2", "ask 3", "form 0", "form 1", "form 2",
                      "form 3", "wait code",
                      "wait ['build 0 actor', 'build 1 critic', 'build 2 ref', "
                      "'build 3 reward']"]
    assert len(workers.groups) == 4  # all of them stopped if anything fails


def test_run_options_round_trip_through_meta_json():
    """Every option a run keeps is written and read by the same code: a run resumed from
    its meta.json has the options it was started with (--save-hf-every and --log
    tensorboard included), and the invocation's own options come from the command line."""
    from dataclasses import fields, replace

    from executor.run import RUN_LOCAL_OPTIONS, ExecutionOptions

    started = ExecutionOptions(
        steps=7, seed=3, out=Path("runs/a"), transition="naive", actor_lr=1e-5,
        critic_lr=2e-5, rl=rl.RLConfig(gamma=0.99, kl_coef=0.05),
        task=SortDigits(digits=4, values=6), temperature=0.9, top_p=0.95,
        reward_warmup_steps=3, worker_setup="tests.compat.megatron_cpu:install",
        validate_every=2, save_hf=Path("out/actor"), save_hf_every=5,
        save_hf_critic=Path("out/critic"), log_tensorboard=True, checkpoint_every=4,
        max_restarts=1, checkpoints={"actor": "/models/qwen"}, worker_logs=True)
    changed = [f.name for f in fields(ExecutionOptions)
               if f.name not in RUN_LOCAL_OPTIONS and f.name != "log"
               and getattr(started, f.name) == getattr(ExecutionOptions(), f.name)]
    assert changed == [], f"give these a non-default value here: {changed}"
    saved = json.loads(json.dumps(started.to_saved()))
    assert not set(saved) & set(RUN_LOCAL_OPTIONS)
    resumed = ExecutionOptions.from_saved(saved, out=Path("runs/a"), resume=Path("runs/a"),
                                          worker_logs=True)
    assert resumed == replace(started, resume=Path("runs/a"))


def test_run_options_from_a_hand_edited_meta_json_name_the_key():
    from executor.run import ExecutionOptions

    saved = ExecutionOptions(steps=2).to_saved()
    with pytest.raises(SpecError, match=r"options\.save_hf_every.*expected an integer"):
        ExecutionOptions.from_saved({**saved, "save_hf_every": "often"})
    with pytest.raises(SpecError, match=r"options\.checkpoint_evry.*unknown key"):
        ExecutionOptions.from_saved({**saved, "checkpoint_evry": 2})


def test_the_vllm_engine_on_a_gpu_starts_dummy_sleeps_at_level_2_and_wakes_in_order(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # vLLM stood in by a recorder (the real engine runs in tests/engines/test_vllm.py on the
    # CPU, where it cannot sleep): on a GPU the engine starts from config.json alone with
    # dummy weights, removes that directory, captures CUDA graphs, turns the custom
    # all-reduce off under tp > 1, sleeps at level 2 and wakes weights -> reload -> KV cache.
    import sys
    import types

    import torch

    from executor.backends.vllm import VLLMEngine

    calls: list = []

    class FakeLLM:
        def __init__(self, model: str, **settings: object) -> None:
            calls.append(("start", sorted(p.name for p in Path(model).iterdir()), settings))
            self.model = model

        def collective_rpc(self, method: str, kwargs: dict) -> None:
            calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

        def reset_prefix_cache(self) -> None:
            calls.append(("reset_prefix_cache",))

        def sleep(self, level: int) -> None:
            calls.append(("sleep", level))

        def wake_up(self, tags: list[str]) -> None:
            calls.append(("wake_up", tags))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    engine = VLLMEngine(MODEL_PRESETS["tiny-2l"], tp_size=2)
    weights = {"model.embed_tokens.weight": torch.zeros(2, 2)}
    engine.load(weights)
    (_, files, settings), reload, reset = calls
    assert reset == ("reset_prefix_cache",)
    assert files == ["config.json"]  # no weights written
    assert settings["load_format"] == "dummy" and not settings["enforce_eager"]
    assert settings["disable_custom_all_reduce"] and settings["enable_sleep_mode"]
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    assert not Path(engine.llm.model).exists()  # the directory went with the start
    assert reload == ("reload_weights", ["model.embed_tokens.weight"])
    calls.clear()
    engine.unload()
    engine.load(weights)
    assert [c[0] for c in calls] == ["sleep", "empty_cache", "wake_up", "reload_weights",
                                     "reset_prefix_cache", "wake_up"]
    assert calls[0] == ("sleep", 2)
    assert calls[2] == ("wake_up", ["weights"]) and calls[-1] == ("wake_up", ["kv_cache"])


def test_vllm_starts_with_the_plans_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 defect 5: the engine runs what the plan priced: its running cap
    (max_num_seqs), memory share and the job's longest sequence as max_model_len (not vLLM's
    own 1024 / 256 by GPU, or the model's whole context)."""
    import torch

    import executor.hybrid_engine as hybrid_engine
    from simulator.specs.parallel import GenerationConfig

    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hybrid_engine, "has_gpu", lambda: True)
    gen = GenerationConfig(tp=1, max_num_seqs=96, memory_utilization=0.6)
    engine = hybrid_engine.make_engine(MODEL_PRESETS["tiny-2l"], gen, "vllm", seed=0,
                                       tp_group=None, tp_rank=0, max_model_tokens=300)
    assert engine.settings["max_num_seqs"] == 96
    assert engine.settings["gpu_memory_utilization"] == 0.6
    assert engine.settings["max_model_len"] == 300


def test_a_gpu_torch_cannot_use_stops_the_worker_instead_of_running_on_cpu() -> None:
    """Issue 31 defect 8: a Ray GPU on a machine with NVIDIA GPUs whose torch sees no CUDA
    device is an error naming the cause; virtual GPUs (no NVIDIA driver: CPU runs) and usable
    GPUs are not."""
    from executor.device import unusable_gpu_reason

    reason = unusable_gpu_reason(["3"], cuda_available=False, driver_present=True)
    assert reason is not None and "GPU 3" in reason and "CUDA build of torch" in reason
    assert unusable_gpu_reason(["3"], cuda_available=False, driver_present=False) is None
    assert unusable_gpu_reason(["3"], cuda_available=True, driver_present=True) is None
    assert unusable_gpu_reason([], cuda_available=False, driver_present=True) is None


STREAMED_UPDATE = """
import json, sys, tempfile
from collections.abc import Iterator
from pathlib import Path
import torch, torch.distributed as dist
from executor.hybrid_engine import HybridEngine
from executor.trainer import Trainer
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

store = Path(tempfile.mkdtemp()) / "rendezvous"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
spec = MODEL_PRESETS["tiny-2l"]
trainer = Trainer(spec, ParallelConfig(tp=1, dp=1, sequence_parallel=False), value_head=False,
                  seed=0, trainable=True)
hybrid = HybridEngine(trainer, GenerationConfig(tp=1), backend="vllm")
seen = []

def load(weights):
    seen.append(isinstance(weights, Iterator))
    for name, tensor in weights:
        seen.append(name)

hybrid.engine.load = load
hybrid.to_generation()
print(json.dumps({"seen": seen, "names": [n for n, _ in trainer.model.named_parameters()]}))
dist.destroy_process_group()
"""


def test_vllm_receives_the_weights_one_whole_tensor_at_a_time() -> None:
    """Issue 31 defect 4: the transition hands vLLM an iterator that gathers each whole
    tensor as vLLM reads it, not a dict of the whole model gathered first (vLLM itself is not
    needed: it is imported only when the engine starts)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", STREAMED_UPDATE], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["seen"][0] is True
    assert result["seen"][1:] == result["names"]


RECOMPUTE_STEP = """
import json, tempfile
from pathlib import Path
import torch, torch.distributed as dist
from executor.trainer import OptimConfig, Trainer
from simulator.specs.parallel import ParallelConfig
from simulator.specs.presets import MODEL_PRESETS

store = Path(tempfile.mkdtemp()) / "rendezvous"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
spec = MODEL_PRESETS["tiny-2l"]
ids = torch.randint(0, spec.vocab, (4, 12), generator=torch.Generator().manual_seed(0))

def loss_fn(model, batch):
    loss = -model.token_log_probs(batch["input_ids"]).mean()
    return loss, {"loss": loss.detach()}

out = {}
for recompute in ("none", "full"):
    trainer = Trainer(spec, ParallelConfig(tp=1, dp=1, sequence_parallel=False,
                                           recompute=recompute),
                      value_head=False, seed=0, trainable=True, optim=OptimConfig(lr=1e-2))
    saved = []
    hook = lambda tensor: saved.append(tensor.numel()) or tensor
    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        loss = trainer.step([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], loss_fn)["loss"]
    out[recompute] = {"loss": loss, "flag": trainer.model.recompute_layers,
                      "saved": sum(saved),
                      "weights": [p.detach().flatten()[:5].tolist()
                                  for p in trainer.model.parameters()]}
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_full_recompute_checkpoints_the_layers_and_trains_the_same() -> None:
    """Issue 31 defect 9: a plan's recompute: full runs as activation checkpointing in the
    torch backend (it was ignored): fewer saved activations, the same loss and update."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", RECOMPUTE_STEP], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["full"]["flag"] and not runs["none"]["flag"]
    assert runs["full"]["saved"] < runs["none"]["saved"]
    assert runs["full"]["loss"] == pytest.approx(runs["none"]["loss"], rel=1e-6)
    for a, b in zip(runs["full"]["weights"], runs["none"]["weights"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)


def _saved_bytes(compute) -> int:
    """Bytes autograd keeps for the backward while ``compute()`` runs (distinct storages)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute()
    return sum(storages.values())


def test_chunked_log_probs_equal_the_whole_log_softmax_and_keep_only_the_logits() -> None:
    """Issue 31 defect 9: log-probs over the vocabulary a chunk of positions at a time, each
    chunk checkpointed: the values and gradients of log_softmax(logits.float()).gather(), but
    the backward keeps the bf16 logits alone instead of an fp32 copy of them."""
    from executor.trainer import gathered_log_probs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 96, 512, generator=generator).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 512, (2, 96), generator=generator)
    weights = torch.randn(2, 96, generator=generator)

    def whole() -> torch.Tensor:
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)

    def chunked() -> torch.Tensor:
        return gathered_log_probs(logits, targets, chunk_rows=40)

    expected, got = whole(), chunked()
    assert got.dtype == torch.float32 and got.shape == targets.shape
    assert torch.allclose(got, expected, atol=1e-5)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    assert torch.allclose(grad.float(), expected_grad.float(), atol=1e-2)
    logits_bytes = logits.numel() * logits.element_size()
    assert _saved_bytes(whole) >= 2 * logits_bytes  # an fp32 copy of the logits
    assert _saved_bytes(chunked) <= logits_bytes + targets.numel() * 8


def test_replicas_average_gradients_one_bucket_at_a_time(monkeypatch) -> None:
    """Issue 31 defect 9: replicated data parallelism reduces its gradients in DDP-sized
    buckets (one dtype each), not through one flat copy of them all."""
    import executor.trainer as trainer

    grads = [torch.full((n,), float(i + 1)) for i, n in enumerate((10, 30, 5, 40, 2))]
    grads.insert(3, torch.ones(3, dtype=torch.float64))
    buckets = trainer.gradient_buckets(grads, cap_bytes=40 * 4)
    assert [[len(g) for g in b] for b in buckets] == [[10, 30], [5], [3], [40], [2]]
    assert [g for b in buckets for g in b] == grads
    reduced: list[int] = []

    def all_reduce(flat: torch.Tensor, group: object) -> None:
        reduced.append(flat.numel())
        flat.mul_(4)  # four replicas holding the same gradients

    monkeypatch.setattr(trainer.dist, "all_reduce", all_reduce)
    expected = [g.clone() for g in grads]
    trainer.average_in_buckets(grads, group=None, replicas=4, cap_bytes=40 * 4)
    assert reduced == [40, 5, 3, 40, 2]
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_responses_are_cut_to_the_replicas_longest() -> None:
    """Issue 31 defect 9: the generated batch is as wide as its longest response, not
    max_new_tokens, and replicas of different widths concatenate padded to the wider."""
    import types

    from executor.generation import GenerationOutput
    from executor.roles import sample

    class Engine:
        def __init__(self, lengths: list[int]) -> None:
            self.lengths = torch.tensor(lengths)

        def generate(self, prompts, params, generator, prompt_mask=None):
            steps = params.max_new_tokens
            live = torch.arange(steps)[None] < self.lengths[:, None]
            return GenerationOutput(responses=torch.where(live, 7, 0),
                                    log_probs=torch.where(live, -1.0, 0.0),
                                    lengths=self.lengths)

    config = types.SimpleNamespace(sampling=SamplingParams(max_new_tokens=8, eos_token_id=7),
                                    seed=0)
    prompts = Batch({"prompts": torch.ones(2, 3, dtype=torch.long)}, {})
    short = sample(Engine([2, 3]), config, 0, prompts)
    assert short["responses"].shape == (2, 3) and short["input_ids"].shape == (2, 6)
    assert short["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    longer = sample(Engine([5, 1]), config, 1, prompts)
    both = Batch.concat([short, longer])
    assert both["responses"].shape == (4, 5)
    assert both["response_mask"].sum(-1).tolist() == [2, 3, 5, 1]
    assert both["old_log_probs"].sum(-1).tolist() == [-2, -3, -5, -1]


def test_vllm_requests_are_seeded_one_by_one_on_the_cpu_engine_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 defect 5 (per-request seeds): vLLM draws a seeded request's noise one request
    at a time, so on GPUs the requests go unseeded (the engine's seed makes the run
    repeatable); the CPU engine keeps drawing them from the replica's generator."""
    import torch

    from executor.backends.vllm import request_seeds

    generator = torch.Generator().manual_seed(3)
    first = request_seeds(4, generator)
    assert all(isinstance(s, int) for s in first)
    assert first == request_seeds(4, torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = generator.get_state()
    assert request_seeds(4, generator) == [None] * 4
    assert torch.equal(generator.get_state(), state)  # nothing drawn


def test_rms_norm_is_hugging_faces_in_bf16() -> None:
    """Issue 31 defect 2: the norm runs in fp32 and casts back before the weight, as
    transformers' LlamaRMSNorm (and vLLM's kernel): bf16 outputs equal bit for bit, where
    a bf16 computation differs."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from executor.model import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, 64, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.randn(64, generator=generator).to(torch.bfloat16)
    ours, theirs = RMSNorm(64, 1e-6).to(torch.bfloat16), LlamaRMSNorm(64, eps=1e-6)
    theirs = theirs.to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        narrow = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert not torch.equal(narrow, theirs(x))
