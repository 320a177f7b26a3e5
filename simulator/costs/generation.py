"""Generation: prefill (compute-bound) then decode (memory-bound per step) with continuous
batching over the response-length distribution, limited by the KV cache left in memory.

One generation replica (t_g x p_g GPUs) is modelled; replicas run in parallel on their shares
of the batch, so the replica holding the longest responses decides the stage's time.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from functools import lru_cache

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.memory import GIB, MemoryBreakdown
from simulator.costs.primitives import all_reduce_seconds, group_crosses_nodes
from simulator.costs.transformer import head_forward_seconds, layer_cost
from simulator.specs.lengths import LengthDistribution
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig

PREFILL_CHUNK_TOKENS = 8192
"""Tokens per prefill batch (verl's rollout default max_num_batched_tokens: 8192)."""
KERNELS_PER_LAYER_DECODE = 10
"""Kernels one decode step launches per layer (4 GEMMs, attention, 2 norms, activation,
rotary, residual); sets the launch-bound floor of a step for small models."""


@dataclass(frozen=True, slots=True)
class GenerationCost:
    """One replica generating its share of the batch."""

    seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    """Decode iterations (= the longest response when everything fits at once)."""
    max_running: int
    """Sequences decoded concurrently (continuous-batching cap)."""
    kv_capacity_tokens: float
    """Tokens the KV cache of one replica can hold."""
    memory: MemoryBreakdown
    """Per-GPU generation weights, peak KV cache and workspace."""
    generated_tokens: int
    feasible: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class DecodeStepModel:
    """Seconds of one decode step of one replica as a function of batch and KV tokens."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    matmul_flops_per_token_per_gpu: float
    attention_flops_per_kv_token_per_gpu: float
    layers_per_stage: float
    pp: int
    tp: int
    hidden_bytes: float
    tp_crosses_nodes: bool

    def step_seconds(self, profile: DeviceProfile, dtype: str, batch: float,
                     kv_tokens: float, cuda_graphs: bool = False,
                     host_seconds_per_sequence: float = 0.0) -> float:
        bytes_read = self.weight_bytes_per_gpu + kv_tokens * self.kv_bytes_per_token_per_gpu
        memory = bytes_read / (profile.memory_bandwidth_bytes_per_s
                               * profile.efficiency.memory.at(bytes_read))
        peak = profile.peak_flops(dtype)
        gemm_size = batch * self.matmul_flops_per_token_per_gpu / max(
            1.0, 4 * self.layers_per_stage)
        compute = (batch * self.matmul_flops_per_token_per_gpu
                   / (peak * profile.efficiency.matmul.at(gemm_size))
                   + kv_tokens * self.attention_flops_per_kv_token_per_gpu / peak)
        comm = 2 * self.layers_per_stage * all_reduce_seconds(
            profile, batch * self.hidden_bytes, self.tp, self.tp_crosses_nodes)
        # Decode kernels are microseconds long, so in eager mode each kernel's fixed launch
        # cost adds up instead of hiding behind the previous kernel as it does in training
        # (vLLM PR #1440: Llama-2-7B at batch 1 decodes in ~12 ms per step eager, ~10.5 ms
        # with CUDA graphs). A captured graph replays the step's kernels from one launch.
        launches = profile.overheads.kernel_launch_seconds if (
            cuda_graphs and profile.kind == "gpu") else (
            self.layers_per_stage * KERNELS_PER_LAYER_DECODE
            * profile.overheads.kernel_launch_seconds)
        # The fitted decode correction scales the device work only (not collectives, which
        # carry their own correction, nor the fixed per-kernel cost).
        stage = max(memory, compute) * profile.correction("decode") + comm + launches
        # An engine that does not schedule asynchronously prepares the next step on the host
        # (scheduling, input tensors, sampled-token output) while the GPU waits: host work per
        # running sequence, serialised with the step.
        host = batch * host_seconds_per_sequence
        # Without micro-batching across stages, a token passes every pipeline stage in turn.
        return self.pp * stage + host + profile.overheads.decode_step_seconds


@lru_cache(maxsize=4096)
def decode_step_model(model: ModelSpec, gen: GenerationConfig, dtype: str,
                      gpus_per_node: int) -> DecodeStepModel:
    b = DTYPE_BYTES[dtype]
    tp, pp = gen.tp, gen.pp
    layers = model.layers / pp
    head = model.hidden * model.vocab / tp
    weights = (layers * model.linear_params_per_layer() / tp + head) * b
    kv_heads_local = math.ceil(model.kv_heads / tp)  # KV heads are replicated when tp > kv
    kv_per_token = 2 * layers * kv_heads_local * model.head_dim_value * b
    matmul = 2 * (layers * model.linear_params_per_layer() / tp + head)
    attention = 4 * layers * model.q_size / tp
    return DecodeStepModel(
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_per_token,
        matmul_flops_per_token_per_gpu=matmul,
        attention_flops_per_kv_token_per_gpu=attention,
        layers_per_stage=layers,
        pp=pp,
        tp=tp,
        hidden_bytes=model.hidden * b,
        tp_crosses_nodes=group_crosses_nodes(tp, 1, gpus_per_node),
    )


def generation_weight_bytes(model: ModelSpec, gen: GenerationConfig, dtype: str) -> float:
    """Per-GPU weights of the generation layout, M / (t_g * p_g)."""
    return model.params() * DTYPE_BYTES[dtype] / (gen.tp * gen.pp)


def workspace_bytes(model: ModelSpec, gen: GenerationConfig, dtype: str) -> float:
    """Per-GPU activation workspace of the engine: one prefill chunk's hidden states and MLP
    intermediates, plus fp32 logits for a full running batch."""
    b = DTYPE_BYTES[dtype]
    return (PREFILL_CHUNK_TOKENS * (4 * model.hidden + 3 * model.ffn_hidden / gen.tp) * b
            + gen.max_num_seqs * model.vocab / gen.tp * 4)


@lru_cache(maxsize=16384)
def prefill_seconds(model: ModelSpec, profile: DeviceProfile, gen: GenerationConfig, *,
                    sequences: int, prompt_len: int, dtype: str, gpus_per_node: int) -> float:
    """Prefill ``sequences`` prompts in chunks of PREFILL_CHUNK_TOKENS tokens."""
    if sequences <= 0:
        return 0.0
    per_chunk = max(1, PREFILL_CHUNK_TOKENS // prompt_len)
    chunks = math.ceil(sequences / per_chunk)
    batch = min(per_chunk, sequences)
    layer = layer_cost(model, profile, micro_batch=batch, seq_len=prompt_len, tp=gen.tp,
                       sequence_parallel=False, dtype=dtype, attention="flash",
                       recompute="none",
                       tp_crosses_nodes=group_crosses_nodes(gen.tp, 1, gpus_per_node))
    # The fitted prefill correction scales kernels only, not the TP collectives.
    compute_scale = profile.correction("prefill_compute")
    stage = model.layers / gen.pp * (layer.forward_seconds * compute_scale
                                     + layer.tp_forward_seconds)
    # Only the last position of each prompt needs logits.
    head = head_forward_seconds(model, profile, tokens=batch, tp=gen.tp, dtype=dtype,
                                value_head=False, loss=False) * compute_scale
    per_chunk_seconds = stage + head
    return (chunks + gen.pp - 1) * per_chunk_seconds


@lru_cache(maxsize=4096)
def replica_lengths(dist: LengthDistribution, total_sequences: int,
                    replicas: int) -> tuple[int, ...]:
    """Response lengths of the replica that holds the longest response, in arrival order.

    The batch's lengths are the distribution's stratified quantiles; replicas take every
    ``replicas``-th of them, so each sees the whole distribution. The order is a fixed
    pseudo-random shuffle (seed 0), so predictions are deterministic.
    """
    lengths = dist.sample(total_sequences)
    mine = list(lengths[::-1][::replicas])  # starts with the maximum
    random.Random(0).shuffle(mine)
    return tuple(mine)


def running_cap(gen: GenerationConfig, *, sequences: int, kv_capacity_tokens: float,
                prompt_len: int, mean_response: float) -> int:
    """Sequences decoded at once: the engine's max_num_seqs, the batch, and the KV cache.

    A running sequence holds its prompt plus what it has generated so far; reserving the
    prompt plus a mean response per slot keeps preemption rare.
    """
    cap = min(gen.max_num_seqs, sequences)
    if math.isfinite(kv_capacity_tokens):
        cap = min(cap, int(kv_capacity_tokens // (prompt_len + mean_response)))
    return max(1, cap)


@lru_cache(maxsize=65536)
def decode(model: ModelSpec, profile: DeviceProfile, gen: GenerationConfig, *,
           lengths: tuple[int, ...], prompt_len: int, cap: int, dtype: str = "bf16",
           gpus_per_node: int = 8, cuda_graphs: bool = False,
           host_seconds_per_sequence: float = 0.0) -> tuple[float, int, float]:
    """Continuous-batching decode of ``lengths`` (arrival order) with at most ``cap`` running:
    (seconds, decode steps, peak KV tokens). Cached on ``cap``, not on the memory budget, so
    every budget that allows the same running batch shares one evaluation."""
    step_model = decode_step_model(model, gen, dtype, gpus_per_node)
    n = len(lengths)
    running: list[tuple[int, int]] = []
    admitted_sum = 0
    next_index = 0
    step = 0
    seconds = 0.0
    peak_kv_tokens = 0.0
    while next_index < n and len(running) < cap:
        heapq.heappush(running, (lengths[next_index], 0))
        next_index += 1
    while running:
        finish = running[0][0]
        batch = len(running)
        count = finish - step
        if count > 0:
            middle = step + (count - 1) / 2
            kv_middle = batch * (prompt_len + 1 + middle) - admitted_sum
            seconds += count * step_model.step_seconds(profile, dtype, batch, kv_middle,
                                                       cuda_graphs, host_seconds_per_sequence)
            kv_end = batch * (prompt_len + finish) - admitted_sum
            peak_kv_tokens = max(peak_kv_tokens, kv_end)
        step = finish
        while running and running[0][0] == finish:
            _, admitted = heapq.heappop(running)
            admitted_sum -= admitted
        while next_index < n and len(running) < cap:
            heapq.heappush(running, (step + lengths[next_index], step))
            admitted_sum += step
            next_index += 1
    return seconds, step, peak_kv_tokens


def generate(model: ModelSpec, profile: DeviceProfile, gen: GenerationConfig, *,
             lengths: tuple[int, ...], prompt_len: int, kv_budget_bytes: float,
             dtype: str = "bf16", gpus_per_node: int = 8,
             cuda_graphs: bool = False,
             host_seconds_per_sequence: float = 0.0) -> GenerationCost:
    """One replica decodes sequences with response ``lengths`` (in arrival order).

    ``kv_budget_bytes`` is the per-GPU memory left for the KV cache after the weights, the
    engine's workspace (``workspace_bytes``) and everything else resident on the GPU
    (computed by the caller from the colocated set).
    """
    step_model = decode_step_model(model, gen, dtype, gpus_per_node)
    weights = generation_weight_bytes(model, gen, dtype)
    workspace = workspace_bytes(model, gen, dtype)
    n = len(lengths)
    kv_capacity = max(0.0, kv_budget_bytes) / step_model.kv_bytes_per_token_per_gpu
    generated = sum(lengths)
    if n == 0:
        return GenerationCost(seconds=0.0, prefill_seconds=0.0, decode_seconds=0.0,
                              decode_steps=0, max_running=0, kv_capacity_tokens=kv_capacity,
                              memory=MemoryBreakdown(params=weights), generated_tokens=0)
    longest = prompt_len + max(lengths)
    if kv_capacity < longest:
        reason = (f"KV cache for one {longest}-token sequence needs "
                  f"{longest * step_model.kv_bytes_per_token_per_gpu / GIB:.2f} GiB per GPU, "
                  f"{max(kv_budget_bytes, 0) / GIB:.2f} GiB left")
        return GenerationCost(seconds=math.inf, prefill_seconds=0.0, decode_seconds=math.inf,
                              decode_steps=0, max_running=0, kv_capacity_tokens=kv_capacity,
                              memory=MemoryBreakdown(params=weights, kv_cache=kv_budget_bytes,
                                                     activations=workspace),
                              generated_tokens=generated, feasible=False, reason=reason)
    cap = running_cap(gen, sequences=n, kv_capacity_tokens=kv_capacity, prompt_len=prompt_len,
                      mean_response=generated / n)
    decode_seconds, steps, peak_kv_tokens = decode(
        model, profile, gen, lengths=lengths, prompt_len=prompt_len, cap=cap, dtype=dtype,
        gpus_per_node=gpus_per_node, cuda_graphs=cuda_graphs,
        host_seconds_per_sequence=host_seconds_per_sequence)
    prefill = prefill_seconds(model, profile, gen, sequences=n, prompt_len=prompt_len,
                              dtype=dtype, gpus_per_node=gpus_per_node)
    memory = MemoryBreakdown(params=weights,
                             kv_cache=peak_kv_tokens * step_model.kv_bytes_per_token_per_gpu,
                             activations=workspace)
    return GenerationCost(seconds=prefill + decode_seconds, prefill_seconds=prefill,
                          decode_seconds=decode_seconds, decode_steps=steps, max_running=cap,
                          kv_capacity_tokens=kv_capacity, memory=memory,
                          generated_tokens=generated)
