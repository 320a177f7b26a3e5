"""Multi-head latent attention (DeepSeek-V2/V3): parameter counts against the published model
cards, Hugging Face configs, the latent KV cache, the projections' tensor-parallel layout and
the attention FLOPs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from profiles.datafile import SpecError
from profiles.device import load_profile
from simulator.costs.generation import decode_step_model
from simulator.costs.transformer import attention_projection_cost, layer_cost, stage_param_count
from simulator.costs.transition import weight_tensors
from simulator.specs.model import ModelSpec, from_hf_config
from simulator.specs.parallel import GenerationConfig
from simulator.specs.presets import MODEL_PRESETS, load_model

DEEPSEEK_V3 = MODEL_PRESETS["deepseek-v3"]
H100 = load_profile("h100-80gb")

# Keys of huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (rope scaling and the
# routing's bias/grouping keys left out: they cost nothing here).
DEEPSEEK_V3_HF = {
    "model_type": "deepseek_v3", "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": False, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000}


def _hf(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_deepseek_v3_counts_its_published_total_and_active_parameters():
    # DeepSeek-V3 technical report (arXiv 2412.19437) §4.2: "671B total parameters, of which
    # 37B are activated for each token" (the multi-token-prediction module aside).
    assert DEEPSEEK_V3.param_count == pytest.approx(671e9, rel=0.005)
    assert DEEPSEEK_V3.active_param_count == pytest.approx(37e9, rel=0.03)
    # One layer's attention by hand: q down 7168x1536, q up 1536x(128x192), kv down
    # 7168x(512+64), kv up 512x(128x(128+128)), out 128x128x7168, two latent norms.
    attention = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                 + 128 * 128 * 7168 + 1536 + 512)
    assert DEEPSEEK_V3.attention_params_per_layer == attention


def test_hf_deepseek_v3_config_reads_as_the_preset(tmp_path: Path):
    model = from_hf_config(_hf(tmp_path, DEEPSEEK_V3_HF))
    assert (model.mla, model.moe) == (DEEPSEEK_V3.mla, DEEPSEEK_V3.moe)
    assert (model.param_count, model.active_param_count) == (DEEPSEEK_V3.param_count,
                                                             DEEPSEEK_V3.active_param_count)


def test_hf_deepseek_v2_lite_without_a_query_latent(tmp_path: Path):
    # huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json: q_lora_rank null.
    model = from_hf_config(_hf(tmp_path, {
        "model_type": "deepseek_v2", "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400}))
    assert model.mla.q_lora_rank == 0
    # Model card: "15.7B total parameters, 2.4B activated" (the input embedding, a lookup,
    # not counted as activated).
    assert model.param_count == pytest.approx(15.7e9, rel=0.01)
    assert model.active_param_count - model.vocab * model.hidden == pytest.approx(2.4e9,
                                                                                  rel=0.03)


@pytest.mark.parametrize(("changes", "key"), [
    ({"kv_heads": 8}, "kv_heads"),
    ({"head_dim": 128}, "head_dim"),
    ({"mla": {"kv_lora_rank": 0, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128}}, "mla.kv_lora_rank"),
    ({"mla": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}},
     "mla.v_head_dim"),
])
def test_bad_latent_attention_specs_name_the_key(changes, key):
    spec = {"layers": 2, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 4,
            "vocab": 64, "mlp": "swiglu", "tied_embeddings": True,
            "mla": {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                    "v_head_dim": 32}}
    with pytest.raises(SpecError, match=key.replace(".", r"\.")):
        load_model({**spec, **changes}, key="models.actor")


def test_the_latent_is_cached_whole_on_every_tensor_parallel_rank():
    # DeepSeek-V2 report §2.1.2: MLA caches d_c + d_h^R = 512 + 64 elements per token and
    # layer; vLLM keeps them on every rank (one KV head).
    for tp in (1, 8):
        assert DEEPSEEK_V3.kv_cache_elements_per_token_per_layer(tp) == 576
    assert DEEPSEEK_V3.kv_cache_bytes_per_token(2) == 61 * 576 * 2
    decode = decode_step_model(DEEPSEEK_V3, GenerationConfig(tp=8, pp=1), "bf16", 8)
    assert decode.kv_bytes_per_token_per_gpu == 61 * 576 * 2
    # Grouped-query attention splits its KV heads instead (Llama-3-70B: 8 of them).
    llama = MODEL_PRESETS["llama3-70b"]
    assert llama.kv_cache_elements_per_token_per_layer(8) * 8 == \
        llama.kv_cache_elements_per_token_per_layer(1)


def test_attention_flops_use_the_query_key_and_value_head_widths():
    # Prefill and training: QK^T over 192 and AV over 128 per head.
    assert DEEPSEEK_V3.attention_pair_flops() == 2 * 128 * (192 + 128)
    # Decode in the absorbed form: each head scores the 576-wide latent+rotary key and sums
    # the 512-wide latents.
    assert DEEPSEEK_V3.decode_attention_flops_per_cached_token(8) == 2 * 128 / 8 * (576 + 512)
    llama = MODEL_PRESETS["llama3-70b"]
    assert llama.attention_pair_flops() == 4 * llama.q_size
    assert llama.decode_attention_flops_per_cached_token(4) == llama.attention_pair_flops() / 4


def test_down_projections_are_duplicated_and_the_rest_split_by_tensor_parallelism():
    tokens = 4096
    _, one = attention_projection_cost(DEEPSEEK_V3, H100, tokens=tokens, tp=1,
                                           sequence_parallel=False, dtype="bf16")
    assert one == 2 * tokens * (DEEPSEEK_V3.attention_params_per_layer - 1536 - 512)
    down = 2 * tokens * 7168 * (1536 + 576)
    _, replicated = attention_projection_cost(DEEPSEEK_V3, H100, tokens=tokens, tp=8,
                                              sequence_parallel=False, dtype="bf16")
    # Without sequence parallelism every rank projects every token down.
    assert replicated == pytest.approx(down + (one - down) / 8)
    # With it, each rank projects its sequence shard: the work splits evenly.
    _, shard = attention_projection_cost(DEEPSEEK_V3, H100, tokens=tokens, tp=8,
                                         sequence_parallel=True, dtype="bf16")
    assert shard == pytest.approx(one / 8)
    # The duplicated weights are whole on every tensor-parallel rank.
    assert DEEPSEEK_V3.replicated_params_per_layer >= 7168 * (1536 + 576)
    whole = stage_param_count(DEEPSEEK_V3, tp=1, pp=1, value_head=False)
    split = stage_param_count(DEEPSEEK_V3, tp=8, pp=1, value_head=False)
    assert split > whole / 8


def test_sequence_parallel_gathers_the_latents_not_the_hidden_state():
    def gather_seconds(model):
        layer = layer_cost(model, H100, micro_batch=1, seq_len=4096, tp=8,
                           sequence_parallel=True, dtype="bf16")
        return layer.tp_forward_seconds

    dense_attention = dataclasses.replace(DEEPSEEK_V3, mla=None, moe=None, head_dim=128)
    latent = dataclasses.replace(DEEPSEEK_V3, moe=None)
    # The latents (1536 + 512 + 64) are narrower than the hidden state (7168).
    assert gather_seconds(latent) < gather_seconds(dense_attention)


def test_weight_tensors_cover_every_parameter():
    sizes = weight_tensors(DEEPSEEK_V3)
    assert sum(e * n for e, n in sizes.items()) == DEEPSEEK_V3.param_count
    # Without the replicated tensors: the norms and the duplicated down projections go.
    split = weight_tensors(DEEPSEEK_V3, replicated=False)
    assert 7168 * 576 in sizes and 7168 * 1536 in sizes
    assert 7168 * 576 not in split and 7168 * 1536 not in split
    duplicated = DEEPSEEK_V3.layers * (7168 * (1536 + 576) + 1536 + 512 + 2 * 7168) + 7168
    assert sum(e * n for e, n in split.items()) == DEEPSEEK_V3.param_count - duplicated


def test_executor_refuses_latent_attention_before_starting():
    pytest.importorskip("torch")
    from executor.backends import check_available

    tiny = ModelSpec(name="tiny-mla", layers=2, hidden=64, ffn_hidden=128, heads=4,
                     kv_heads=4, vocab=64, mlp="swiglu", tied_embeddings=True,
                     mla=DEEPSEEK_V3.mla)
    with pytest.raises(SpecError, match="multi-head latent attention") as info:
        check_available("actor", "torch", "native", spec=tiny)
    assert "backends.actor" in str(info.value)


def test_a_spec_file_latent_moe_model_plans_and_its_plan_loads_back(tmp_path: Path):
    from planner.planning import plan_job
    from planner.search import SearchOptions
    from planner.space import SpaceOptions
    from simulator.plan import load_plan
    from simulator.specs.job import job_from_mapping

    spec = tmp_path / "tiny-latent-moe.yaml"
    spec.write_text(
        "name: tiny-latent-moe\nlayers: 4\nhidden: 256\nffn_hidden: 512\nheads: 4\n"
        "kv_heads: 4\nvocab: 64\nmlp: swiglu\ntied_embeddings: false\n"
        "mla: {kv_lora_rank: 64, q_lora_rank: 96, qk_nope_head_dim: 32, qk_rope_head_dim: 16,"
        " v_head_dim: 32}\n"
        "moe: {experts: 4, top_k: 2, expert_ffn_hidden: 128, shared_experts: 1,"
        " first_dense_layers: 1}\n")
    job = job_from_mapping({
        "algorithm": "grpo", "models": {"actor": str(spec), "ref": str(spec), "reward": "rule"},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "h100-80gb"},
        "workload": {"prompts_per_iteration": 16, "samples_per_prompt": 4,
                     "prompt_length": 64, "response_length": 64}})
    plan = plan_job(job, SearchOptions(space=SpaceOptions(backend="simulated"))).best.plan
    plan.save(tmp_path / "plan.json")
    loaded = job_from_mapping(load_plan(tmp_path / "plan.json").job)
    assert loaded.model("actor") == job.model("actor")
    # Planned for execution, it is refused by name: no executor backend here runs it.
    with pytest.raises(SpecError, match="--backend simulated") as info:
        plan_job(job)
    assert "models.actor" in str(info.value)
