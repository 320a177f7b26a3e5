from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec, from_hf_config
from simulator.specs.presets import MODEL_PRESETS, load_model

MIB = 1024**2


@pytest.mark.parametrize(
    ("preset", "published_params"),
    [
        # Parameter counts of the released checkpoints (Hugging Face safetensors metadata /
        # model cards): Llama-2 7B 6.74B, 13B 13.02B, 70B 68.98B; Llama-3 8B 8.03B, 70B 70.55B;
        # Qwen2.5 model cards: 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 32.5B, 72.7B.
        ("llama2-7b", 6.74e9), ("llama2-13b", 13.02e9), ("llama2-70b", 68.98e9),
        ("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9),
        ("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-3b", 3.09e9),
        ("qwen2.5-7b", 7.61e9), ("qwen2.5-14b", 14.7e9), ("qwen2.5-32b", 32.5e9),
        ("qwen2.5-72b", 72.7e9),
        # Korthikanti et al. 2022 Table 3 model names: 22B, 175B, 530B, 1T.
        ("gpt-22b", 22e9), ("gpt-175b", 175e9), ("gpt-530b", 530e9), ("gpt-1t", 1000e9),
    ],
)
def test_parameter_counts_match_published(preset: str, published_params: float) -> None:
    assert MODEL_PRESETS[preset].param_count == pytest.approx(published_params, rel=0.01)


def test_llama2_7b_exact_count() -> None:
    # 32 x (4*4096^2 + 3*4096*11008 + 2*4096) + 2*32000*4096 + 4096.
    assert MODEL_PRESETS["llama2-7b"].param_count == 6_738_415_616


def test_llama2_7b_kv_cache_is_half_a_mebibyte_per_token() -> None:
    # 2 (K, V) x 32 layers x 4096 x 2 bytes = 0.5 MiB.
    assert MODEL_PRESETS["llama2-7b"].kv_cache_bytes_per_token(2) == 0.5 * MIB


def test_grouped_query_attention_shrinks_kv_cache() -> None:
    # Llama-2-70B: 8 KV heads of 128 -> 2 * 80 * 1024 * 2 bytes = 320 KiB per token.
    assert MODEL_PRESETS["llama2-70b"].kv_cache_bytes_per_token(2) == 2 * 80 * 1024 * 2


def test_value_head_replaces_lm_head() -> None:
    model = MODEL_PRESETS["llama2-7b"]
    assert model.param_count - model.params(value_head=True) == 32000 * 4096 - 4097


def test_from_hf_config_llama_and_qwen(tmp_path: Path) -> None:
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "hidden_act": "silu", "max_position_embeddings": 4096}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    spec = from_hf_config(tmp_path / "llama")
    assert spec.param_count == MODEL_PRESETS["llama2-7b"].param_count
    assert not spec.tied_embeddings

    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": True}
    path = tmp_path / "qwen.json"
    path.write_text(json.dumps(qwen))
    spec = load_model(str(path))
    assert spec.param_count == MODEL_PRESETS["qwen2.5-0.5b"].param_count


def test_from_hf_config_rejects_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(SpecError, match="num_hidden_layers"):
        from_hf_config(path)
    path.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 10,
                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_act": "relu"}))
    with pytest.raises(SpecError, match="unsupported activation 'relu'"):
        from_hf_config(path)


def test_spec_yaml_and_inline_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nlayers: 2\nhidden: 64\nffn_hidden: 128\nheads: 4\nkv_heads: 2\n"
                    "vocab: 100\nmlp: swiglu\ntied_embeddings: true\n")
    from_file = load_model(str(path))
    inline = load_model({"name": "m", "layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4,
                         "kv_heads": 2, "vocab": 100, "mlp": "swiglu",
                         "tied_embeddings": True})
    assert from_file == inline
    assert from_file.param_count == 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 128) \
        + 100 * 64 + 64


@pytest.mark.parametrize(
    ("changes", "key"),
    [({"heads": 6, "kv_heads": 4}, "kv_heads"), ({"layers": 0}, "layers"),
     ({"hidden": 66}, "heads"), ({"mlp": "relu"}, "mlp")],
)
def test_impossible_specs_rejected(changes: dict, key: str) -> None:
    base = {"name": "m", "layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4,
            "kv_heads": 2, "vocab": 100, "mlp": "swiglu", "tied_embeddings": True}
    with pytest.raises(SpecError) as info:
        load_model({**base, **changes}, key="models.actor")
    assert info.value.key == f"models.actor.{key}"


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(SpecError, match=r"unknown model 'llama9'.*llama2-7b"):
        load_model("llama9")


def test_spec_is_hashable_and_equal_by_value() -> None:
    a = MODEL_PRESETS["llama2-7b"]
    b = ModelSpec(name="llama2-7b", layers=32, hidden=4096, ffn_hidden=11008, heads=32,
                  kv_heads=32, vocab=32000, mlp="swiglu", tied_embeddings=False)
    assert a == b and hash(a) == hash(b)
