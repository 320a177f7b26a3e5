"""ModelSpec: the architecture of a decoder-only transformer, with derived sizes and FLOPs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from profiles.datafile import SpecError, from_mapping, read_mapping, require


@dataclass(kw_only=True, slots=True, frozen=True)
class RopeScaling:
    """Llama-3.1's rotary frequency scaling (``rope_scaling`` with ``rope_type: llama3`` in a
    Hugging Face config.json): wavelengths longer than original_max_position_embeddings /
    low_freq_factor are stretched by ``factor``, those shorter than original /
    high_freq_factor are kept, and the ones between are blended. Executor only: it changes
    no cost."""

    kind: Literal["llama3"] = "llama3"
    """The scaling rule (``rope_type``); only Llama-3.1's is implemented."""
    factor: float
    """How much the long wavelengths are stretched (Llama-3.1: 8)."""
    low_freq_factor: float
    """Wavelengths above original / low_freq_factor are stretched fully (Llama-3.1: 1)."""
    high_freq_factor: float
    """Wavelengths below original / high_freq_factor are kept (Llama-3.1: 4)."""
    original_max_position_embeddings: int
    """The context the model was pre-trained with (Llama-3.1: 8192)."""

    def __post_init__(self) -> None:
        require(self.kind == "llama3", f"rope type {self.kind!r} is not implemented by the "
                "executor (only llama3, Llama-3.1's)", "kind")
        require(self.factor >= 1, f"must be at least 1, got {self.factor}", "factor")
        require(self.high_freq_factor > self.low_freq_factor > 0,
                "needs high_freq_factor > low_freq_factor > 0", "high_freq_factor")
        require(self.original_max_position_embeddings > 0, "must be a positive integer",
                "original_max_position_embeddings")

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` mapping of a Hugging Face config.json."""
        return {"rope_type": self.kind, "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


LLAMA_31_ROPE_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)
"""https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (rope_scaling)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MoESpec:
    """The mixture-of-experts MLP of a model's MoE layers (Mixtral, Qwen3-MoE, DeepSeek-style):
    a router picks ``top_k`` of ``experts`` routed experts per token, beside ``shared_experts``
    that every token goes through."""

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token goes through."""
    expert_ffn_hidden: int
    """Inner width of one routed expert's MLP (each of gate and up for SwiGLU)."""
    shared_experts: int = 0
    """Experts every token goes through (DeepSeek, Qwen2-MoE); 0 for Mixtral and Qwen3-MoE."""
    shared_expert_ffn_hidden: int | None = None
    """Inner width of one shared expert (default: ``expert_ffn_hidden``)."""
    first_dense_layers: int = 0
    """Leading layers whose MLP stays dense (``ffn_hidden`` wide) before the first MoE layer
    (DeepSeek-V3: 3)."""

    def __post_init__(self) -> None:
        for key in ("experts", "top_k", "expert_ffn_hidden"):
            require(getattr(self, key) > 0,
                    f"must be a positive integer, got {getattr(self, key)}", key)
        require(self.top_k <= self.experts,
                f"top_k ({self.top_k}) cannot exceed experts ({self.experts})", "top_k")
        require(self.shared_experts >= 0, "must be >= 0", "shared_experts")
        require(self.first_dense_layers >= 0, "must be >= 0", "first_dense_layers")
        if self.shared_expert_ffn_hidden is not None:
            require(self.shared_expert_ffn_hidden > 0, "must be a positive integer",
                    "shared_expert_ffn_hidden")

    @property
    def shared_ffn(self) -> int:
        """Inner width of one shared expert."""
        return self.shared_expert_ffn_hidden or self.expert_ffn_hidden


@dataclass(kw_only=True, slots=True, frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3; DeepSeek-V2 report, arXiv 2405.04434
    §2.1): keys and values come out of one shared latent of ``kv_lora_rank`` per token, beside
    one rotary key of ``qk_rope_head_dim`` shared by all heads (what a generation engine caches),
    projected up per head; queries go through a latent of ``q_lora_rank`` (or straight from the
    hidden state when it is 0)."""

    kv_lora_rank: int
    """Width of the compressed key/value latent (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary embedding (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int
    """Per-head query width with rotary embedding, and of the rotary key all heads share
    (DeepSeek-V3: 64)."""
    v_head_dim: int
    """Per-head value width (DeepSeek-V3: 128)."""
    q_lora_rank: int = 0
    """Width of the compressed query latent; 0 projects queries straight from the hidden state
    (DeepSeek-V2-Lite). DeepSeek-V3: 1536."""

    def __post_init__(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require(getattr(self, key) > 0,
                    f"must be a positive integer, got {getattr(self, key)}", key)
        require(self.q_lora_rank >= 0, f"must be >= 0, got {self.q_lora_rank}", "q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (the part without and with rotary embedding)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Elements cached per token and layer: the key/value latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    rope_scaling: RopeScaling | None = None
    """Rotary frequency scaling (Llama-3.1; executor only)."""
    qk_norm: bool = False
    """An RMSNorm over every query and key head before the rotary embedding (Qwen3). Executor
    only: its 2 x head_dim weights per layer are left out of the cost model."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers (executor only)."""
    moe: MoESpec | None = None
    """Mixture of experts: the MLP of every layer after ``moe.first_dense_layers`` is a router
    and experts (None: a dense model)."""
    mla: MLASpec | None = None
    """Multi-head latent attention instead of (grouped-query) attention (None: standard
    attention). ``head_dim`` is then the query/key head width and ``kv_heads`` must equal
    ``heads``."""

    head_dim_value: int = field(init=False, repr=False)
    """Per-head width of queries and keys."""
    q_size: int = field(init=False, repr=False)
    """Width of all query heads (= of all key heads under multi-head latent attention)."""
    kv_size: int = field(init=False, repr=False)
    """Width of the key (and of the value) projection's output under grouped-query attention;
    under multi-head latent attention that of the keys after the up projection."""
    v_size: int = field(init=False, repr=False)
    """Width of the attention output, every head's values (the output projection's input)."""
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
    """Total parameters with the language-model head (every expert of an MoE model)."""
    active_param_count: int = field(init=False, repr=False)
    """Parameters one token goes through: for MoE only its ``top_k`` routed experts (and the
    shared ones); equal to ``param_count`` for a dense model."""
    moe_layers: int = field(init=False, repr=False)
    """Layers with an MoE MLP (0 for a dense model)."""
    expert_params_per_moe_layer: int = field(init=False, repr=False)
    """Weights of one routed expert's MLP (0 for a dense model)."""
    active_linear_params_per_layer: int = field(init=False, repr=False)
    """Mean over layers of the matrix weights one token goes through (FLOPs: 2 per weight)."""
    attention_linear_params_per_layer: int = field(init=False, repr=False)
    """Matrix weights of one layer's attention."""
    duplicated_linear_params_per_layer: int = field(init=False, repr=False)
    """Of those, the ones every tensor-parallel rank holds whole (latent attention's down
    projections; 0 for standard attention)."""
    dense_mlp_params_per_layer: int = field(init=False, repr=False)
    """Weights of a dense layer's MLP (the leading dense layers of an MoE model)."""
    dense_mlp_linear_params_per_layer: int = field(init=False, repr=False)
    """Its matrix weights (no biases)."""
    moe_mlp_params_per_layer: int = field(init=False, repr=False)
    """Weights of an MoE layer's MLP: router, every routed expert, shared experts (0 dense)."""
    active_moe_mlp_params_per_layer: int = field(init=False, repr=False)
    """Of those, what one token goes through: router, top_k routed and the shared experts."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Precomputed: specs are cache keys of the cost models, hashed many times per search.
        return self._hash

    def __post_init__(self) -> None:
        head_dim = self._checked_head_dim()
        att = _attention_sizes(self, head_dim)
        mlps = _mlp_sizes(self)
        h = self.hidden
        moe_layers = mlps.moe_layers
        dense_layers = self.layers - moe_layers
        # Layers differ (dense first layers, MoE after): per-layer sizes are means over layers.
        mlp = (dense_layers * mlps.dense_params + moe_layers * mlps.moe_params) // self.layers
        norm_vec = 2 if self.norm == "layernorm" else 1
        norms = 2 * norm_vec * h
        embedding = self.vocab * h + self.learned_positions * h
        lm_head = 0 if self.tied_embeddings else self.vocab * h
        layer_total = self.layers * (att.params + norms) + dense_layers * mlps.dense_params \
            + moe_layers * mlps.moe_params
        total = layer_total + embedding + lm_head + norm_vec * h
        set_ = object.__setattr__
        set_(self, "head_dim_value", head_dim)
        set_(self, "q_size", att.q_size)
        set_(self, "kv_size", att.kv_size)
        set_(self, "v_size", att.v_size)
        set_(self, "attention_params_per_layer", att.params)
        set_(self, "mlp_params_per_layer", mlp)
        set_(self, "norm_params_per_layer", norms)
        set_(self, "params_per_layer", att.params + mlp + norms)
        set_(self, "embedding_params", embedding)
        set_(self, "lm_head_params", lm_head)
        set_(self, "replicated_params_per_layer",
             norms + (2 * h if self.linear_bias else 0) + att.duplicated_params)
        set_(self, "final_norm_params", norm_vec * h)
        set_(self, "param_count", total)
        set_(self, "active_param_count",
             total - moe_layers * (mlps.moe_params - mlps.active_moe_params))
        set_(self, "moe_layers", moe_layers)
        set_(self, "expert_params_per_moe_layer", mlps.expert_params)
        set_(self, "active_linear_params_per_layer", att.linear_params + (
            dense_layers * mlps.dense_linear_params + moe_layers * mlps.active_moe_params)
            // self.layers)
        set_(self, "attention_linear_params_per_layer", att.linear_params)
        set_(self, "duplicated_linear_params_per_layer", att.duplicated_linear_params)
        set_(self, "dense_mlp_params_per_layer", mlps.dense_params)
        set_(self, "dense_mlp_linear_params_per_layer", mlps.dense_linear_params)
        set_(self, "moe_mlp_params_per_layer", mlps.moe_params)
        set_(self, "active_moe_mlp_params_per_layer", mlps.active_moe_params)
        set_(self, "_hash", hash(tuple(getattr(self, f) for f in _IDENTITY_FIELDS)))

    def _checked_head_dim(self) -> int:
        """Check the dimensions; the per-head width of queries and keys."""
        for key in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "max_seq_len"):
            require(getattr(self, key) > 0, f"must be a positive integer, got {getattr(self, key)}",
                    key)
        require(self.learned_positions >= 0, "must be >= 0", "learned_positions")
        require(self.heads % self.kv_heads == 0,
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})",
                "kv_heads")
        mla = self.mla
        if mla is not None:
            require(self.kv_heads == self.heads,
                    f"multi-head latent attention has a key and value per head: kv_heads "
                    f"({self.kv_heads}) must equal heads ({self.heads})", "kv_heads")
            require(self.head_dim in (None, mla.qk_head_dim),
                    f"head_dim ({self.head_dim}) must be mla.qk_nope_head_dim + "
                    f"mla.qk_rope_head_dim ({mla.qk_head_dim}) or left out", "head_dim")
            require(not (self.qkv_bias or self.linear_bias),
                    "biases are not modelled with multi-head latent attention", "qkv_bias")
            return mla.qk_head_dim
        if self.head_dim is None:
            require(self.hidden % self.heads == 0,
                    f"hidden ({self.hidden}) must be divisible by heads ({self.heads}) "
                    "unless head_dim is given", "heads")
            return self.hidden // self.heads
        require(self.head_dim > 0, "must be a positive integer", "head_dim")
        return self.head_dim

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
        """Weights of one block's matrix multiplications that one token goes through (no
        norms, no biases; for MoE the router, ``top_k`` routed and the shared experts, as a
        mean over the layers)."""
        return self.active_linear_params_per_layer

    def matmul_flops_per_token(self, *, value_head: bool = False) -> int:
        """Forward FLOPs per token in the linear layers and the output head (2 per weight;
        an MoE token multiplies only its active experts' weights)."""
        head = self.hidden * self.head_output_size(value_head=value_head)
        return 2 * (self.layers * self.linear_params_per_layer() + head)

    def stage_moe_layers(self, stage_layers: int) -> int:
        """MoE layers of the heaviest pipeline stage of ``stage_layers`` layers: the leading
        dense layers sit on the first stage, so a later stage is all MoE layers."""
        return min(stage_layers, self.moe_layers)

    def stage_layer_params(self, stage_layers: int) -> int:
        """Weights of the transformer blocks of the heaviest stage of ``stage_layers``
        layers (every routed expert included)."""
        moe = self.stage_moe_layers(stage_layers)
        return (stage_layers * (self.attention_params_per_layer + self.norm_params_per_layer)
                + (stage_layers - moe) * self.dense_mlp_params_per_layer
                + moe * self.moe_mlp_params_per_layer)

    def stage_expert_params(self, stage_layers: int) -> int:
        """Routed-expert weights of the heaviest stage of ``stage_layers`` layers."""
        return self.stage_moe_layers(stage_layers) * self.moe.experts \
            * self.expert_params_per_moe_layer if self.moe is not None else 0

    def stage_active_linear_params(self, stage_layers: int) -> int:
        """Matrix weights one token goes through in the heaviest stage of ``stage_layers``
        layers (for MoE: the router, its top_k and the shared experts)."""
        moe = self.stage_moe_layers(stage_layers)
        return (stage_layers * self.attention_linear_params_per_layer
                + (stage_layers - moe) * self.dense_mlp_linear_params_per_layer
                + moe * self.active_moe_mlp_params_per_layer)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def expert_params(self) -> int:
        """Weights of every routed expert of every MoE layer (what expert parallelism
        shards)."""
        return self.moe_layers * self.moe.experts * self.expert_params_per_moe_layer \
            if self.moe is not None else 0

    def attention_pair_flops(self) -> int:
        """Forward FLOPs of one query attending to one key in one layer: QK^T over the
        query/key head width and AV over the value head width, every head (4 x q_size for
        standard attention)."""
        return 2 * (self.q_size + self.v_size)

    def attention_flops_per_token(self, context_tokens: float) -> float:
        """Forward FLOPs per token for QK^T and AV over ``context_tokens`` keys, all layers."""
        return float(self.layers * self.attention_pair_flops()) * context_tokens

    def decode_attention_flops_per_cached_token(self, tp: int) -> float:
        """Forward FLOPs of one decoding query against one cached token in one layer, on one
        of ``tp`` ranks. Multi-head latent attention decodes in the absorbed form (vLLM's MLA
        backends, DeepSeek-V2 report §2.1.2): each head scores the latent and rotary key
        (``kv_lora_rank + qk_rope_head_dim``) and sums the latents (``kv_lora_rank``)."""
        if self.mla is None:
            return self.attention_pair_flops() / tp
        return 2.0 * self.heads / tp * (self.mla.latent_width + self.mla.kv_lora_rank)

    def kv_cache_elements_per_token_per_layer(self, tp: int) -> int:
        """Elements a generation engine caches per token and layer on one of ``tp`` ranks:
        K and V of the rank's key/value heads (replicated when tp exceeds them), or for
        multi-head latent attention the latent and rotary key, whole on every rank (vLLM
        caches MLA as one head: vllm/config/model.py get_num_kv_heads, v0.32.0)."""
        if self.mla is not None:
            return self.mla.latent_width
        return 2 * math.ceil(self.kv_heads / tp) * self.head_dim_value

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes cached per token across all layers (unsharded)."""
        return self.layers * self.kv_cache_elements_per_token_per_layer(1) * dtype_bytes

    def describe(self) -> str:
        size = f"{_count_text(self.param_count)} params"
        if self.moe is not None:
            size += (f", {_count_text(self.active_param_count)} active, "
                     f"{self.moe.experts} experts top-{self.moe.top_k}")
        if self.mla is not None:
            size += f", latent attention {self.mla.kv_lora_rank}"
        return f"{self.name} ({size}, {self.layers} layers, hidden {self.hidden})"


def _count_text(count: int) -> str:
    return next((f"{count / scale:.{digits}f}{unit}" for scale, unit, digits in
                 ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)) if count >= scale), str(count))


_IDENTITY_FIELDS = ("name", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "mlp",
                    "tied_embeddings", "head_dim", "qkv_bias", "linear_bias", "norm", "dropout",
                    "learned_positions", "max_seq_len", "rope_theta", "norm_eps", "moe", "mla",
                    "rope_scaling", "qk_norm")


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


_HF_MODEL_TYPES_UNTIED = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma",
                          "deepseek_v2", "deepseek_v3"}

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "mixtral", "qwen2_moe",
                  "qwen3_moe", "deepseek_v2", "deepseek_v3")
"""Hugging Face ``model_type`` values read here: decoder-only transformers with grouped-query
attention (or DeepSeek-V2/V3's multi-head latent attention) and a dense or mixture-of-experts
MLP. State-space (mamba) and encoder-decoder models have other layers."""

_HF_MLA_TYPES = ("deepseek_v2", "deepseek_v3")


def hf_mla(config: dict[str, Any], source: str) -> dict[str, int]:
    """The ``mla:`` mapping from a DeepSeek-V2/V3 config (``kv_lora_rank``, ``q_lora_rank``
    (null: no query latent), ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``)."""
    fields = {key: _hf_int(config, (key,), source) for key in (
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    if config.get("q_lora_rank") is not None:
        fields["q_lora_rank"] = _hf_int(config, ("q_lora_rank",), source)
    return fields


def hf_moe(config: dict[str, Any], source: str) -> MoESpec | None:
    """The ``moe:`` mapping from a Hugging Face config: Mixtral (``num_local_experts``),
    Qwen2/3-MoE (``num_experts``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
    ``mlp_only_layers``, ``decoder_sparse_step``) and DeepSeek-V3 (``n_routed_experts``,
    ``n_shared_experts``, ``first_k_dense_replace``) keys; None for a dense config."""
    experts_key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if config.get(k)), None)
    if experts_key is None:
        return None
    experts = _hf_int(config, (experts_key,), source)
    top_k = _hf_int(config, ("num_experts_per_tok",), source)
    mixtral = experts_key == "num_local_experts"
    # Mixtral's experts are as wide as its dense MLP would be.
    expert_ffn = _hf_int(config, ("intermediate_size",) if mixtral
                         else ("moe_intermediate_size",), source)
    fields: dict[str, Any] = {"experts": experts, "top_k": top_k, "expert_ffn_hidden": expert_ffn}
    if config.get("n_shared_experts"):  # DeepSeek: shared experts as wide as routed ones
        fields["shared_experts"] = _hf_int(config, ("n_shared_experts",), source)
    elif config.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert
        fields["shared_experts"] = 1
        fields["shared_expert_ffn_hidden"] = _hf_int(
            config, ("shared_expert_intermediate_size",), source)
    if config.get("first_k_dense_replace"):
        fields["first_dense_layers"] = _hf_int(config, ("first_k_dense_replace",), source)
    interleaved = next((k for k in ("mlp_only_layers", "decoder_sparse_step", "moe_layer_freq")
                        if config.get(k) not in (None, [], 1)), None)
    if interleaved is not None:
        raise SpecError("dense layers between MoE layers are not modelled (only leading dense "
                        "layers: moe.first_dense_layers)", key=interleaved, source=source)
    return from_mapping(MoESpec, fields, source=source, key_prefix="moe")


def hf_rope_scaling(config: dict[str, Any], source: str) -> RopeScaling | None:
    """The rotary scaling of a Hugging Face config (``rope_scaling``, or transformers 5's
    ``rope_parameters``): None for none or ``default``; Llama-3.1's ``llama3`` read; any other
    kind refused, since the executor would run the model with the wrong positions."""
    key = "rope_scaling" if config.get("rope_scaling") is not None else "rope_parameters"
    mapping = config.get(key)
    if mapping is None:
        return None
    if not isinstance(mapping, dict):
        raise SpecError(f"expected a mapping, got {mapping!r}", key=key, source=source)
    kind = mapping.get("rope_type", mapping.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise SpecError(f"rope type {kind!r} is not implemented (the executor runs default and "
                        "llama3 rotary embeddings)", key=f"{key}.rope_type", source=source)
    fields = {"kind": kind}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        fields[name] = _hf_number(mapping, name, source)
    fields["original_max_position_embeddings"] = _hf_int(
        mapping, ("original_max_position_embeddings",), source)
    return from_mapping(RopeScaling, fields, source=source, key_prefix=key)


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
    elif isinstance(config.get("rope_parameters"), dict) and \
            "rope_theta" in config["rope_parameters"]:  # transformers 5 writes it there
        fields["rope_theta"] = _hf_number(config["rope_parameters"], "rope_theta", source)
    scaling = hf_rope_scaling(config, source)
    if scaling is not None:
        fields["rope_scaling"] = {k: getattr(scaling, k) for k in (
            "kind", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")}
    if model_type in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
    for eps_key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if eps_key in config:
            fields["norm_eps"] = _hf_number(config, eps_key, source)
            break
    if model_type in _HF_MLA_TYPES:
        # The query/key head width follows from the latent dims; DeepSeek's multi-token
        # prediction layers (num_nextn_predict_layers) are not part of the model trained here.
        fields["mla"] = hf_mla(config, source)
        fields["kv_heads"] = heads
    elif head_dim is not None:
        fields["head_dim"] = head_dim
    moe = hf_moe(config, source)
    if moe is not None:
        fields["moe"] = {k: getattr(moe, k) for k in (
            "experts", "top_k", "expert_ffn_hidden", "shared_experts",
            "shared_expert_ffn_hidden", "first_dense_layers")}
    return from_mapping(ModelSpec, fields, source=source)


@dataclass(frozen=True, slots=True)
class _AttentionSizes:
    """One layer's attention, in parameters."""

    q_size: int
    kv_size: int
    v_size: int
    linear_params: int
    """Weights of its linear layers."""
    params: int
    """Everything: linear weights, latent norms (MLA) and biases."""
    duplicated_linear_params: int
    """Linear weights every tensor-parallel rank holds whole (MLA's down projections)."""
    duplicated_params: int
    """Those and the latents' norms."""


def _attention_sizes(model: ModelSpec, head_dim: int) -> _AttentionSizes:
    h, mla = model.hidden, model.mla
    q_size = model.heads * head_dim
    if mla is None:
        kv_size = model.kv_heads * head_dim
        v_size = q_size
        attn_linear = 2 * h * q_size + 2 * h * kv_size
        attn = attn_linear
        down = duplicated = 0
    else:
        kv_size = q_size
        v_size = model.heads * mla.v_head_dim
        # The down projections (hidden -> latents) are duplicated on every tensor-parallel
        # rank (Megatron's MLA builds them parallel_mode="duplicated", vLLM as
        # ReplicatedLinear); the up projections and the output projection are split.
        down = h * (mla.q_lora_rank + mla.latent_width)
        query = mla.q_lora_rank * q_size if mla.q_lora_rank else h * q_size
        up_kv = mla.kv_lora_rank * model.heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        attn_linear = down + query + up_kv + v_size * h
        # The latents' norms (query latent, key/value latent) are duplicated too.
        duplicated = down + mla.q_lora_rank + mla.kv_lora_rank
        attn = attn_linear + mla.q_lora_rank + mla.kv_lora_rank
    if model.qkv_bias or model.linear_bias:
        attn += q_size + 2 * kv_size
    if model.linear_bias:
        attn += h
    return _AttentionSizes(q_size=q_size, kv_size=kv_size, v_size=v_size,
                           linear_params=attn_linear, params=attn,
                           duplicated_linear_params=down, duplicated_params=duplicated)


@dataclass(frozen=True, slots=True)
class _MlpSizes:
    """The MLPs, in parameters: a dense layer's, and an MoE layer's whole and active."""

    dense_params: int
    dense_linear_params: int
    """A dense MLP's weight matrices (its biases left out)."""
    moe_layers: int
    expert_params: int
    """One routed expert's weights."""
    moe_params: int
    """An MoE layer's: router, every expert, the shared experts."""
    active_moe_params: int
    """What one token runs through: router, top_k experts, the shared experts."""


def _mlp_sizes(model: ModelSpec) -> _MlpSizes:
    h = model.hidden
    mlp_mats = 3 if model.mlp == "swiglu" else 2
    dense_mlp = mlp_mats * h * model.ffn_hidden
    if model.linear_bias:
        dense_mlp += (mlp_mats - 1) * model.ffn_hidden + h
    moe = model.moe
    moe_layers = expert = router = shared = 0
    if moe is not None:
        require(moe.first_dense_layers < model.layers,
                f"first_dense_layers ({moe.first_dense_layers}) leaves no MoE layer of "
                f"{model.layers}", "moe.first_dense_layers")
        moe_layers = model.layers - moe.first_dense_layers
        expert = mlp_mats * h * moe.expert_ffn_hidden
        router = h * moe.experts
        shared = moe.shared_experts * mlp_mats * h * moe.shared_ffn
    moe_mlp = router + moe.experts * expert + shared if moe is not None else 0
    active_moe_mlp = router + moe.top_k * expert + shared if moe is not None else 0
    return _MlpSizes(dense_params=dense_mlp, dense_linear_params=mlp_mats * h * model.ffn_hidden,
                     moe_layers=moe_layers,
                     expert_params=expert, moe_params=moe_mlp,
                     active_moe_params=active_moe_mlp)
