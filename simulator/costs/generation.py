"""Generation: prefill (compute-bound) then decode (memory-bound per step) with continuous
batching over the response-length distribution, limited by the KV cache left in memory.

One generation replica (t_g x p_g GPUs) is modelled; replicas run in parallel on their shares
of the batch, so the replica holding the longest responses decides the stage's time.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from profiles.device import DTYPE_BYTES, DeviceProfile
from simulator.costs.memory import GIB, MemoryBreakdown
from simulator.costs.primitives import (
    all_reduce_seconds,
    all_to_all_seconds,
    group_crosses_nodes,
    group_span,
)
from simulator.costs.transformer import head_forward_seconds, layer_cost, stage_param_count
from simulator.specs.lengths import LengthDistribution
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, stage_layers

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
    expert_bytes_per_gpu: float = 0.0
    """MoE: every routed expert's weights on this GPU (``weight_bytes_per_gpu`` holds the rest:
    attention, router, shared experts, head)."""
    expert_touch_probability: float = 0.0
    """MoE: the chance that one token routes to a given expert (top_k / experts)."""
    expert_batch_multiplier: float = 1.0
    """MoE with expert-parallel serving: replicas whose tokens reach this GPU's experts
    (ep / tp)."""
    expert_exchange_bytes_per_token: float = 0.0
    """MoE with expert-parallel serving: bytes a running sequence sends per MoE layer and
    direction (its top_k copies, hidden wide, over tp ranks)."""
    moe_layers_per_stage: float = 0.0
    ep: int = 1
    gpus_per_node: int = 8
    expert_flops_per_token_per_gpu: float = 0.0
    """MoE: the part of ``matmul_flops_per_token_per_gpu`` in routed experts, which run as one
    small GEMM per expert at the tokens routed to it."""
    experts_per_gpu: float = 0.0
    """MoE: routed experts whose GEMMs one GPU runs per layer."""

    def weight_bytes_read(self, batch: float) -> float:
        """Weights one decode step reads: all dense weights, and of a MoE model's routed
        experts those at least one of the ``batch`` tokens routes to (uniform routing: each
        expert is missed by every token with probability 1 - top_k / experts), so the read
        grows from the active experts at batch 1 towards every expert at large batches."""
        if self.expert_bytes_per_gpu <= 0:
            return self.weight_bytes_per_gpu
        tokens = max(batch, 1.0) * self.expert_batch_multiplier
        touched = 1.0 - (1.0 - self.expert_touch_probability) ** tokens
        return self.weight_bytes_per_gpu + touched * self.expert_bytes_per_gpu

    def step_seconds(self, profile: DeviceProfile, dtype: str, batch: float,
                     kv_tokens: float, cuda_graphs: bool = False,
                     host_seconds_per_sequence: float = 0.0) -> float:
        return StepPricer(self, profile, dtype, cuda_graphs,
                          host_seconds_per_sequence).seconds(batch, kv_tokens)

    def interval(self, profile: DeviceProfile, dtype: str, batch: float, admitted_sum: float,
                 prompt_len: int, start: float, finish: float, cuda_graphs: bool,
                 host_seconds_per_sequence: float) -> tuple[float, float]:
        """The steps from ``start`` to the next finish, ``finish`` (a running batch that does
        not change in between; ``admitted_sum``: its sequences' admission steps, summed):
        (seconds, KV tokens at the end). Priced at once, at the middle step's KV cache."""
        return StepPricer(self, profile, dtype, cuda_graphs, host_seconds_per_sequence
                          ).interval(batch, admitted_sum, prompt_len, start, finish)


class StepPricer:
    """``DecodeStepModel.step_seconds`` for one (replica, device, dtype, engine): what does
    not depend on the step looked up once, and the batch-only terms kept per batch. A decode
    loop prices thousands of intervals; looking up the profile and hashing the step model for
    each took most of a long-tailed search."""

    __slots__ = (
        "_attention_flops_per_kv_token",
        "_bandwidth_bytes_per_s",
        "_batch_terms",
        "_cuda_graphs",
        "_decode_correction",
        "_dense_weight_bytes",
        "_dtype",
        "_fixed_step_seconds",
        "_host_seconds_per_sequence",
        "_kv_bytes_per_token",
        "_memory_efficiency",
        "_peak_flops",
        "_pp",
        "_profile",
        "_step",
    )

    def __init__(self, step: DecodeStepModel, profile: DeviceProfile, dtype: str,
                 cuda_graphs: bool = False, host_seconds_per_sequence: float = 0.0) -> None:
        self._step = step
        self._profile = profile
        self._dtype = dtype
        self._cuda_graphs = cuda_graphs
        self._dense_weight_bytes = (step.weight_bytes_per_gpu
                                    if step.expert_bytes_per_gpu <= 0 else None)
        self._kv_bytes_per_token = step.kv_bytes_per_token_per_gpu
        self._bandwidth_bytes_per_s = profile.memory_bandwidth_bytes_per_s
        self._memory_efficiency = profile.efficiency.memory
        self._attention_flops_per_kv_token = step.attention_flops_per_kv_token_per_gpu
        self._peak_flops = profile.peak_flops(dtype)
        self._decode_correction = profile.correction("decode")
        self._host_seconds_per_sequence = host_seconds_per_sequence
        self._fixed_step_seconds = profile.overheads.decode_step_seconds
        self._pp = step.pp
        self._batch_terms: dict[float, tuple[float, float]] = {}

    def seconds(self, batch: float, kv_tokens: float) -> float:
        """Seconds of one decode step with ``batch`` sequences running over ``kv_tokens``."""
        weights = self._dense_weight_bytes
        if weights is None:
            weights = self._step.weight_bytes_read(batch)
        bytes_read = weights + kv_tokens * self._kv_bytes_per_token
        memory = bytes_read / (self._bandwidth_bytes_per_s
                               * self._memory_efficiency.at(bytes_read))
        terms = self._batch_terms.get(batch)
        if terms is None:
            terms = self._batch_terms[batch] = _batch_terms(
                self._step, self._profile, self._dtype, batch, self._cuda_graphs)
        gemm, comm_and_launches = terms
        compute = gemm + kv_tokens * self._attention_flops_per_kv_token / self._peak_flops
        # The fitted decode correction scales the device work only (not collectives, which
        # carry their own correction, nor the fixed per-kernel cost).
        stage = max(memory, compute) * self._decode_correction + comm_and_launches
        # An engine that does not schedule asynchronously prepares the next step on the host
        # (scheduling, input tensors, sampled-token output) while the GPU waits: host work per
        # running sequence, serialised with the step.
        host = batch * self._host_seconds_per_sequence
        # Without micro-batching across stages, a token passes every pipeline stage in turn.
        return self._pp * stage + host + self._fixed_step_seconds

    def seconds_many(self, batch: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """``seconds`` of each (batch, KV tokens) pair: the same formula, elementwise."""
        if self._dense_weight_bytes is not None:
            weights = self._dense_weight_bytes
        else:
            weights = np.array([self._step.weight_bytes_read(float(b)) for b in batch])
        bytes_read = weights + kv_tokens * self._kv_bytes_per_token
        memory = bytes_read / (self._bandwidth_bytes_per_s
                               * self._memory_efficiency.at_many(bytes_read))
        unique, which = np.unique(batch, return_inverse=True)
        terms = np.array([self._terms(float(b)) for b in unique]).reshape(-1, 2)
        gemm, comm_and_launches = terms[which, 0], terms[which, 1]
        compute = gemm + kv_tokens * self._attention_flops_per_kv_token / self._peak_flops
        stage = np.maximum(memory, compute) * self._decode_correction + comm_and_launches
        host = batch * self._host_seconds_per_sequence
        return self._pp * stage + host + self._fixed_step_seconds

    def _terms(self, batch: float) -> tuple[float, float]:
        terms = self._batch_terms.get(batch)
        if terms is None:
            terms = self._batch_terms[batch] = _batch_terms(
                self._step, self._profile, self._dtype, batch, self._cuda_graphs)
        return terms

    def interval(self, batch: float, admitted_sum: float, prompt_len: int, start: float,
                 finish: float) -> tuple[float, float]:
        """``DecodeStepModel.interval``: (seconds, KV tokens at the end)."""
        count = finish - start
        middle = start + (count - 1) / 2
        kv_middle = batch * (prompt_len + 1 + middle) - admitted_sum
        seconds = count * self.seconds(batch, kv_middle)
        return seconds, batch * (prompt_len + finish) - admitted_sum


@lru_cache(maxsize=65536)
def _batch_terms(step: DecodeStepModel, profile: DeviceProfile, dtype: str, batch: float,
                 cuda_graphs: bool) -> tuple[float, float]:
    """The parts of a decode step that depend on the running batch only: (seconds of the
    weight GEMMs, seconds of the tensor-parallel all-reduces plus kernel launches). Cached: a
    continuous-batching loop asks for the same running batch at many steps."""
    peak = profile.peak_flops(dtype)
    # A replica token's routed-expert FLOPs on this GPU's experts (the rest is dense work).
    dense_flops = step.matmul_flops_per_token_per_gpu \
        - step.expert_flops_per_token_per_gpu * step.expert_batch_multiplier
    gemm_size = batch * dense_flops / max(1.0, 4 * step.layers_per_stage)
    gemm = batch * dense_flops / (peak * profile.efficiency.matmul.at(gemm_size))
    if step.expert_flops_per_token_per_gpu > 0:
        # Routed experts: the batch's expert FLOPs in one GEMM pair per local expert, each as
        # large as the tokens it receives (the same total work cut into small GEMMs).
        expert_flops = batch * step.expert_batch_multiplier \
            * step.expert_flops_per_token_per_gpu
        per_expert_gemm = expert_flops / max(1.0, 2 * step.moe_layers_per_stage
                                             * step.experts_per_gpu)
        gemm += expert_flops / (peak * profile.efficiency.matmul.at(per_expert_gemm))
    comm = 2 * step.layers_per_stage * all_reduce_seconds(
        profile, batch * step.hidden_bytes, step.tp, step.tp_crosses_nodes)
    if step.ep > 1:
        # Expert-parallel serving: dispatch and combine of the running batch's routed copies
        # in every MoE layer, over the ep group (consecutive GPUs).
        span = group_span(step.ep, 1, step.gpus_per_node)
        comm += 2 * step.moe_layers_per_stage * all_to_all_seconds(
            profile, batch * step.expert_exchange_bytes_per_token, step.ep, span=span)
    # Decode kernels are microseconds long, so in eager mode each kernel's fixed launch
    # cost adds up instead of hiding behind the previous kernel as it does in training
    # (vLLM PR #1440: Llama-2-7B at batch 1 decodes in ~12 ms per step eager, ~10.5 ms
    # with CUDA graphs). A captured graph replays the step's kernels from one launch.
    launches = profile.overheads.kernel_launch_seconds if (
        cuda_graphs and profile.kind == "gpu") else (
        step.layers_per_stage * KERNELS_PER_LAYER_DECODE
        * profile.overheads.kernel_launch_seconds)
    return gemm, comm + launches



@lru_cache(maxsize=4096)
def decode_step_model(model: ModelSpec, gen: GenerationConfig, dtype: str,
                      gpus_per_node: int) -> DecodeStepModel:
    b = DTYPE_BYTES[dtype]
    tp, pp = gen.tp, gen.pp
    # The heaviest stage (for MoE a stage of MoE layers); latent attention's down projections
    # are whole on every tensor-parallel rank (vLLM's ReplicatedLinear), the rest split.
    layers = stage_layers(model.layers, pp)
    moe_layers = model.stage_moe_layers(layers)
    head = model.hidden * model.vocab / tp
    duplicated = layers * model.duplicated_linear_params_per_layer
    linear = model.stage_active_linear_params(layers)
    matmul_params = (linear - duplicated) / tp + duplicated + head
    weights = matmul_params * b
    expert_bytes = touch = expert_flops = 0.0
    if model.moe is not None:
        # The engine splits every expert over the tensor-parallel ranks (vLLM's default,
        # without --enable-expert-parallel); the active experts leave the dense part.
        active = moe_layers * model.moe.top_k * model.expert_params_per_moe_layer
        weights -= active / tp * b
        # Spread over the tp ranks, or with expert-parallel serving over the ep group.
        expert_bytes = model.stage_expert_params(layers) / max(tp, gen.ep) * b
        touch = model.moe.top_k / model.moe.experts
        # A token's top_k expert GEMMs (2 FLOPs per weight), on the GPUs holding the experts:
        # split over tp, or whole experts on ep GPUs that serve ep / tp replicas' tokens.
        expert_flops = 2 * active / max(tp, gen.ep)
    # KV heads are replicated when tp > kv_heads; an MLA latent is whole on every rank.
    kv_per_token = layers * model.kv_cache_elements_per_token_per_layer(tp) * b
    matmul = 2 * matmul_params
    attention = layers * model.decode_attention_flops_per_cached_token(tp)
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
        expert_bytes_per_gpu=expert_bytes,
        expert_touch_probability=touch,
        expert_batch_multiplier=max(1.0, gen.ep / tp),
        expert_exchange_bytes_per_token=(model.moe.top_k * model.hidden * b / tp
                                         if model.moe is not None else 0.0),
        moe_layers_per_stage=moe_layers,
        ep=gen.ep,
        gpus_per_node=gpus_per_node,
        expert_flops_per_token_per_gpu=expert_flops,
        experts_per_gpu=(model.moe.experts / gen.ep if gen.ep > 1 else model.moe.experts)
        if model.moe is not None else 0.0,
    )


def generation_weight_bytes(model: ModelSpec, gen: GenerationConfig, dtype: str) -> float:
    """Per-GPU weights of the generation layout's heaviest stage: split over its t_g ranks
    but for the norms and latent attention's down projections (whole on every rank); with
    expert-parallel serving the routed experts spread over the ep GPUs instead."""
    return stage_param_count(model, tp=gen.tp, pp=gen.pp, value_head=False,
                             ep=max(gen.tp, gen.ep)) * DTYPE_BYTES[dtype]


def workspace_bytes(model: ModelSpec, gen: GenerationConfig, dtype: str) -> float:
    """Per-GPU activation workspace of the engine: one prefill chunk's hidden states and MLP
    intermediates, plus fp32 logits for a full running batch."""
    b = DTYPE_BYTES[dtype]
    # The MLP intermediates a token produces: the dense MLP's, or its top_k experts' and the
    # shared experts' (whichever layers are wider).
    width = model.ffn_hidden if model.moe is None else max(
        model.ffn_hidden if model.moe.first_dense_layers else 0,
        model.moe.top_k * model.moe.expert_ffn_hidden
        + model.moe.shared_experts * model.moe.shared_ffn)
    return (PREFILL_CHUNK_TOKENS * (4 * model.hidden + 3 * width / gen.tp) * b
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
                       tp_crosses_nodes=group_crosses_nodes(gen.tp, 1, gpus_per_node),
                       ep=gen.ep, ep_span=group_span(gen.ep, 1, gpus_per_node))
    # The fitted prefill correction scales kernels only, not the TP collectives.
    compute_scale = profile.correction("prefill_compute")
    stage = stage_layers(model.layers, gen.pp) * (layer.forward_seconds * compute_scale
                                     + layer.tp_forward_seconds)
    # Only the last position of each prompt needs logits.
    head = head_forward_seconds(model, profile, tokens=batch, tp=gen.tp, dtype=dtype,
                                value_head=False, loss=False) * compute_scale
    per_chunk_seconds = stage + head
    return (chunks + gen.pp - 1) * per_chunk_seconds


EXACT_SEQUENCES = 8192
"""Responses per replica up to which generation is priced by the exact event loop over every
response (``decode_exact``), as before issue 14: every job, test and validation case of the
suite is below it (the largest, the GRPO example, has 2048). A larger replica is priced by the
fluid model (``ReplicaBatch``), whose cost does not grow with the number of responses; at this
size the exact loop costs about what the fluid model does (~20-40 ms)."""

# The fluid model's resolution. The constants were set by measuring the fluid model against
# the exact event loop over the same responses (tests/test_generation_scaling.py has a sample):
# decode seconds within 0.6%, decode steps within 3.1%, peak KV cache within 10.3%, on
# lognormal, maximum-entropy, empirical, near-equal and equal lengths (equal: exact), Llama-2-7B
# on an A100 and 70B on 8 H100s, 8,193 to 262,144 responses per replica, caps 7 to 8192.
PREFIX_HORIZONS = 0.5
"""Arrivals the fluid model simulates before the steady middle it skips, in drain horizons
(``_drain_horizon``), plus 2 x cap: long enough for the running batch to lose the lock-step of
the first admissions (all at step 0)."""
SUFFIX_HORIZONS = 1.2
"""Last arrivals the fluid model simulates, in drain horizons, plus 2 x cap: every response that
can still be decoding when the last one is admitted arrived among them."""
CRITICAL_MARGIN = 1.5
"""A stratum of mean length L can still be decoding at the end if it arrived within
CRITICAL_MARGIN x cap x L / mean arrivals of the last one; there it is kept in small groups."""
SUFFIX_GROUP_CAP_FRACTION = 8
"""Near the end, a group of the fluid model holds at most cap / SUFFIX_GROUP_CAP_FRACTION
responses and gathers responses that arrive within cap / 2 arrivals of each other (so the
running batch holds many groups and the drain is resolved to a fraction of a response's
length)."""
PREFIX_GROUP_CAP_FRACTION = 4
"""Before the skipped middle, groups of at most cap / PREFIX_GROUP_CAP_FRACTION responses that
arrive within cap arrivals of each other (only the running batch's mix matters there)."""
FAR_SPAN_FRACTION = 8
"""Far from the end (beyond a stratum's critical distance d0), a group may gather responses
arriving within (d - d0) / FAR_SPAN_FRACTION arrivals of each other, d = arrivals to the end."""
STRATUM_SPREAD = 0.25
"""A rank stratum's longest response is at most 1 + STRATUM_SPREAD times its shortest ..."""
STRATUM_SPREAD_TOKENS = 16
"""... or at most STRATUM_SPREAD_TOKENS longer (short responses barely fill the KV cache)."""
WAIT_FRACTION = 16
"""A group of which less than half fits waits for the next finish if that comes within
1 / WAIT_FRACTION of the group's length (see ``_decode_fluid``)."""
GROUP_BUDGET = 1024
"""Groups the fluid model aims at: groups are made no smaller than (simulated arrivals) /
GROUP_BUDGET responses, and no larger than the cap fractions above (which win when a long
tail makes the drain horizon many caps long)."""
RANK_STRATA_PER_OCTAVE = 4
"""Strata per octave of length rank (ranks [2^a, 2^(a+1)), the longest response is rank 0):
relatively finer towards the longest responses, which decide the end of generation."""


@lru_cache(maxsize=4096)
def replica_lengths(dist: LengthDistribution, total_sequences: int,
                    replicas: int) -> tuple[int, ...]:
    """Response lengths (tokens) of the replica that holds the longest response, in arrival
    order: every response materialised, for the exact event loop.

    The batch's lengths are the distribution's stratified quantiles; replicas take every
    ``replicas``-th of them starting at the longest, so each sees the whole distribution.

    Arrival order. Up to EXACT_SEQUENCES responses: a fixed pseudo-random shuffle (seed 0), so
    predictions are deterministic. Above: the stratified order of ``ReplicaBatch`` (the
    response of length rank r arrives at the position of the bit-reversal of r), which a
    bounded number of weighted groups reproduces; a shuffle does not, since where a random order
    happens to put its longest responses moves the end of generation by several percent of the
    decode steps (measured: the decode steps of 16,384 lognormal responses vary by 13% between
    shuffle seeds).
    """
    batch = ReplicaBatch(dist, total_sequences, replicas)
    n = batch.sequences
    mine = [batch.rank_length(r) for r in range(n)]  # starts with the maximum
    if n <= EXACT_SEQUENCES:
        random.Random(0).shuffle(mine)
        return tuple(mine)
    bits = _key_bits(n)
    return tuple(mine[r] for r in sorted(range(n), key=lambda r: _bit_reverse(r, bits)))


@dataclass(frozen=True, slots=True)
class ReplicaBatch:
    """The responses one generation replica decodes, described instead of listed: the replica
    holding the longest response of ``total_sequences`` stratified lengths of ``distribution``
    dealt to ``replicas`` replicas (``replica_lengths`` lists them).

    It behaves as that list where the planner needs it (``len``, iteration: ``max`` and ``sum``
    materialise the list once, O(sequences); ``sequences``, ``longest``, ``total_tokens`` and
    ``mean_tokens`` do not). ``decode`` prices it with the exact event loop up to
    EXACT_SEQUENCES responses and with the fluid model above, at a cost that does not grow with
    the number of responses.

    Arrival order above EXACT_SEQUENCES: with B = bits of (sequences - 1), the response of
    length rank r (0 = the longest) arrives in the order of its key ``bit_reverse(r, B)`` (a van
    der Corput order). Every stretch of consecutive arrivals is then a stratified sample of the
    lengths, and the responses of a stratum of ranks [u 2^e, (u + 1) 2^e) arrive evenly spaced,
    2^(B - e) keys apart: so the fluid model knows, without listing them, how many responses of
    each stratum arrive in any stretch and where each long one arrives. Like a random order it
    spreads the long responses over the whole run (the last of the r longest arrives about
    n / r arrivals before the end); unlike one it has no luck: measured against the mean of 8
    shuffles, its decode seconds are within 0.7% (16,384 and more responses per replica,
    lognormal and maximum-entropy lengths), its peak KV cache 5-15% lower (a shuffle's bursts
    of long responses).
    """

    distribution: LengthDistribution
    total_sequences: int
    replicas: int

    @property
    def sequences(self) -> int:
        """Responses of this replica (the first replica's share, the largest)."""
        return len(range(0, self.total_sequences, self.replicas))

    @property
    def exact(self) -> bool:
        """True when ``decode`` runs the exact event loop over every response."""
        return self.sequences <= EXACT_SEQUENCES

    def rank_length(self, rank: int) -> int:
        """Tokens of the replica's ``rank``-th longest response (rank 0 = the longest)."""
        return self.distribution.length_at(self.total_sequences - 1 - rank * self.replicas,
                                           self.total_sequences)

    @property
    def longest(self) -> int:
        """Tokens of the longest response (= max of the list)."""
        return self.rank_length(0)

    @property
    def total_tokens(self) -> float:
        """Tokens generated by this replica (= sum of the list; from the strata above
        EXACT_SEQUENCES, relative error ~ 1e-5)."""
        if self.exact:
            return float(sum(self.lengths()))
        return sum(count * mean for _, count, mean, _ in _rank_strata(self))

    @property
    def mean_tokens(self) -> float:
        """Mean response length (tokens)."""
        return self.total_tokens / self.sequences

    def lengths(self) -> tuple[int, ...]:
        """Every response length in arrival order (``replica_lengths``; O(sequences))."""
        return replica_lengths(self.distribution, self.total_sequences, self.replicas)

    def __len__(self) -> int:
        return self.sequences

    def __iter__(self) -> Iterator[int]:
        return iter(self.lengths())


def _key_bits(n: int) -> int:
    """Bits of the arrival keys of n responses."""
    return max(1, (n - 1).bit_length())


def _bit_reverse(x: int, bits: int) -> int:
    """x's lowest ``bits`` bits in reverse order."""
    return int(format(x, f"0{bits}b")[::-1], 2) if bits > 0 else 0


def _arrivals_before(key: int, n: int, bits: int) -> int:
    """Responses (of n) whose arrival key is below ``key``: #{x < key : bit_reverse(x) < n}.

    x < key when x matches key above some bit i where key has a 1, has a 0 there and anything
    below; for those x, bit_reverse(x) = g * 2^(bits - i) + c with c fixed by the matched high
    bits and g running over [0, 2^i), so they are counted at once.
    """
    if key >= 1 << bits:
        return n
    if n >= 1 << bits:
        return key
    count = 0
    for i in range(bits):
        if key >> i & 1:
            c = _bit_reverse(key >> (i + 1) << 1, bits - i)
            count += min(1 << i, max(0, -(-(n - c) // (1 << (bits - i)))))
    return count


def _key_of_arrival(position: int, n: int, bits: int) -> int:
    """The smallest key with ``position`` arrivals before it (the first ``position`` arrivals
    are the responses with keys below it)."""
    lo, hi = 0, 1 << bits
    while lo < hi:
        mid = (lo + hi) // 2
        if _arrivals_before(mid, n, bits) >= position:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _members(lo: int, hi: int, offset: int, stride: int, size: int) -> tuple[int, int]:
    """[a, b): the j of a stratum's responses (keys offset + j * stride, j < size) whose keys
    are in [lo, hi)."""
    a = max(0, -(-(lo - offset) // stride))
    return a, max(a, min(size, -(-(hi - offset) // stride)))


def _spread_too_wide(longest: int, shortest: int) -> bool:
    """Whether a stratum's lengths (tokens) spread too widely to share one mean length."""
    return longest - shortest > max(STRATUM_SPREAD_TOKENS, STRATUM_SPREAD * shortest)


@lru_cache(maxsize=4096)
def _rank_strata(batch: ReplicaBatch) -> tuple[tuple[int, int, float, float], ...]:
    """Strata of length rank: (first rank, responses, mean length, mean squared length).

    Each stratum is an aligned power-of-two range of ranks, [u 2^e, (u + 1) 2^e): the 4 longest
    responses alone, then RANK_STRATA_PER_OCTAVE per octave of rank (the last partial octave in
    the largest aligned pieces that fit), halved until its lengths spread by at most
    STRATUM_SPREAD. Means are in tokens, squares in tokens^2.
    """
    n, total, replicas = batch.sequences, batch.total_sequences, batch.replicas
    per_octave_bits = RANK_STRATA_PER_OCTAVE.bit_length() - 1
    out = []
    rank = 0
    while rank < n:
        size_bits = max(0, rank.bit_length() - 1 - per_octave_bits)
        while rank + (1 << size_bits) > n or rank % (1 << size_bits):
            size_bits -= 1
        # A group of the fluid model decodes its stratum's mean length, which loses the spread
        # of lengths within the stratum (its KV cache grows with the squared lengths): halve a
        # stratum whose lengths spread over more than STRATUM_SPREAD of its shortest (a jump
        # of an empirical distribution, such as responses cut at the maximum).
        while size_bits > 0 and _spread_too_wide(batch.rank_length(rank),
                                                 batch.rank_length(rank + (1 << size_bits) - 1)):
            size_bits -= 1
        size = 1 << size_bits
        # Ranks [rank, rank + size) are the ascending sample indices total - 1 - r * replicas.
        mean, square = batch.distribution.progression_moments(
            total - 1 - (rank + size - 1) * replicas, replicas, size, total)
        out.append((rank, size, mean, square))
        rank += size
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _FluidPlan:
    """One replica's responses for one running cap, as weighted groups in arrival order."""

    prefix: tuple[tuple[float, float], ...]
    """(length in tokens, responses) of the groups before the skipped middle."""
    suffix: tuple[tuple[float, float], ...]
    """The same after it (the whole batch when nothing is skipped)."""
    middle_sequences: int
    """Responses skipped between prefix and suffix (a multiple of the cap)."""
    middle_tokens: float
    """Their tokens."""
    middle_square_tokens: float
    """Sum of their squared lengths (tokens^2): their KV cache over time."""


def _drain_horizon(batch: ReplicaBatch, cap: int) -> float:
    """Arrivals admitted, at a full running batch, while the longest response decodes:
    cap x longest / mean length. Responses that arrive earlier than this before the last
    admission are done when it happens."""
    return cap * batch.longest / batch.mean_tokens


@lru_cache(maxsize=4096)
def _fluid_plan(batch: ReplicaBatch, cap: int) -> _FluidPlan:
    """Group the responses for the fluid model at running cap ``cap`` (sequences).

    The arrival order is cut in three: a prefix of PREFIX_HORIZONS drain horizons, a middle of
    whole multiples of the cap, and a suffix of SUFFIX_HORIZONS drain horizons; a batch too
    small for a middle is all suffix. Within prefix and suffix, each rank stratum's responses
    are grouped, in arrival order, into groups of nearby arrivals, each one entry (its
    stratum's mean length, the number of responses as its weight) at its responses' mean
    arrival key; a group of one keeps its response's own length. Groups are small where it
    matters: near the end for strata long enough to still run then, everywhere else only small
    enough for the running batch to hold several. The middle is summed per stratum (responses,
    tokens, squared tokens) for ``_decode_fluid`` to skip.
    """
    n = batch.sequences
    bits = _key_bits(n)
    top = 1 << bits
    mean_tokens = batch.mean_tokens
    horizon = _drain_horizon(batch, cap)
    suffix_arrivals = math.ceil(SUFFIX_HORIZONS * horizon) + 2 * cap
    prefix_arrivals = math.ceil(PREFIX_HORIZONS * horizon) + 2 * cap
    # A middle is skipped only when it is at least as large as what is simulated (a smaller
    # one would save less than half the work), and is a whole number of caps, which keeps a
    # lock-step batch (equal lengths) in phase across the skip: the state after the prefix is
    # then the state before the suffix.
    middle = (n - prefix_arrivals - suffix_arrivals) // cap * cap
    if middle < prefix_arrivals + suffix_arrivals:
        middle = 0
    if middle == 0:
        prefix_arrivals = 0
    # Below the cap fractions, groups are as small as the budget allows: fine groups cost
    # nothing more than coarse ones when few arrivals are simulated.
    smallest = max(1.0, (n if middle == 0 else prefix_arrivals + suffix_arrivals)
                   / GROUP_BUDGET)
    prefix_end = _key_of_arrival(prefix_arrivals, n, bits)
    suffix_start = _key_of_arrival(prefix_arrivals + middle, n, bits)
    prefix: list[tuple[float, float, float]] = []
    suffix: list[tuple[float, float, float]] = []
    middle_tokens = middle_square = 0.0
    for first, size, mean, square in _rank_strata(batch):
        size_bits = size.bit_length() - 1
        stride = 1 << (bits - size_bits)  # keys between consecutive responses of the stratum
        offset = _bit_reverse(first >> size_bits, bits - size_bits)
        share = size / n  # of any stretch of arrivals
        critical = CRITICAL_MARGIN * cap * mean / mean_tokens
        for lo, hi, out in ((0, prefix_end, prefix), (suffix_start, top, suffix)):
            j, end = _members(lo, hi, offset, stride, size)
            while j < end:
                key = offset + j * stride
                if out is prefix:
                    most, span = min(cap / PREFIX_GROUP_CAP_FRACTION, smallest), float(cap)
                else:
                    most, span = min(cap / SUFFIX_GROUP_CAP_FRACTION, smallest), cap / 2
                    to_end = (top - key) * n / top
                    if to_end > critical:
                        span = max(span, (to_end - critical) / FAR_SPAN_FRACTION)
                # Rounded down to a power of two (measured: a finer mix of groups in the
                # running batch than the plain floor, for a few more groups).
                group = 1 << max(0, int(min(most, share * span)).bit_length() - 1)
                stop = min(end, j + group)
                length = (float(batch.rank_length(first + _bit_reverse(j, size_bits)))
                          if stop - j == 1 else mean)
                out.append((offset + stride * (j + stop - 1) / 2, length, float(stop - j)))
                j = stop
        a, b = _members(prefix_end, suffix_start, offset, stride, size)
        middle_tokens += (b - a) * mean
        middle_square += (b - a) * square
    prefix.sort()
    suffix.sort()
    return _FluidPlan(prefix=tuple((length, w) for _, length, w in prefix),
                      suffix=tuple((length, w) for _, length, w in suffix),
                      middle_sequences=middle, middle_tokens=middle_tokens,
                      middle_square_tokens=middle_square)


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
           lengths: tuple[int, ...] | ReplicaBatch, prompt_len: int, cap: int,
           dtype: str = "bf16", gpus_per_node: int = 8, cuda_graphs: bool = False,
           host_seconds_per_sequence: float = 0.0) -> tuple[float, int, float]:
    """Continuous-batching decode of ``lengths`` (response tokens in arrival order, or a
    ``ReplicaBatch``) with at most ``cap`` sequences running: (seconds, decode steps, peak KV
    tokens). Cached on ``cap``, not on the memory budget, so every budget that allows the same
    running batch shares one evaluation.

    A tuple, or a ReplicaBatch of at most EXACT_SEQUENCES responses, runs the exact event loop
    (``decode_exact``); a larger ReplicaBatch the fluid model (``_decode_fluid``), whose cost
    depends on the cap and the length distribution's shape, not on the number of responses.
    """
    step_model = decode_step_model(model, gen, dtype, gpus_per_node)
    if isinstance(lengths, ReplicaBatch):
        if not lengths.exact:
            return _decode_fluid(step_model, profile, dtype, _fluid_plan(lengths, cap),
                                 prompt_len=prompt_len, cap=cap, cuda_graphs=cuda_graphs,
                                 host_seconds_per_sequence=host_seconds_per_sequence)
        lengths = lengths.lengths()
    return _decode_exact(step_model, profile, dtype, lengths, prompt_len=prompt_len, cap=cap,
                         cuda_graphs=cuda_graphs,
                         host_seconds_per_sequence=host_seconds_per_sequence)


def decode_exact(model: ModelSpec, profile: DeviceProfile, gen: GenerationConfig, *,
                 lengths: tuple[int, ...] | ReplicaBatch, prompt_len: int, cap: int,
                 dtype: str = "bf16", gpus_per_node: int = 8, cuda_graphs: bool = False,
                 host_seconds_per_sequence: float = 0.0) -> tuple[float, int, float]:
    """``decode`` by the exact event loop over every response, whatever the batch's size (a
    ReplicaBatch is listed first): the reference the fluid model is tested against."""
    if isinstance(lengths, ReplicaBatch):
        lengths = lengths.lengths()
    return _decode_exact(decode_step_model(model, gen, dtype, gpus_per_node), profile, dtype,
                         lengths, prompt_len=prompt_len, cap=cap, cuda_graphs=cuda_graphs,
                         host_seconds_per_sequence=host_seconds_per_sequence)


def _decode_exact(step_model: DecodeStepModel, profile: DeviceProfile, dtype: str,
                  lengths: tuple[int, ...], *, prompt_len: int, cap: int, cuda_graphs: bool,
                  host_seconds_per_sequence: float) -> tuple[float, int, float]:
    """The event loop: between two finishes every running sequence decodes one token per
    step, so the steps in between are priced at once (at their middle step's KV cache).
    Consecutive responses of one length admitted at one step finish together, so they run
    as one entry of the heap (finish step, admission step, how many)."""
    pricer = StepPricer(step_model, profile, dtype, cuda_graphs, host_seconds_per_sequence)
    n = len(lengths)
    running: list[tuple[int, int, int]] = []
    running_count = 0
    admitted_sum = 0
    next_index = 0
    step = 0
    seconds = 0.0
    peak_kv_tokens = 0.0
    while True:
        while next_index < n and running_count < cap:
            length = lengths[next_index]
            end = next_index + 1
            last = min(n, next_index + cap - running_count)
            while end < last and lengths[end] == length:
                end += 1
            count = end - next_index
            heapq.heappush(running, (step + length, step, count))
            running_count += count
            admitted_sum += step * count
            next_index = end
        if not running:
            return seconds, step, peak_kv_tokens
        finish = running[0][0]
        if finish > step:
            interval, kv_end = pricer.interval(running_count, admitted_sum, prompt_len, step,
                                               finish)
            seconds += interval
            peak_kv_tokens = max(peak_kv_tokens, kv_end)
        step = finish
        while running and running[0][0] == finish:
            _, admitted, count = heapq.heappop(running)
            running_count -= count
            admitted_sum -= admitted * count


def _decode_fluid(step_model: DecodeStepModel, profile: DeviceProfile, dtype: str,
                  plan: _FluidPlan, *, prompt_len: int, cap: int, cuda_graphs: bool,
                  host_seconds_per_sequence: float) -> tuple[float, int, float]:
    """The fluid model's schedule (``_fluid_schedule``, shared by every engine that decodes
    this batch at this cap) priced for one engine: the intervals' seconds at once, summed in
    the schedule's order."""
    schedule = _fluid_schedule(plan, cap)
    pricer = StepPricer(step_model, profile, dtype, cuda_graphs, host_seconds_per_sequence)
    batch, admitted, start, finish = schedule.intervals
    count = finish - start
    middle = start + (count - 1) / 2
    kv_middle = batch * (prompt_len + 1 + middle) - admitted
    parts = count * pricer.seconds_many(batch, kv_middle)
    if schedule.skip_at >= 0:
        steps = plan.middle_tokens / cap
        kv_tokens = (plan.middle_tokens * (prompt_len + 1)
                     + (plan.middle_square_tokens - plan.middle_tokens) / 2) / steps
        parts = np.insert(parts, schedule.skip_at, steps * pricer.seconds(float(cap), kv_tokens))
    # add.accumulate sums left to right, as the event loop did.
    seconds = float(np.add.accumulate(parts)[-1]) if len(parts) else 0.0
    kv_end = batch * (prompt_len + finish) - admitted
    peak_kv_tokens = max(0.0, float(kv_end.max())) if len(kv_end) else 0.0
    return seconds, round(schedule.last_step), peak_kv_tokens


@dataclass(frozen=True, slots=True)
class _FluidSchedule:
    """The fluid model's decode of one batch at one running cap, in steps: what runs when,
    independent of how long a step takes."""

    intervals: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """Per stretch of steps between two finishes: (running responses, sum of responses x
    their admission step, first step, step after the last)."""
    skip_at: int
    """Position among the intervals where the skipped middle goes (-1: none)."""
    last_step: float
    """The step at which the last response finishes."""


@lru_cache(maxsize=4096)
def _fluid_schedule(plan: _FluidPlan, cap: int) -> _FluidSchedule:
    """The event loop over weighted groups: a group of w responses of length L decodes like w
    sequences admitted together; the running batch (``step_seconds``' batch) is the running
    weight and the KV cache is weight-summed. With every weight 1 this is ``_decode_exact``.

    The cap is a hard limit in sequences: a group that does not fit is split, the part that
    fits (whole responses) is admitted and the rest waits at the head of the queue. Over-filling
    the batch instead (admitting a whole group once half of it fits) puts a lone last response
    of equal-length responses into the previous wave (measured: -8% decode seconds for
    Llama-2-70B on 8 H100s, 2049 responses of 1024 tokens, cap 1024). Splitting at every finish
    would cut groups into ever smaller pieces (each freeing little room, so the next group is
    cut again: 2.5x as many events as groups, measured), so less than half a group is admitted
    only if the next finish is far (1 / WAIT_FRACTION of the group's length or more, as at the
    end of a lock-step wave); when it is near, the room stays free for those few steps
    (1.4x as many events as groups, the same decode seconds within 0.01%).

    The skipped middle: after the prefix the running batch is in its steady state, where
    every step decodes ``cap`` tokens; its responses' tokens take middle_tokens / cap steps, and
    their KV cache over those steps is the sum over responses of L (prompt + 1) + L (L - 1) / 2
    token-steps whatever their order, so the middle is priced at its mean KV cache. The state
    after the middle is taken to be the state before it, shifted by those steps (exact for
    equal lengths, since the middle is a whole number of caps). Its peak KV cache is taken as
    the prefix's and suffix's.
    """
    groups = list(plan.prefix + plan.suffix)
    skip_at = len(plan.prefix) if plan.middle_sequences else -1
    total = len(groups)
    running: list[tuple[float, float, float]] = []  # (finish step, admitted step, responses)
    weight = 0.0  # responses running
    admitted_sum = 0.0  # sum of responses x their admission step
    index = 0
    step = 0.0
    rows: list[tuple[float, float, float, float]] = []
    skip_position = -1
    while True:
        while index < total:
            if index == skip_at:
                skip_at = -1
                skip_position = len(rows)
                steps = plan.middle_tokens / cap
                step += steps
                admitted_sum += weight * steps
                running = [(f + steps, a + steps, w) for f, a, w in running]
                heapq.heapify(running)
            length, group = groups[index]
            free = cap - weight
            if free < 1 or (free < group / 2
                            and running[0][0] - step < length / WAIT_FRACTION):
                break
            if group > free:  # the part that fits now; the rest waits at the head
                group = float(int(free))
                groups[index] = (length, groups[index][1] - group)
            else:
                index += 1
            heapq.heappush(running, (step + length, step, group))
            weight += group
            admitted_sum += group * step
        if not running:
            break
        finish = running[0][0]
        if finish > step:
            rows.append((weight, admitted_sum, step, finish))
        step = finish
        # Groups of one length admitted at one step finish together; float sums of lengths
        # may differ in the last bits, so "together" is within 1e-9 steps.
        while running and running[0][0] <= finish + 1e-9:
            _, admitted, group = heapq.heappop(running)
            weight -= group
            admitted_sum -= group * admitted
        if not running:  # no drift of the sums from float cancellation
            weight = admitted_sum = 0.0
    columns = np.array(rows, dtype=float).reshape(-1, 4).T
    return _FluidSchedule(intervals=(columns[0], columns[1], columns[2], columns[3]),
                          skip_at=skip_position, last_step=step)


def generate(model: ModelSpec, profile: DeviceProfile, gen: GenerationConfig, *,
             lengths: tuple[int, ...] | ReplicaBatch, prompt_len: int,
             kv_budget_bytes: float, dtype: str = "bf16", gpus_per_node: int = 8,
             cuda_graphs: bool = False,
             host_seconds_per_sequence: float = 0.0) -> GenerationCost:
    """One replica decodes sequences with response ``lengths`` (tokens, in arrival order; or
    a ``ReplicaBatch``, which is never listed above EXACT_SEQUENCES responses).

    ``kv_budget_bytes`` is the per-GPU memory left for the KV cache after the weights, the
    engine's workspace (``workspace_bytes``) and everything else resident on the GPU
    (computed by the caller from the colocated set).
    """
    step_model = decode_step_model(model, gen, dtype, gpus_per_node)
    weights = generation_weight_bytes(model, gen, dtype)
    workspace = workspace_bytes(model, gen, dtype)
    n = len(lengths)
    kv_capacity = max(0.0, kv_budget_bytes) / step_model.kv_bytes_per_token_per_gpu
    if isinstance(lengths, ReplicaBatch) and not lengths.exact:
        total_tokens, longest_response = lengths.total_tokens, lengths.longest
    else:
        total_tokens, longest_response = sum(lengths), max(lengths, default=0)
    generated = round(total_tokens)
    if n == 0:
        return GenerationCost(seconds=0.0, prefill_seconds=0.0, decode_seconds=0.0,
                              decode_steps=0, max_running=0, kv_capacity_tokens=kv_capacity,
                              memory=MemoryBreakdown(params=weights), generated_tokens=0)
    longest = prompt_len + longest_response
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
                      mean_response=total_tokens / n)
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
