"""Native generation backend: a batched sampler with a KV cache over local weight shards.

SPMD code: every rank of a generation tensor-parallel group runs the same loop on its shards
(column-parallel q/k/v/gate/up and vocabulary-parallel embedding and LM head, row-parallel
o/down with an all-reduce) and samples the same tokens, because the logits are all-gathered and
every rank draws from an identically seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from executor.model import apply_rotary, rotary_tables
from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
          "v_proj.bias", "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias",
          "lm_head.weight", "embed_tokens.weight")
ROW = ("o_proj.weight", "down_proj.weight")

FINISH_CHECK_INTERVAL_STEPS = 16
"""Decode steps between checks whether every sequence has ended, on accelerators: the check
reads a flag back to the host, which waits for the device's queued work; checking every 16th
step keeps the GPU fed at the cost of at most 15 decode steps of pad tokens. On the CPU the read
costs nothing and those steps would, so the engine checks every step there."""


def tp_shard_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a parameter along (None: replicated)."""
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def native_unsupported_reason(spec: ModelSpec) -> str | None:
    """Why the native generator cannot generate with ``spec`` (None: it can)."""
    if getattr(spec, "moe", None) is not None:
        return (f"{spec.name} is a mixture of experts: the native generator computes dense "
                "MLPs only (it has no router or experts), so it would not generate with the "
                "model's weights")
    return None


def kv_cache_bytes(*, layers: int, sequences: int, kv_heads: int, tokens: int, head_dim: int,
                   element_bytes: int) -> int:
    """Bytes of the K and V caches of ``sequences`` sequences of ``tokens`` tokens each
    (``kv_heads``: the heads this rank holds)."""
    return layers * 2 * sequences * kv_heads * tokens * head_dim * element_bytes


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    eos_token_id: int
    pad_token_id: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    responses: torch.Tensor
    """(batch, max_new_tokens) token ids, padded after EOS."""
    log_probs: torch.Tensor
    """(batch, max_new_tokens) log-probability of each sampled token (0 after EOS)."""
    lengths: torch.Tensor
    """(batch,) response lengths including the EOS token."""


