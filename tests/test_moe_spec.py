"""Mixture-of-experts model specs: total and active parameters against the published model
cards, the ``moe:`` mapping in spec files, and Hugging Face configs of MoE models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiles.datafile import SpecError
from simulator.specs.model import from_hf_config
from simulator.specs.presets import MODEL_PRESETS, load_model


@pytest.mark.parametrize(("name", "total", "active"), [
    # Model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated"; Qwen3-235B-A22B
    # "235B in total and 22B activated" (huggingface.co/Qwen/...); Mixtral 8x7B "46.7B total
    # parameters but only uses 12.9B parameters per token" (mistral.ai/news/mixtral-of-experts).
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),
    ("qwen3-235b-a22b", 235e9, 22e9),
    ("mixtral-8x7b", 46.7e9, 12.9e9),
])
def test_presets_count_published_total_and_active_parameters(name, total, active):
    model = MODEL_PRESETS[name]
    assert model.param_count == pytest.approx(total, rel=0.02)
    assert model.active_param_count == pytest.approx(active, rel=0.03)
    assert model.is_moe and "active" in model.describe()
    # FLOPs follow the active parameters (2 per weight a token multiplies; the input
    # embedding is a lookup).
    assert model.matmul_flops_per_token() == pytest.approx(
        2 * (model.active_param_count - model.embedding_params), rel=0.01)


def test_dense_models_are_unchanged_by_the_moe_fields():
    model = MODEL_PRESETS["qwen2.5-7b"]
    assert not model.is_moe and model.active_param_count == model.param_count
    assert model.expert_params() == 0 and model.moe_layers == 0


def test_spec_file_moe_mapping_with_shared_experts_and_leading_dense_layers(tmp_path: Path):
    spec = {"name": "ds-like", "layers": 4, "hidden": 64, "ffn_hidden": 256, "heads": 4,
            "kv_heads": 4, "vocab": 100, "mlp": "swiglu", "tied_embeddings": False,
            "moe": {"experts": 8, "top_k": 2, "expert_ffn_hidden": 32, "shared_experts": 1,
                    "first_dense_layers": 1}}
    path = tmp_path / "model.yaml"
    path.write_text(json.dumps(spec), encoding="utf-8")
    model = load_model(str(path))
    h, mats = 64, 3
    attention = 4 * h * h
    norms = 2 * h
    dense = mats * h * 256
    moe = h * 8 + 8 * mats * h * 32 + mats * h * 32
    active_moe = h * 8 + 2 * mats * h * 32 + mats * h * 32
    layers = 4 * (attention + norms) + dense + 3 * moe
    assert model.param_count == layers + 2 * 100 * h + h
    assert model.active_param_count == model.param_count - 3 * (moe - active_moe)
    assert model.moe_layers == 3 and model.expert_params() == 3 * 8 * mats * h * 32


@pytest.mark.parametrize(("moe", "key"), [
    ({"experts": 4, "top_k": 5, "expert_ffn_hidden": 8}, "top_k"),
    ({"experts": 0, "top_k": 1, "expert_ffn_hidden": 8}, "experts"),
    ({"experts": 4, "top_k": 1, "expert_ffn_hidden": 8, "first_dense_layers": 2},
     "first_dense_layers"),
    ({"experts": 4, "top_k": 1}, "expert_ffn_hidden"),
    ({"experts": 4, "top_k": 1, "expert_ffn_hidden": 8, "capacity": 1.0}, "capacity"),
])
def test_bad_moe_mappings_name_the_key(moe, key):
    with pytest.raises(SpecError) as info:
        load_model({"layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4, "kv_heads": 4,
                    "vocab": 64, "mlp": "swiglu", "tied_embeddings": True, "moe": moe},
                   key="models.actor")
    assert key in str(info.value)


def _hf(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_hf_qwen3_moe_config_reads_as_the_preset(tmp_path: Path):
    # Keys of huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json.
    model = from_hf_config(_hf(tmp_path, {
        "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "attention_bias": False}))
    preset = MODEL_PRESETS["qwen3-30b-a3b"]
    assert model.moe == preset.moe
    assert model.qk_norm and preset.qk_norm  # Qwen3's q/k head norms
    assert (model.param_count, model.active_param_count) == (preset.param_count,
                                                             preset.active_param_count)


def test_hf_mixtral_and_qwen2_moe_configs(tmp_path: Path):
    mixtral = from_hf_config(_hf(tmp_path, {
        "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000}))
    assert mixtral.moe == MODEL_PRESETS["mixtral-8x7b"].moe
    qwen2 = from_hf_config(_hf(tmp_path, {
        "model_type": "qwen2_moe", "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "vocab_size": 151936}))
    assert qwen2.moe.shared_experts == 1 and qwen2.moe.shared_ffn == 5632


def test_hf_interleaved_dense_layers_are_refused(tmp_path: Path):
    with pytest.raises(SpecError, match="mlp_only_layers"):
        from_hf_config(_hf(tmp_path, {
            "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "mlp_only_layers": [2], "vocab_size": 64}))


@pytest.mark.parametrize(("training", "generation", "expected"), [
    ("torch", "native", "train it with training: megatron"),
    ("megatron", "native", "native generator computes dense MLPs only"),
])
def test_executor_refuses_what_it_cannot_run_for_moe_before_starting(training, generation,
                                                                      expected):
    pytest.importorskip("torch")
    from executor.backends import check_available

    with pytest.raises(SpecError) as info:
        if training == "megatron":
            pytest.importorskip("megatron.core")
        check_available("actor", training, generation, spec=MODEL_PRESETS["tiny-moe-2l"])
    assert expected in str(info.value) and "backends.actor" in str(info.value)
