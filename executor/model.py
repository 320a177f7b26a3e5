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
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec


def make_norm(spec: ModelSpec) -> nn.Module:
    """RMSNorm (weight) or LayerNorm (weight and bias), as the spec says."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
    return RMSNorm(spec.hidden, spec.norm_eps)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape positions.shape + (head_dim,) (Llama's rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                        device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, tokens, head_dim); cos/sin: (batch, tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        heads, kv_heads = q.shape[-1] // hd, k.shape[-1] // hd  # local under tensor parallelism
        q = q.view(batch, tokens, heads, hd).transpose(1, 2)
        k = k.view(batch, tokens, kv_heads, hd).transpose(1, 2)
        v = v.view(batch, tokens, kv_heads, hd).transpose(1, 2)
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
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
        self.model = Decoder(spec)
        if value_head:
            self.value_head = nn.Linear(spec.hidden, 1, bias=True)
        else:
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
            if spec.tied_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, tokens = input_ids.shape
        positions = torch.arange(tokens, device=input_ids.device).expand(batch, tokens)
        x = self.model.embed_tokens(input_ids)
        if self.spec.learned_positions:
            x = x + self.model.embed_positions(positions)
        cos, sin = rotary_tables(positions, self.spec.head_dim_value, self.spec.rope_theta,
                                 x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, tokens, vocab), or values (batch, tokens) for a value model."""
        x = self.hidden_states(input_ids)
        if self.is_value_model:
            return self.value_head(x).squeeze(-1)
        return self.lm_head(x)


def init_weights(model: CausalLM, seed: int) -> None:
    """Seeded initialisation (normal, std 0.02; output projections scaled by depth), the
    same on every rank so that every layout starts from the same model."""
    generator = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * model.spec.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight"))
                              else 1.0)
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_model(spec: ModelSpec, *, value_head: bool = False, seed: int = 0,
                checkpoint: str | Path | None = None) -> CausalLM:
    """A model with seeded random weights, or the weights of a local Hugging Face checkpoint
    directory (``config.json`` + ``*.safetensors``); nothing is downloaded."""
    model = CausalLM(spec, value_head=value_head)
    init_weights(model, seed)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model


def load_checkpoint(model: CausalLM, directory: str | Path) -> None:
    """Load ``*.safetensors`` weights by Hugging Face parameter names (strict on shapes)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecError(f"no *.safetensors files in {directory}", key="checkpoint")
    state: dict[str, torch.Tensor] = {}
    index = directory / "model.safetensors.index.json"
    if index.exists():
        json.loads(index.read_text())  # validates the index; shards are globbed below
    for file in files:
        state.update(load_file(str(file)))
    own = model.state_dict()
    # A critic or reward model started from a language model keeps its fresh value head.
    missing = [k for k in own if k not in state and not k.startswith("value_head.")
               and not (k == "lm_head.weight" and model.spec.tied_embeddings)]
    if missing:
        raise SpecError(f"checkpoint {directory} lacks {missing[0]} (and {len(missing) - 1} "
                        "more)", key="checkpoint")
    for name, tensor in own.items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise SpecError(f"checkpoint {directory}: {name} has shape "
                            f"{tuple(state[name].shape)}, the model expects "
                            f"{tuple(tensor.shape)}", key="checkpoint")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