class GenerationEngine:
    """Generates with local shards of a model built by ``executor.model`` (Llama- or
    GPT-style).

    ``kv_cache_budget_bytes`` bounds this rank's KV cache (its shard of the heads): a batch
    whose cache would exceed it is generated in consecutive waves of as many sequences as fit
    (None: the whole batch at once). ``finish_check_interval_steps``: decode steps between
    checks whether every sequence has ended (None: ``FINISH_CHECK_INTERVAL_STEPS`` on
    accelerators, 1 on the CPU); it changes no output."""

    def __init__(self, spec: ModelSpec, tp_group: dist.ProcessGroup | None = None,
                 tp_size: int = 1, tp_rank: int = 0, *, kv_cache_budget_bytes: int | None = None,
                 finish_check_interval_steps: int | None = None):
        reason = native_unsupported_reason(spec)
        if reason:
            raise SpecError(reason, key="backends.actor.generation")
        if kv_cache_budget_bytes is not None and kv_cache_budget_bytes < 0:
            raise ValueError(f"kv_cache_budget_bytes={kv_cache_budget_bytes} is negative")
        if finish_check_interval_steps is not None and finish_check_interval_steps < 1:
            raise ValueError(f"finish_check_interval_steps={finish_check_interval_steps} must "
                             "be at least 1")
        self.spec = spec
        self.group = tp_group
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.kv_cache_budget_bytes = kv_cache_budget_bytes
        self.finish_check_interval_steps = finish_check_interval_steps
        self.weights: dict[str, torch.Tensor] = {}

    # ----- weights -----

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Take local shards (names as in ``CausalLM``); nothing is copied."""
        self.weights = weights

    def unload(self) -> None:
        self.weights = {}

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values())

    # ----- collectives -----

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ----- model -----

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.weights["model.embed_tokens.weight"]
        rows = table.shape[0]
        start = self.tp_rank * rows
        local = tokens - start
        inside = (local >= 0) & (local < rows)
        x = F.embedding(local.clamp(0, rows - 1), table) * inside[..., None]
        return self._all_reduce(x)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm, or LayerNorm when the norm has a bias (``name`` without ``.weight``)."""
        weight = self.weights[name + ".weight"]
        bias = self.weights.get(name + ".bias")
        eps = self.spec.norm_eps
        if self.spec.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def _head_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm over each head's width (the last dimension)."""
        return self.weights[name] * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps))

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.weights.get(name.replace(".weight", ".bias"))
        return F.linear(x, self.weights[name], bias)

    def _row_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A row-parallel layer: partial sums all-reduced, then the (whole) bias once."""
        out = self._all_reduce(F.linear(x, self.weights[name]))
        bias = self.weights.get(name.replace(".weight", ".bias"))
        return out if bias is None else out + bias

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 cache: list[list[torch.Tensor]], filled: int,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last position for ``tokens`` (batch, new) appended at ``filled``.
        ``attn_mask`` (batch, 1, new, filled + new), True where a query may attend: left
        padding of the prompts is hidden; None: plain causal attention."""
        spec = self.spec
        hd = spec.head_dim_value
        batch, new = tokens.shape
        x = self._embed(tokens)
        if spec.learned_positions:
            x = x + F.embedding(positions, self.weights["model.embed_positions.weight"])
        cos, sin = rotary_tables(positions, hd, spec.rope_theta, x.dtype, spec.rope_scaling)
        for i in range(spec.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm")
            q = self._linear(h, p + "self_attn.q_proj.weight")
            k = self._linear(h, p + "self_attn.k_proj.weight")
            v = self._linear(h, p + "self_attn.v_proj.weight")
            heads, kv_heads = q.shape[-1] // hd, k.shape[-1] // hd
            q = q.view(batch, new, heads, hd).transpose(1, 2)
            k = k.view(batch, new, kv_heads, hd).transpose(1, 2)
            if spec.qk_norm:  # Qwen3: each head RMS-normalised before the rotary embedding
                q = self._head_norm(q, p + "self_attn.q_norm.weight")
                k = self._head_norm(k, p + "self_attn.k_norm.weight")
            if not spec.learned_positions:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = v.view(batch, new, kv_heads, hd).transpose(1, 2)
            cache[i][0][:, :, filled:filled + new] = k
            cache[i][1][:, :, filled:filled + new] = v
            keys = cache[i][0][:, :, :filled + new]
            values = cache[i][1][:, :, :filled + new]
            if attn_mask is None:
                out = F.scaled_dot_product_attention(q, keys, values, is_causal=filled == 0,
                                                     enable_gqa=heads != kv_heads)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                                     enable_gqa=heads != kv_heads)
            x = x + self._row_linear(out.transpose(1, 2).reshape(batch, new, heads * hd),
                                     p + "self_attn.o_proj.weight")
            h = self._norm(x, p + "post_attention_layernorm")
            if spec.mlp == "swiglu":
                mlp = F.silu(self._linear(h, p + "mlp.gate_proj.weight")) * \
                    self._linear(h, p + "mlp.up_proj.weight")
            else:
                mlp = F.gelu(self._linear(h, p + "mlp.up_proj.weight"))
            x = x + self._row_linear(mlp, p + "mlp.down_proj.weight")
        x = self._norm(x[:, -1], "model.norm")
        head = self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])
        return self._all_gather_last(F.linear(x, head))

    # ----- sampling -----

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def _kv_local_heads(self) -> int:
        """Key/value heads of this rank's shard."""
        return self.weights["model.layers.0.self_attn.k_proj.weight"].shape[0] // \
            self.spec.head_dim_value

    def sequence_kv_cache_bytes(self, tokens: int) -> int:
        """Bytes of this rank's KV cache for one sequence of ``tokens`` tokens."""
        return kv_cache_bytes(layers=self.spec.layers, sequences=1,
                              kv_heads=self._kv_local_heads(), tokens=tokens,
                              head_dim=self.spec.head_dim_value,
                              element_bytes=self.weights["model.norm.weight"].element_size())

    def wave_size(self, batch: int, tokens: int) -> int:
        """Sequences of ``tokens`` tokens generated at once under the KV-cache budget."""
        if self.kv_cache_budget_bytes is None:
            return batch
        one = self.sequence_kv_cache_bytes(tokens)
        if one > self.kv_cache_budget_bytes:
            raise ValueError(
                f"kv_cache_budget_bytes={self.kv_cache_budget_bytes} cannot hold the KV cache "
                f"of one sequence: {one} bytes ({tokens} tokens x {self.spec.layers} layers x "
                f"K and V x {self._kv_local_heads()} local kv heads x "
                f"{self.spec.head_dim_value} head dim x "
                f"{self.weights['model.norm.weight'].element_size()} bytes)")
        return min(batch, self.kv_cache_budget_bytes // one)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator,
                 prompt_mask: torch.Tensor | None = None) -> GenerationOutput:
        """Sample up to ``max_new_tokens`` per prompt. Prompts (batch, length) are left-padded
        to one length; ``prompt_mask`` is 0 on the padding (None: no padding), which then
        takes no part: a padded prompt generates what it generates alone.
        ``generator`` lives on the weights' device (sampling draws there).

        Under a KV-cache budget too small for the batch, consecutive waves of prompts run one
        after another. Greedy tokens and lengths are those of one wave (barring near-ties) and
        log-probs equal up to rounding: matrix kernels may sum in another order for another
        batch size. Sampled tokens cannot be one wave's: every decode step draws for the whole
        running batch from one generator, so a sequence's draws depend on which sequences share
        its wave. Instead ``generator`` draws one seed per wave and wave ``w`` is exactly one
        wave of its prompts with ``Generator(device).manual_seed(seed_w)``: reproducible for a
        given generator state and budget.

        Without waves the caller's generator advances further than before when the finish check
        is periodic (draws in the steps after every sequence ended); no output depends on
        those draws."""
        if not self.weights:
            raise RuntimeError("the generation engine has no weights loaded")
        batch, prompt_len = prompts.shape
        wave = self.wave_size(batch, prompt_len + params.max_new_tokens)
        if prompt_mask is not None and bool(prompt_mask.all()):
            prompt_mask = None
        if wave >= batch:
            return self._generate_wave(prompts, params, generator, prompt_mask)
        waves = -(-batch // wave)
        seeds = torch.randint(0, 2**62, (waves,), generator=generator,
                              device=generator.device).tolist()
        outputs = []
        for index, seed in enumerate(seeds):
            wave_generator = torch.Generator(device=generator.device).manual_seed(seed)
            rows = slice(index * wave, (index + 1) * wave)
            outputs.append(self._generate_wave(
                prompts[rows], params, wave_generator,
                None if prompt_mask is None else prompt_mask[rows]))
        return GenerationOutput(
            responses=torch.cat([o.responses for o in outputs]),
            log_probs=torch.cat([o.log_probs for o in outputs]),
            lengths=torch.cat([o.lengths for o in outputs]))

    def _generate_wave(self, prompts: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator,
                       prompt_mask: torch.Tensor | None = None) -> GenerationOutput:
        """Generate for all ``prompts`` at once, with a KV cache for the whole batch."""
        spec = self.spec
        batch, prompt_len = prompts.shape
        total = prompt_len + params.max_new_tokens
        dtype = self.weights["model.norm.weight"].dtype
        device = self.weights["model.norm.weight"].device
        prompts = prompts.to(device)
        kv_local = self._kv_local_heads()
        cache = [[torch.zeros(batch, kv_local, total, spec.head_dim_value, dtype=dtype,
                              device=device)
                  for _ in range(2)] for _ in range(spec.layers)]
        responses = torch.full((batch, params.max_new_tokens), params.pad_token_id,
                               dtype=torch.long, device=device)
        log_probs = torch.zeros(batch, params.max_new_tokens, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
        interval = self.finish_check_interval_steps or \
            (1 if device.type == "cpu" else FINISH_CHECK_INTERVAL_STEPS)
        keys = None  # (batch, total) True on every cache slot but the prompts' padding
        if prompt_mask is None:
            positions = torch.arange(prompt_len, device=device).expand(batch, prompt_len)
            real = torch.full((batch,), prompt_len, device=device)
            logits = self._forward(prompts, positions, cache, 0)
        else:
            from executor.model import padded_causal_mask, padded_positions

            prompt_mask = prompt_mask.to(device)
            keys = torch.cat([prompt_mask.bool(), torch.ones(
                batch, params.max_new_tokens, dtype=torch.bool, device=device)], dim=1)
            real = prompt_mask.long().sum(-1)
            logits = self._forward(prompts, padded_positions(prompt_mask), cache, 0,
                                   padded_causal_mask(prompt_mask))
        for step in range(params.max_new_tokens):
            # Steps after every sequence ended (until the next check) change no output: their
            # tokens become pad, their log-probs 0, and no length or ``finished`` changes.
            token = self._sample(logits.float(), params, generator)
            token = torch.where(finished, torch.full_like(token, params.pad_token_id), token)
            step_log_probs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
            chosen = step_log_probs.gather(-1, token[:, None]).squeeze(-1)
            log_probs[:, step] = torch.where(finished, torch.zeros_like(chosen), chosen)
            responses[:, step] = token
            ended = (~finished) & (token == params.eos_token_id)
            lengths = torch.where(ended, torch.full_like(lengths, step + 1), lengths)
            finished = finished | ended
            if step + 1 == params.max_new_tokens:
                break
            # The check reads ``finished`` on the host (a device sync on GPUs): periodic only.
            if (step + 1) % interval == 0 and bool(finished.all()):
                break
            position = (real + step)[:, None]
            filled = prompt_len + step
            step_mask = None if keys is None else keys[:, None, None, :filled + 1]
            logits = self._forward(token[:, None], position, cache, filled, step_mask)
        return GenerationOutput(responses=responses, log_probs=log_probs, lengths=lengths)


def shard_for_generation(full: dict[str, torch.Tensor], tp_size: int,
                         tp_rank: int) -> dict[str, torch.Tensor]:
    """Generation shards of full (unsharded) weights, for tests and single-process use."""
    out = {}
    for name, tensor in full.items():
        dim = tp_shard_dim(name)
        out[name] = tensor if dim is None or tp_size == 1 else \
            tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()
    return out
