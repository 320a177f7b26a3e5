"""Megatron-core training backend: a Megatron ``GPTModel`` built from a ModelSpec, laid out
as the plan says (tensor, pipeline and data parallelism through ``parallel_state``, sequence
parallelism, the 1F1B / interleaved schedules), trained with Megatron's optimizer (the
distributed optimizer when the plan shards optimizer states) on log-probs and values computed
by the same algorithm code as the torch backend.

Weights cross the boundary in Hugging Face naming: ``import_hf`` cuts this rank's Megatron
shards out of whole HF tensors (q/k/v fused per query group into ``linear_qkv``, gate and up
fused per tensor-parallel shard into ``linear_fc1``), ``export_hf`` gathers them back, so a HF
checkpoint starts a Megatron model and a Megatron-trained actor feeds any generator.

Megatron-core (0.16.1) places some tensors on ``torch.cuda.current_device()``; on a machine
without GPUs only the tests run it, through ``tests/compat/megatron_cpu.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from simulator.specs.model import ModelSpec
from simulator.specs.parallel import ParallelConfig


def transformer_config(spec: ModelSpec, par: ParallelConfig, *,
                       dtype: torch.dtype = torch.float32) -> Any:
    """Megatron's TransformerConfig of a Llama-architecture ModelSpec under ``par``."""
    import torch.nn.functional as F  # noqa: N812
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, ffn_hidden_size=spec.ffn_hidden,
        num_attention_heads=spec.heads, num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim_value, normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        sequence_parallel=par.sequence_parallel and par.tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, deallocate_pipeline_outputs=False)


class ValueHead(torch.nn.Module):
    """Scalar head of critic / reward / cost models, whole on every tensor-parallel rank, in
    place of GPTModel's vocabulary-parallel output layer (same call signature)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1, bias=True)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        return self.linear(hidden_states), None


def layer_range(spec: ModelSpec, par: ParallelConfig, pp_rank: int,
                vp_stage: int | None = None) -> range:
    """Global indices of the transformer layers a pipeline rank holds (for one virtual
    stage when interleaved: chunk ``vp_stage * pp + pp_rank`` of ``pp * vpp`` chunks)."""
    chunks = par.pp * par.vpp
    per_chunk = spec.layers // chunks
    chunk = (vp_stage or 0) * par.pp + pp_rank
    return range(chunk * per_chunk, (chunk + 1) * per_chunk)


def build_gpt(spec: ModelSpec, par: ParallelConfig, *, value_head: bool, pp_rank: int,
              vp_stage: int | None = None, dtype: torch.dtype = torch.float32) -> Any:
    """One (virtual) pipeline stage of the model on this rank."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec, par, dtype=dtype)
    chunks = par.pp * par.vpp
    chunk = (vp_stage or 0) * par.pp + pp_rank
    model = GPTModel(
        config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec.vocab, max_sequence_length=spec.max_seq_len,
        pre_process=chunk == 0, post_process=chunk == chunks - 1,
        share_embeddings_and_output_weights=spec.tied_embeddings and not value_head,
        position_embedding_type="rope", rotary_base=int(spec.rope_theta),
        vp_stage=vp_stage)
    if value_head and model.post_process:
        model.output_layer = ValueHead(spec.hidden)
    return model


# ----- Hugging Face <-> Megatron weights ------------------------------------------------------


def _qkv_rows(spec: ModelSpec) -> tuple[int, int]:
    """(query heads per group, head size)."""
    return spec.heads // spec.kv_heads, spec.head_dim_value


def fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's ``linear_qkv`` rows: for each of its query groups, the group's query heads,
    then its key head, then its value head (Megatron's layout)."""
    per_group, hd = _qkv_rows(spec)
    groups = spec.kv_heads // tp
    parts = []
    for g in range(tp_rank * groups, (tp_rank + 1) * groups):
        parts.append(q[g * per_group * hd:(g + 1) * per_group * hd])
        parts.append(k[g * hd:(g + 1) * hd])
        parts.append(v[g * hd:(g + 1) * hd])
    return torch.cat(parts, dim=0)


def split_qkv(spec: ModelSpec, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Whole q, k, v from a whole (all ranks' shards concatenated) ``linear_qkv``."""
    per_group, hd = _qkv_rows(spec)
    block = (per_group + 2) * hd
    q, k, v = [], [], []
    for g in range(spec.kv_heads):
        rows = fused[g * block:(g + 1) * block]
        q.append(rows[:per_group * hd])
        k.append(rows[per_group * hd:(per_group + 1) * hd])
        v.append(rows[(per_group + 1) * hd:])
    return torch.cat(q), torch.cat(k), torch.cat(v)


def import_hf(model: Any, hf: dict[str, torch.Tensor], spec: ModelSpec, par: ParallelConfig,
              *, tp_rank: int, pp_rank: int, vp_stage: int | None = None) -> None:
    """Copy this rank's shards of whole Hugging Face tensors into a Megatron stage."""
    tp = par.tp
    layers = layer_range(spec, par, pp_rank, vp_stage)

    def column(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[tp_rank]

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[tp_rank]

    values: dict[str, torch.Tensor] = {}
    if model.pre_process:
        values["embedding.word_embeddings.weight"] = column(hf["model.embed_tokens.weight"])
    for local, index in enumerate(layers):
        p, m = f"model.layers.{index}.", f"decoder.layers.{local}."
        values[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        values[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            spec, hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
            hf[p + "self_attn.v_proj.weight"], tp, tp_rank)
        if spec.qkv_bias:
            values[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                spec, hf[p + "self_attn.q_proj.bias"][:, None],
                hf[p + "self_attn.k_proj.bias"][:, None],
                hf[p + "self_attn.v_proj.bias"][:, None], tp, tp_rank)[:, 0]
        values[m + "self_attention.linear_proj.weight"] = row(hf[p + "self_attn.o_proj.weight"])
        values[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        values[m + "mlp.linear_fc1.weight"] = torch.cat(
            [column(hf[p + "mlp.gate_proj.weight"]), column(hf[p + "mlp.up_proj.weight"])])
        values[m + "mlp.linear_fc2.weight"] = row(hf[p + "mlp.down_proj.weight"])
    if model.post_process:
        values["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if isinstance(model.output_layer, ValueHead):
            values["output_layer.linear.weight"] = hf["value_head.weight"]
            values["output_layer.linear.bias"] = hf["value_head.bias"]
        elif not spec.tied_embeddings:
            values["output_layer.weight"] = column(hf["lm_head.weight"])
        elif not model.pre_process:
            # A tied head on the last stage keeps its own copy of the embedding.
            values["output_layer.weight"] = column(hf["model.embed_tokens.weight"])
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(values))
    if missing:
        raise KeyError(f"no Hugging Face weights for {missing}")
    with torch.no_grad():
        for name, tensor in values.items():
            params[name].copy_(tensor.to(params[name].dtype))


def export_local(model: Any, spec: ModelSpec, par: ParallelConfig, *, pp_rank: int,
                 vp_stage: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's Megatron shards under Hugging Face names of the layers it holds, with the
    tensor-parallel dimension each was cut along (for ``gather_hf``)."""
    layers = layer_range(spec, par, pp_rank, vp_stage)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t = param.detach()
        if name.startswith("decoder.layers."):
            local, rest = name.removeprefix("decoder.layers.").split(".", 1)
            out[f"layer.{layers[int(local)]}.{rest}"] = t
        else:
            out[name] = t
    return out


def gather_hf(shards_by_rank: list[dict[str, torch.Tensor]], spec: ModelSpec,
              par: ParallelConfig) -> dict[str, torch.Tensor]:
    """Whole Hugging Face tensors from every (tp rank, pp stage) shard dict; ranks listed in
    Megatron order (tp fastest), one data-parallel replica."""
    tp = par.tp
    merged: dict[str, list[torch.Tensor]] = {}
    for shards in shards_by_rank:
        for name, tensor in shards.items():
            merged.setdefault(name, []).append(tensor)
    hf: dict[str, torch.Tensor] = {}
    for name, parts in merged.items():
        parts = parts[:tp] if len(parts) > tp else parts  # tied copies on several stages
        if name == "embedding.word_embeddings.weight":
            hf["model.embed_tokens.weight"] = torch.cat(parts)
        elif name == "decoder.final_layernorm.weight":
            hf["model.norm.weight"] = parts[0]
        elif name == "output_layer.weight":
            if not spec.tied_embeddings:
                hf["lm_head.weight"] = torch.cat(parts)
        elif name == "output_layer.linear.weight":
            hf["value_head.weight"] = parts[0]
        elif name == "output_layer.linear.bias":
            hf["value_head.bias"] = parts[0]
        elif name.startswith("layer."):
            _, index, rest = name.split(".", 2)
            p = f"model.layers.{index}."
            if rest == "input_layernorm.weight":
                hf[p + "input_layernorm.weight"] = parts[0]
            elif rest == "pre_mlp_layernorm.weight":
                hf[p + "post_attention_layernorm.weight"] = parts[0]
            elif rest == "self_attention.linear_qkv.weight":
                q, k, v = split_qkv(spec, torch.cat(parts))
                hf[p + "self_attn.q_proj.weight"] = q
                hf[p + "self_attn.k_proj.weight"] = k
                hf[p + "self_attn.v_proj.weight"] = v
            elif rest == "self_attention.linear_qkv.bias":
                q, k, v = split_qkv(spec, torch.cat(parts)[:, None])
                hf[p + "self_attn.q_proj.bias"] = q[:, 0]
                hf[p + "self_attn.k_proj.bias"] = k[:, 0]
                hf[p + "self_attn.v_proj.bias"] = v[:, 0]
            elif rest == "self_attention.linear_proj.weight":
                hf[p + "self_attn.o_proj.weight"] = torch.cat(parts, dim=1)
            elif rest == "mlp.linear_fc1.weight":
                gates, ups = zip(*(part.chunk(2) for part in parts), strict=True)
                hf[p + "mlp.gate_proj.weight"] = torch.cat(gates)
                hf[p + "mlp.up_proj.weight"] = torch.cat(ups)
            elif rest == "mlp.linear_fc2.weight":
                hf[p + "mlp.down_proj.weight"] = torch.cat(parts, dim=1)
    return hf
