"""Built-in model presets. Each architecture is copied from the model's published config.json
(URL next to it); tiny models are for tests and for running the executor on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from profiles.datafile import SpecError, did_you_mean, from_mapping, read_mapping
from simulator.specs.model import (
    LLAMA_31_ROPE_SCALING,
    MLASpec,
    ModelSpec,
    MoESpec,
    from_hf_config,
)


def _llama(name: str, layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int,
           max_seq_len: int, tied: bool = False, **executor_only: Any) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads,
                     kv_heads=kv, vocab=vocab, mlp="swiglu", tied_embeddings=tied,
                     max_seq_len=max_seq_len, **executor_only)


def _qwen2(name: str, layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int,
           tied: bool, max_seq_len: int = 32768) -> ModelSpec:
    # rope_theta 1e6 and rms_norm_eps 1e-6 in every Qwen2.5 config.json below.
    return ModelSpec(name=name, layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads,
                     kv_heads=kv, vocab=vocab, mlp="swiglu", tied_embeddings=tied,
                     qkv_bias=True, max_seq_len=max_seq_len, rope_theta=1e6, norm_eps=1e-6)


def _megatron_gpt(name: str, layers: int, hidden: int, heads: int,
                  dropout: bool = True) -> ModelSpec:
    # GPT architecture as in Megatron-LM and FasterTransformer: ffn = 4 * hidden, vocab 51200,
    # learned positions (2048), tied embeddings, biases, LayerNorm.
    return ModelSpec(name=name, layers=layers, hidden=hidden, ffn_hidden=4 * hidden, heads=heads,
                     kv_heads=heads, vocab=51200, mlp="gelu", tied_embeddings=True,
                     linear_bias=True, norm="layernorm", dropout=dropout, learned_positions=2048,
                     max_seq_len=2048)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama2-7b": _llama("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
    # https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "llama2-13b": _llama("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "llama2-70b": _llama("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
    # https://huggingface.co/codellama/CodeLlama-34b-hf/blob/main/config.json
    "codellama-34b": _llama("codellama-34b", 48, 8192, 22016, 64, 8, 32000, 16384),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama3-8b": _llama("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, rope_theta=5e5),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "llama3-70b": _llama("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, rope_theta=5e5),
    # https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
    "qwen2.5-0.5b": _qwen2("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 151936, tied=True),
    # https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json
    "qwen2.5-1.5b": _qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 151936, tied=True),
    # https://huggingface.co/Qwen/Qwen2.5-3B/blob/main/config.json
    "qwen2.5-3b": _qwen2("qwen2.5-3b", 36, 2048, 11008, 16, 2, 151936, tied=True),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": _qwen2("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, tied=False,
                         max_seq_len=131072),
    # https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
    "qwen2.5-14b": _qwen2("qwen2.5-14b", 48, 5120, 13824, 40, 8, 152064, tied=False,
                          max_seq_len=131072),
    # https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "qwen2.5-32b": _qwen2("qwen2.5-32b", 64, 5120, 27648, 40, 8, 152064, tied=False,
                          max_seq_len=131072),
    # https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
    "qwen2.5-72b": _qwen2("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, tied=False,
                          max_seq_len=131072),
    # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json (the
    # architecture of Llama-3-8B, with rope_theta 5e5 and llama3 RoPE scaling, which cost
    # nothing here but the executor runs).
    "llama3.1-8b": _llama("llama3.1-8b", 32, 4096, 14336, 32, 8, 128256, 131072,
                          rope_theta=5e5, rope_scaling=LLAMA_31_ROPE_SCALING),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json: 36 layers, hidden 4096,
    # intermediate 12288, 32 heads x head_dim 128, 8 KV heads, vocab 151936, untied, QK-norm and
    # no QKV bias.
    "qwen3-8b": ModelSpec(name="qwen3-8b", layers=36, hidden=4096, ffn_hidden=12288, heads=32,
                          kv_heads=8, head_dim=128, vocab=151936, mlp="swiglu",
                          tied_embeddings=False, max_seq_len=40960, rope_theta=1e6,
                          norm_eps=1e-6, qk_norm=True),
    # https://huggingface.co/deepseek-ai/deepseek-llm-7b-base/blob/main/config.json (the
    # architecture of DeepSeek LLM 7B, arXiv 2401.02954 Table 2): 30 layers, hidden 4096,
    # intermediate 11008, 32 heads (no grouping), vocab 102400, untied.
    "deepseek-llm-7b": _llama("deepseek-llm-7b", 30, 4096, 11008, 32, 32, 102400, 4096),
    # https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json: 64 layers, hidden 5120,
    # intermediate 25600, 64 heads x head_dim 128, 8 KV heads, vocab 151936, untied, QK-norm and
    # no QKV bias.
    "qwen3-32b": ModelSpec(name="qwen3-32b", layers=64, hidden=5120, ffn_hidden=25600,
                           heads=64, kv_heads=8, head_dim=128, vocab=151936, mlp="swiglu",
                           tied_embeddings=False, max_seq_len=40960, rope_theta=1e6,
                           norm_eps=1e-6, qk_norm=True),
    # Mixture of experts: huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    # (num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, decoder_sparse_step
    # 1, mlp_only_layers []; 30.5B total, 3.3B activated per the model card).
    "qwen3-30b-a3b": ModelSpec(name="qwen3-30b-a3b", layers=48, hidden=2048, ffn_hidden=6144,
                               heads=32, kv_heads=4, head_dim=128, vocab=151936, mlp="swiglu",
                               tied_embeddings=False, max_seq_len=40960, rope_theta=1e6,
                               norm_eps=1e-6, qk_norm=True,
                               moe=MoESpec(experts=128, top_k=8, expert_ffn_hidden=768)),
    # huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (128 experts, top 8,
    # moe_intermediate_size 1536; 235B total, 22B activated per the model card).
    "qwen3-235b-a22b": ModelSpec(name="qwen3-235b-a22b", layers=94, hidden=4096,
                                 ffn_hidden=12288, heads=64, kv_heads=4, head_dim=128,
                                 vocab=151936, mlp="swiglu", tied_embeddings=False,
                                 max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                                 qk_norm=True,
                                 moe=MoESpec(experts=128, top_k=8, expert_ffn_hidden=1536)),
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers (the first 3
    # dense, intermediate 18432), hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope/rope/v head dims 128/64/128, 256 routed experts (top 8, moe_intermediate_size
    # 2048) and 1 shared, vocab 129280, untied; 671B total, 37B activated (DeepSeek-V3
    # technical report, arXiv 2412.19437 §4.2). The multi-token-prediction module
    # (num_nextn_predict_layers 1, 14B more) is left out, as RLHF trains without it.
    "deepseek-v3": ModelSpec(name="deepseek-v3", layers=61, hidden=7168, ffn_hidden=18432,
                             heads=128, kv_heads=128, vocab=129280, mlp="swiglu",
                             tied_embeddings=False, max_seq_len=163840, norm_eps=1e-6,
                             mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512,
                                         qk_nope_head_dim=128, qk_rope_head_dim=64,
                                         v_head_dim=128),
                             moe=MoESpec(experts=256, top_k=8, expert_ffn_hidden=2048,
                                         shared_experts=1, first_dense_layers=3)),
    # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (num_local_experts 8,
    # num_experts_per_tok 2, intermediate_size 14336; 46.7B total, 12.9B active per token).
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", layers=32, hidden=4096, ffn_hidden=14336,
                              heads=32, kv_heads=8, vocab=32000, mlp="swiglu",
                              tied_embeddings=False, max_seq_len=32768, rope_theta=1e6,
                              moe=MoESpec(experts=8, top_k=2, expert_ffn_hidden=14336)),
    # Megatron GPT models of Korthikanti et al. 2022, Table 3 (arXiv 2205.05198).
    "gpt-22b": _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt-175b": _megatron_gpt("gpt-175b", 96, 12288, 96),
    "gpt-530b": _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _megatron_gpt("gpt-1t", 128, 25600, 160),
    # FasterTransformer docs/gpt_guide.md performance models (inference, no dropout):
    # GPT-6.7B = 32 layers, 32 heads x 128; GPT-20B = 44 layers, 48 heads x 128.
    "gpt-6.7b": _megatron_gpt("gpt-6.7b", 32, 4096, 32, dropout=False),
    "gpt-20b": _megatron_gpt("gpt-20b", 44, 6144, 48, dropout=False),
    # Tiny Llama-architecture models for tests and for the executor on a CPU (built in code,
    # nothing downloaded). Vocabulary 64 covers the built-in digit-sorting task.
    "tiny-2l": _llama("tiny-2l", 2, 64, 128, 4, 2, 64, 256, tied=True),
    "tiny-4l": _llama("tiny-4l", 4, 128, 256, 8, 4, 64, 256, tied=True),
    # tiny-2l with a mixture of 4 experts (top 2) in each layer's MLP: the executor's MoE tests.
    "tiny-moe-2l": ModelSpec(name="tiny-moe-2l", layers=2, hidden=64, ffn_hidden=128, heads=4,
                             kv_heads=2, vocab=64, mlp="swiglu", tied_embeddings=True,
                             max_seq_len=256,
                             moe=MoESpec(experts=4, top_k=2, expert_ffn_hidden=64)),
    # Heads of 32 dimensions, the smallest vLLM's CPU attention supports
    # (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes).
    "tiny-2l-hd32": _llama("tiny-2l-hd32", 2, 128, 256, 4, 2, 64, 256, tied=True),
    # GPT-style test model (LayerNorm, GELU, biases, learned positions, tied head).
    "tiny-gpt-2l": ModelSpec(name="tiny-gpt-2l", layers=2, hidden=64, ffn_hidden=256, heads=4,
                             kv_heads=4, vocab=64, mlp="gelu", tied_embeddings=True,
                             linear_bias=True, norm="layernorm", dropout=False,
                             learned_positions=64, max_seq_len=64),
}
"""Preset name -> ModelSpec."""


def load_model(value: str | dict[str, Any], *, base_dir: Path | None = None,
               key: str = "model") -> ModelSpec:
    """A ModelSpec from a preset name, a spec YAML path, a ``config.json`` path (or its
    directory), or an inline mapping of ModelSpec keys."""
    if isinstance(value, dict):
        # An inline model is named after its key (models.actor -> "actor") unless it says.
        named = {"name": key.rsplit(".", 1)[-1], **value}
        return from_mapping(ModelSpec, named, key_prefix=key)
    if not isinstance(value, str):
        raise SpecError(f"expected a preset name, a path or a mapping, got {value!r}", key=key)
    if value in MODEL_PRESETS:
        return MODEL_PRESETS[value]
    if value.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[value.lower()]
    path = Path(value)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.is_dir() or path.suffix == ".json":
        if not path.exists():
            raise SpecError(f"file not found: {path}", key=key)
        if path.is_dir() and not (path / "config.json").exists():
            raise SpecError(f"{path} is a directory without config.json (a Hugging Face "
                            "checkpoint directory has one)", key=key)
        return from_hf_config(path)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise SpecError(f"file not found: {path}", key=key)
        return from_mapping(ModelSpec, read_mapping(path), source=str(path))
    raise SpecError(
        f"unknown model {value!r}{did_you_mean(value, sorted(MODEL_PRESETS))}: give a preset "
        f"({', '.join(sorted(MODEL_PRESETS))}), "
        "a spec .yaml, or a Hugging Face config.json", key=key)
