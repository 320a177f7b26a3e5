"""ModelSpec: the architecture of a decoder-only transformer, with derived sizes and FLOPs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from profiles.datafile import SpecError, from_mapping, read_mapping, require


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer. Parameter count and FLOPs are derived, never typed in."""

    name: str
    """Display name (a preset name, or whatever the file says)."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model (residual stream) width."""
    ffn_hidden: int
    """MLP inner width (for SwiGLU: the width of each of the gate and up projections)."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (= heads for multi-head attention, fewer for grouped-query attention)."""
    vocab: int
    """Vocabulary size (rows of the embedding)."""
    mlp: Literal["gelu", "swiglu"]
    """MLP type: 2 matrices with GeLU (GPT) or 3 with SwiGLU (Llama, Qwen)."""
    tied_embeddings: bool
    """Whether the output projection shares the input embedding's weights."""
    head_dim: int | None = None
    """Per-head width; default hidden / heads."""
    qkv_bias: bool = False
    """Biases on the Q, K and V projections (Qwen2)."""
    linear_bias: bool = False
    """Biases on every linear layer (GPT-2/3, Megatron GPT)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """RMSNorm (one weight vector) or LayerNorm (weight and bias)."""
    dropout: bool = False
    """Whether training applies dropout (stores masks; Megatron GPT yes, Llama no)."""
    learned_positions: int = 0
    """Rows of a learned position embedding (0 for rotary embeddings)."""
    max_seq_len: int = 4096
    """Context window in tokens (informational; longer jobs get a warning)."""
    rope_theta: float = 10000.0
    """Rotary embedding base (executor only)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers (executor only)."""

    head_dim_value: int = field(init=False, repr=False)
    q_size: int = field(init=False, repr=False)
    kv_size: int = field(init=False, repr=False)
    attention_params_per_layer: int = field(init=False, repr=False)
    mlp_params_per_layer: int = field(init=False, repr=False)
    norm_params_per_layer: int = field(init=False, repr=False)
    params_per_layer: int = field(init=False, repr=False)
    embedding_params: int = field(init=False, repr=False)
    lm_head_params: int = field(init=False, repr=False)
    replicated_params_per_layer: int = field(init=False, repr=False)
    """Parameters of one block that tensor parallelism replicates instead of splitting: the
    norms and the biases of the row-parallel projections (o_proj, down_proj)."""
    final_norm_params: int = field(init=False, repr=False)
    param_count: int = field(init=False, repr=False)
    """Total parameters with the language-model head."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Precomputed: specs are cache keys of the cost models, hashed many times per search.
        return self._hash

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "max_seq_len"):
            require(getattr(self, key) > 0, f"must be a positive integer, got {getattr(self, key)}",
                    key)
        require(self.learned_positions >= 0, "must be >= 0", "learned_positions")
        require(self.heads % self.kv_heads == 0,
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})",
                "kv_heads")
        if self.head_dim is None:
            require(self.hidden % self.heads == 0,
                    f"hidden ({self.hidden}) must be divisible by heads ({self.heads}) "
                    "unless head_dim is given", "heads")
            head_dim = self.hidden // self.heads
        else:
            require(self.head_dim > 0, "must be a positive integer", "head_dim")
            head_dim = self.head_dim
        h = self.hidden
        q_size = self.heads * head_dim
        kv_size = self.kv_heads * head_dim
        attn = h * q_size + 2 * h * kv_size + q_size * h
        if self.qkv_bias or self.linear_bias:
            attn += q_size + 2 * kv_size
        if self.linear_bias:
            attn += h
        mlp_mats = 3 if self.mlp == "swiglu" else 2
        mlp = mlp_mats * h * self.ffn_hidden
        if self.linear_bias:
            mlp += (mlp_mats - 1) * self.ffn_hidden + h
        norm_vec = 2 if self.norm == "layernorm" else 1
        norms = 2 * norm_vec * h
        per_layer = attn + mlp + norms
        embedding = self.vocab * h + self.learned_positions * h
        lm_head = 0 if self.tied_embeddings else self.vocab * h
        total = self.layers * per_layer + embedding + lm_head + norm_vec * h
        replicated = norms + (2 * h if self.linear_bias else 0)
        set_ = object.__setattr__
        set_(self, "head_dim_value", head_dim)
        set_(self, "q_size", q_size)
        set_(self, "kv_size", kv_size)
        set_(self, "attention_params_per_layer", attn)
        set_(self, "mlp_params_per_layer", mlp)
        set_(self, "norm_params_per_layer", norms)
        set_(self, "params_per_layer", per_layer)
        set_(self, "embedding_params", embedding)
        set_(self, "lm_head_params", lm_head)
        set_(self, "replicated_params_per_layer", replicated)
        set_(self, "final_norm_params", norm_vec * h)
        set_(self, "param_count", total)
        set_(self, "_hash", hash(tuple(getattr(self, f) for f in _IDENTITY_FIELDS)))

    # ----- derived quantities (one formula each) -----

    def params(self, *, value_head: bool = False) -> int:
        """Parameter count; with ``value_head`` the LM head is replaced by a hidden->1 head
        (critic, reward and cost models)."""
        if not value_head:
            return self.param_count
        return self.param_count - self.lm_head_params + self.hidden + 1

    def head_output_size(self, *, value_head: bool = False) -> int:
        """Width of the output projection: vocab for an LM head, 1 for a value head."""
        return 1 if value_head else self.vocab

    def linear_params_per_layer(self) -> int:
        """Weights of one block's matrix multiplications (no norms, no biases)."""
        h = self.hidden
        mlp_mats = 3 if self.mlp == "swiglu" else 2
        return 2 * h * self.q_size + 2 * h * self.kv_size + mlp_mats * h * self.ffn_hidden

    def matmul_flops_per_token(self, *, value_head: bool = False) -> int:
        """Forward FLOPs per token in the linear layers and the output head (2 per weight)."""
        head = self.hidden * self.head_output_size(value_head=value_head)
        return 2 * (self.layers * self.linear_params_per_layer() + head)

    def attention_flops_per_token(self, context_tokens: float) -> float:
        """Forward FLOPs per token for QK^T and AV over ``context_tokens`` keys, all layers."""
        return 4.0 * self.layers * self.q_size * context_tokens

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V cached per token across all layers (unsharded)."""
        return 2 * self.layers * self.kv_size * dtype_bytes

    def describe(self) -> str:
        count = self.param_count
        size = next((f"{count / scale:.{digits}f}{unit}" for scale, unit, digits in
                     ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)) if count >= scale),
                    str(count))
        return f"{self.name} ({size} params, {self.layers} layers, hidden {self.hidden})"


_IDENTITY_FIELDS = ("name", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "mlp",
                    "tied_embeddings", "head_dim", "qkv_bias", "linear_bias", "norm", "dropout",
                    "learned_positions", "max_seq_len", "rope_theta", "norm_eps")


# ----------------------------------------------------------------------------------------------
# Loading


def _hf_int(config: dict[str, Any], keys: tuple[str, ...], source: str) -> int:
    for key in keys:
        if key in config:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise SpecError(f"expected an integer, got {value!r}", key=key, source=source)
            return value
    raise SpecError(f"missing key (one of: {', '.join(keys)})", key=keys[0], source=source)


def _hf_number(config: dict[str, Any], key: str, source: str) -> float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(f"expected a finite number, got {value!r}", key=key, source=source)
    return float(value)


_HF_MODEL_TYPES_UNTIED = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma"}

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2")
"""Hugging Face ``model_type`` values read here: dense decoder-only transformers, whose
layers the cost model prices (attention + MLP). Mixture-of-experts (mixtral, qwen2_moe,
deepseek_v3), state-space (mamba) and encoder-decoder models have other layers."""


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (Llama / Qwen2 / Mistral style keys).

    ``path`` may be the file or a checkpoint directory holding ``config.json``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    source = str(path)
    config = read_mapping(path)
    model_type = str(config.get("model_type", ""))
    if model_type and model_type not in HF_MODEL_TYPES:
        raise SpecError(f"model type {model_type!r} is not modelled (dense decoder-only "
                        f"transformers: {', '.join(HF_MODEL_TYPES)})", key="model_type",
                        source=source)
    act = str(config.get("hidden_act", config.get("activation_function", "silu")))
    if act in ("silu", "swish", "swiglu"):
        mlp = "swiglu"
    elif act.startswith("gelu"):
        mlp = "gelu"
    else:
        raise SpecError(f"unsupported activation {act!r} (supported: silu, gelu*)",
                        key="hidden_act", source=source)
    tied_default = model_type not in _HF_MODEL_TYPES_UNTIED
    tied = config.get("tie_word_embeddings", tied_default)
    if not isinstance(tied, bool):
        raise SpecError(f"expected true or false, got {tied!r}", key="tie_word_embeddings",
                        source=source)
    heads = _hf_int(config, ("num_attention_heads", "n_head"), source)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    name = config.get("_name_or_path") or path.parent.name or model_type or "hf-model"
    fields: dict[str, Any] = {
        "name": str(name),
        "layers": _hf_int(config, ("num_hidden_layers", "n_layer"), source),
        "hidden": _hf_int(config, ("hidden_size", "n_embd"), source),
        "ffn_hidden": _hf_int(config, ("intermediate_size", "n_inner"), source),
        "heads": heads,
        "kv_heads": kv_heads,
        "vocab": _hf_int(config, ("vocab_size",), source),
        "mlp": mlp,
        "tied_embeddings": tied,
        "qkv_bias": bool(config.get("attention_bias", model_type == "qwen2")),
    }
    if "max_position_embeddings" in config:
        fields["max_seq_len"] = _hf_int(config, ("max_position_embeddings",), source)
    if "rope_theta" in config:
        fields["rope_theta"] = _hf_number(config, "rope_theta", source)
    for eps_key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if eps_key in config:
            fields["norm_eps"] = _hf_number(config, eps_key, source)
            break
    if head_dim is not None:
        fields["head_dim"] = head_dim
    return from_mapping(ModelSpec, fields, source=source)


def load_model(value: str | dict[str, Any], *, base_dir: Path | None = None,
               key: str = "model") -> ModelSpec:
    """A ModelSpec from a preset name, a spec YAML path, a ``config.json`` path (or its
    directory), or an inline mapping of ModelSpec keys."""
    from simulator.specs.presets import MODEL_PRESETS

    if isinstance(value, dict):
        # An inline model is named after its key (models.actor -> "actor") unless it says.
        named = {"name": key.rsplit(".", 1)[-1], **value}
        return from_mapping(ModelSpec, named, key_prefix=key)
    if not isinstance(value, str):
        raise SpecError(f"expected a preset name, a path or a mapping, got {value!r}", key=key)
    if value in MODEL_PRESETS:
        return MODEL_PRESETS[value]
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
        f"unknown model {value!r}: give a preset ({', '.join(sorted(MODEL_PRESETS))}), "
        "a spec .yaml, or a Hugging Face config.json", key=key)
