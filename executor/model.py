"""Causal language models built from a ModelSpec (torch): Llama-style (RMSNorm, SwiGLU,
rotary positions, GQA) and GPT-style (LayerNorm, GELU, biases, learned positions).

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so local checkpoints load by name;
GPT-style models use the same names plus ``.bias`` where they have biases and
``model.embed_positions.weight`` for learned positions (no ``gate_proj``).
Modules read their head counts from their weights' shapes at run time, so the same code runs
unsharded, under DTensor tensor parallelism (local shards) and in the generation engine.
Critic, reward and cost models replace the language-model head with a scalar ``value_head``.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec, RopeScaling


def make_norm(spec: ModelSpec) -> nn.Module:
    """RMSNorm (weight) or LayerNorm (weight and bias), as the spec says."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
    return RMSNorm(spec.hidden, spec.norm_eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back before the weight, as Hugging
    Face's LlamaRMSNorm does (vLLM's kernel normalises in fp32 too): in bf16 the trainer's
    log-probs would drift from the generator's (issue 31 defect 2)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        variance = wide.pow(2).mean(-1, keepdim=True)
        return self.weight * (wide * torch.rsqrt(variance + self.eps)).to(x.dtype)


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                       device: torch.device) -> torch.Tensor:
    """Inverse wavelengths (radians per position) of the rotary pairs, with Llama-3.1's
    scaling when ``scaling`` says so: wavelengths beyond original / low_freq_factor are
    stretched by ``factor``, those below original / high_freq_factor kept, and the ones
    between blended linearly in original / wavelength (Meta's llama3 ``apply_scaling``)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                        device=device) / head_dim))
    if scaling is None:
        return inv
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv
    blend = ((original / wavelength - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - blend) * inv / scaling.factor + blend * inv
    long = wavelength > original / scaling.low_freq_factor
    short = wavelength < original / scaling.high_freq_factor
    return torch.where(long, inv / scaling.factor, torch.where(short, inv, blended))


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype, scaling: RopeScaling | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape positions.shape + (head_dim,) (Llama's rotate-half layout)."""
    inv = rotary_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, tokens, head_dim); cos/sin: (batch, tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded sequences: each sequence's first real token is at 0 (pads
    get 0 too; nothing reads them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, 1, tokens, tokens) attention mask for left-padded sequences: causal,
    no query attends to a pad; a pad attends to itself only (a row with no key at all would
    give NaN, and pad outputs are never read)."""
    tokens = attention_mask.shape[-1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool,
                        device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    diagonal = torch.eye(tokens, dtype=torch.bool, device=attention_mask.device)
    return (causal & keys) | diagonal


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, hd = spec.hidden, spec.head_dim_value
        self.head_dim = hd
        self.theta = spec.rope_theta
        self.rotary = not spec.learned_positions
        qkv_bias = spec.qkv_bias or spec.linear_bias
        self.q_proj = nn.Linear(h, spec.heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(spec.heads * hd, h, bias=spec.linear_bias)
        # Qwen3: every query and key head RMS-normalised before the rotary embedding.
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.norm_eps)
            self.k_norm = RMSNorm(hd, spec.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        heads, kv_heads = q.shape[-1] // hd, k.shape[-1] // hd  # local under tensor parallelism
        q = q.view(batch, tokens, heads, hd).transpose(1, 2)
        k = k.view(batch, tokens, kv_heads, hd).transpose(1, 2)
        v = v.view(batch, tokens, kv_heads, hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=heads != kv_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 enable_gqa=heads != kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, heads * hd))


class MLP(nn.Module):
    """SwiGLU (gate, up, down) or GELU (up, down; exact erf GELU, as Megatron's)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        bias = spec.linear_bias
        self.gated = spec.mlp == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=bias)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=bias)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = make_norm(spec)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = make_norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        if spec.learned_positions:
            self.embed_positions = nn.Embedding(spec.learned_positions, spec.hidden)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = make_norm(spec)


class CausalLM(nn.Module):
    """A decoder with an LM head (actor, reference) or a scalar value head (critic, reward)."""

    def __init__(self, spec: ModelSpec, *, value_head: bool = False):
        super().__init__()
        self.spec = spec
        self.is_value_model = value_head
        self.recompute_layers = False
        """Keep only each layer's input through the forward and recompute the layer in the
        backward (activation checkpointing: a plan's ``recompute: full``)."""
        self.model = Decoder(spec)
        if value_head:
            self.value_head = nn.Linear(spec.hidden, 1, bias=True)
        else:
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
            if spec.tied_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states. ``attention_mask`` (batch, tokens), 0 on left padding: padded
        tokens are attended by nobody and positions count real tokens only, so a left-padded
        sequence computes what it computes unpadded."""
        batch, tokens = input_ids.shape
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            positions = padded_positions(attention_mask)
            mask = padded_causal_mask(attention_mask)
        else:
            positions = torch.arange(tokens, device=input_ids.device).expand(batch, tokens)
        x = self.model.embed_tokens(input_ids)
        if self.spec.learned_positions:
            x = x + self.model.embed_positions(positions)
        cos, sin = rotary_tables(positions, self.spec.head_dim_value, self.spec.rope_theta,
                                 x.dtype, self.spec.rope_scaling)
        for layer in self.model.layers:
            if self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, tokens, vocab), or values (batch, tokens) for a value model."""
        x = self.hidden_states(input_ids, attention_mask)
        if self.is_value_model:
            return self.value_head(x).squeeze(-1)
        return self.lm_head(x)


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one tensor's initial values: any rank can make any tensor alone, in any
    order (a stable hash of the name; Python's ``hash`` changes between processes)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def initial_tensor(name: str, shape: tuple[int, ...], layers: int, seed: int) -> torch.Tensor:
    """Seeded initial value of one parameter (fp32, host): norms 1, biases 0, weights
    normal with std 0.02 (output projections scaled down by depth)."""
    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * layers)
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=generator) * std


def moe_shapes(spec: ModelSpec, dense: dict[str, tuple[int, ...]],
               ) -> dict[str, tuple[int, ...]]:
    """``dense`` (a dense model's tensor shapes by name) with the MLP of each MoE layer in
    Qwen3-MoE's names: the router ``mlp.gate`` (experts x hidden), the routed experts
    ``mlp.experts.{e}.{gate,up,down}_proj``, and the shared experts fused into one MLP as
    DeepSeek names it (``mlp.shared_experts.*``, ungated). The torch model has no MoE layer:
    these are the weights only the Megatron backend builds."""
    moe = spec.moe
    assert moe is not None
    gated = spec.mlp == "swiglu"

    def mlp(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
        out = {prefix + "gate_proj.weight": (width, spec.hidden)} if gated else {}
        out[prefix + "up_proj.weight"] = (width, spec.hidden)
        out[prefix + "down_proj.weight"] = (spec.hidden, width)
        return out

    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in dense.items():
        parts = name.split(".")
        if not (name.startswith("model.layers.") and parts[3] == "mlp"
                and int(parts[2]) >= moe.first_dense_layers):
            shapes[name] = shape
            continue
        prefix = f"model.layers.{parts[2]}.mlp."
        if prefix + "gate.weight" in shapes:
            continue  # this layer's MoE tensors are in already
        shapes[prefix + "gate.weight"] = (moe.experts, spec.hidden)
        for expert in range(moe.experts):
            shapes.update(mlp(f"{prefix}experts.{expert}.", moe.expert_ffn_hidden))
        if moe.shared_experts:
            shapes.update(mlp(prefix + "shared_experts.", moe.shared_experts * moe.shared_ffn))
    return shapes


class InitialWeights(Mapping[str, torch.Tensor]):
    """A model's starting weights by Hugging Face name, each made when asked: the tensor of
    a local checkpoint directory (``*.safetensors``, read one tensor at a time) where it has
    one, else the seeded initial value. Nothing ever holds the whole model, so a rank can
    take just its shards of each tensor. The checkpoint's names and shapes are checked when
    the mapping is made."""

    def __init__(self, spec: ModelSpec, *, value_head: bool = False, seed: int = 0,
                 checkpoint: str | Path | None = None):
        self.spec = spec
        self.seed = seed
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in
                      CausalLM(spec, value_head=value_head).state_dict().items()}
        if spec.moe is not None:
            shapes = moe_shapes(spec, shapes)
        self.shapes = shapes
        self.files: dict[str, Path] = {}
        self.stored: set[str] = set()
        """Names as the checkpoint stores them (a value head may be stored as ``score.*``,
        Hugging Face's token-classification head)."""
        if checkpoint is not None:
            self.files, self.stored = checkpoint_index(Path(checkpoint), shapes, spec)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if name == "lm_head.weight" and self.spec.tied_embeddings:
            name = "model.embed_tokens.weight"
        if name in self.files:
            from safetensors import safe_open

            stored = HF_VALUE_HEAD.get(name, name) if name not in self.stored else name
            with safe_open(str(self.files[name]), framework="pt") as handle:
                return handle.get_tensor(stored).float()
        return initial_tensor(name, self.shapes[name], self.spec.layers, self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


HF_VALUE_HEAD = {"value_head.weight": "score.weight", "value_head.bias": "score.bias"}
"""A value head as Hugging Face's ``LlamaForTokenClassification`` with one label stores it
(the form critics are exported in, and verl's critics use)."""


def checkpoint_index(directory: Path, shapes: dict[str, tuple[int, ...]],
                     spec: ModelSpec) -> tuple[dict[str, Path], set[str]]:
    """Which ``*.safetensors`` file of ``directory`` holds each of the model's tensors, and the
    names the files store; reading only the files' headers. SpecError naming a tensor the
    model needs and the checkpoint lacks, or one whose shape differs."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecError(f"no *.safetensors files in {directory}", key="checkpoint")
    where: dict[str, Path] = {}
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                where[name] = file
                found[name] = tuple(handle.get_slice(name).get_shape())
    stored = set(found)
    for ours, theirs in HF_VALUE_HEAD.items():
        if ours in shapes and ours not in found and theirs in found:
            where[ours], found[ours] = where[theirs], found[theirs]
    # A critic or reward model started from a language model keeps its fresh value head.
    missing = [k for k in shapes if k not in found and not k.startswith("value_head.")
               and not (k == "lm_head.weight" and spec.tied_embeddings)]
    if missing:
        raise SpecError(f"checkpoint {directory} lacks {missing[0]} (and {len(missing) - 1} "
                        "more)", key="checkpoint")
    for name, shape in shapes.items():
        if name in found and found[name] != shape:
            raise SpecError(f"checkpoint {directory}: {name} has shape {found[name]}, the "
                            f"model expects {shape}", key="checkpoint")
    return {name: where[name] for name in shapes if name in where}, stored


@torch.no_grad()
def materialise(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Fill a model whose parameters were allocated uninitialised (``to_empty``) with
    ``weights``: each rank copies only its shard of each tensor (DTensor parameters take
    their local piece of the whole tensor, which is made one at a time on the host)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        whole = weights[name]
        if isinstance(param, DTensor):
            piece = distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh,
                                      param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(piece)
        else:
            param.copy_(whole)
        del whole  # before the next one is made: one whole tensor at a time


def build_model(spec: ModelSpec, *, value_head: bool = False, seed: int = 0,
                checkpoint: str | Path | None = None) -> CausalLM:
    """A whole model (for one process: tests, references) with seeded random weights, or
    the weights of a local Hugging Face checkpoint directory (``config.json`` +
    ``*.safetensors``); nothing is downloaded."""
    weights = InitialWeights(spec, value_head=value_head, seed=seed, checkpoint=checkpoint)
    with torch.device("meta"):
        model = CausalLM(spec, value_head=value_head)
    model.to_empty(device="cpu")
    if spec.tied_embeddings and not value_head:
        model.lm_head.weight = model.model.embed_tokens.weight
    materialise(model, weights)
    return model


def hf_family(spec: ModelSpec) -> tuple[str, str]:
    """(``model_type``, architecture prefix) of the Hugging Face class that has exactly this
    spec's weights: Qwen3 (q/k norms, no biases), Qwen2 (biases on q, k and v only; Llama's
    ``attention_bias`` would add one to o_proj too) or Llama."""
    if spec.qk_norm:
        return "qwen3", "Qwen3"
    if spec.qkv_bias:
        return "qwen2", "Qwen2"
    return "llama", "Llama"


def hf_config(spec: ModelSpec, dtype: torch.dtype, *, value_head: bool = False) -> dict:
    """The Hugging Face ``config.json`` of a Llama-style ModelSpec (Llama, Qwen2 or Qwen3,
    ``hf_family``): a causal LM, or a value model as ``...ForTokenClassification`` with one
    label (a value per token)."""
    model_type, prefix = hf_family(spec)
    head = {"architectures": [f"{prefix}ForTokenClassification"], "num_labels": 1} \
        if value_head else {"architectures": [f"{prefix}ForCausalLM"]}
    extra: dict = {}
    if model_type == "llama":
        extra["attention_bias"] = False
        extra["mlp_bias"] = False
    if model_type == "qwen3":
        extra["attention_bias"] = False
    if spec.rope_scaling is not None:
        extra["rope_scaling"] = spec.rope_scaling.to_hf()
    return {
        **head, "model_type": model_type, **extra,
        "vocab_size": spec.vocab, "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim_value, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "max_position_embeddings": spec.max_seq_len,
        "tie_word_embeddings": spec.tied_embeddings, "hidden_act": "silu",
        "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16",
                        torch.float16: "float16"}[dtype],
    }


def llama_exportable(spec: ModelSpec) -> str | None:
    """Why ``spec`` cannot be written as a Hugging Face Llama checkpoint (None: it can)."""
    if spec.norm != "rmsnorm" or spec.mlp != "swiglu" or spec.learned_positions or \
            spec.linear_bias:
        return (f"{spec.name} is GPT-style (LayerNorm, GELU, biases or learned positions); "
                "only Llama-style models are written as Hugging Face checkpoints")
    return None


def write_hf_checkpoint(directory: str | Path, spec: ModelSpec,
                        state: dict[str, torch.Tensor], dtype: torch.dtype, *,
                        value_head: bool = False,
                        extra_files: Mapping[str, bytes] | None = None) -> Path:
    """A Hugging Face Llama checkpoint directory (``config.json`` + ``model.safetensors``,
    plus ``extra_files`` such as the tokenizer's) from whole tensors: written beside the
    target and renamed into place, so an earlier checkpoint there is replaced whole or not
    at all. A value model is written as ``LlamaForTokenClassification`` (its head as
    ``score``)."""
    import shutil

    from safetensors.torch import save_file

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    tensors = {HF_VALUE_HEAD.get(name, name): t.detach().to("cpu", dtype).contiguous()
               for name, t in state.items()
               if not (name == "lm_head.weight" and spec.tied_embeddings)}
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(
        hf_config(spec, dtype, value_head=value_head), indent=2))
    for name, content in (extra_files or {}).items():
        if Path(name).name != name or name in ("config.json", "model.safetensors"):
            raise ValueError(f"{name!r} is not a plain file name of its own")
        (partial / name).write_bytes(content)
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        partial.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(target)
    return target
