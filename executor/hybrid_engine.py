"""3D-HybridEngine: the actor switches between its training layout (p, t, d) and its
generation layout (p_g, t_g, d_g) on the same workers (HybridFlow §5).

Ranks form a (dp, gen_tp, micro_dp) mesh: micro-DP groups are consecutive ranks and generation
TP groups take every micro_dp-th rank, so the training shards a micro-DP group holds are
exactly one generation shard. The transition all-gathers within micro-DP groups only and the
rank's own training shard becomes a view into its generation shard: no second copy of the
weights. Back in training mode the view is copied out and the generation shard freed.
The gathers are bucketed: a rank's pieces of many parameters travel in one flat buffer, one
``all_gather_single`` per bucket (not one collective per parameter), and each generation
shard is copied once out of the gathered buffer.
``naive`` mode instead gathers the full weights on every rank and slices (DeepSpeed-Chat style).

Transitions record what they did: bytes each rank received, seconds, parameter bytes per rank
during generation (distinct storages, so aliasing is counted once).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from executor.device import has_gpu, shared_mesh, synchronize
from executor.generation import GenerationEngine, tp_shard_dim
from executor.trainer import Trainer
from simulator.specs.parallel import GenerationConfig

TRANSITION_BUCKET_BYTES = 256 * 2**20
"""Upper bound on the buffer one micro-DP all-gather fills (all members' pieces of the
bucket's parameters): few large collectives instead of one per parameter, with bounded
staging memory beside the generation shards. A parameter whose gathered size exceeds it is
gathered alone (its buffer then is its generation shard when it is split along dim 0)."""

TransitionMode = Literal["micro_dp", "naive", "full"]
"""micro_dp: the 3D-HybridEngine; naive: gather whole weights, keep this rank's generation
shard; full: whole weights to an engine that shards them itself (vLLM)."""


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    mode: str
    seconds: float
    bytes_received_per_gpu: int
    """Bytes this rank received in the all-gathers."""
    generation_param_bytes: int
    """Bytes of this rank's generation shards."""
    peak_param_bytes_per_gpu: int
    """Distinct parameter storage on this rank while generating (training shards that are
    views into generation shards are not counted twice)."""
    training_param_bytes: int


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_engine(spec: Any, generation: GenerationConfig, backend: str, *, seed: int,
                tp_group: Any, tp_rank: int, kv_cache_budget_bytes: int | None = None,
                dtype: torch.dtype = torch.float32, max_model_tokens: int | None = None) -> Any:
    """The generator: the native sampler on this rank's generation shard (its generation tp
    group given; it computes in its weights' dtype), or vLLM fed whole tensors in ``dtype``
    (it forms its own tensor-parallel groups) and started with the plan's engine settings
    (``max_num_seqs``, ``memory_utilization``; ``max_model_tokens``, the job's longest
    sequence, as its ``max_model_len``). ``kv_cache_budget_bytes``: this GPU's KV-cache budget
    (None: each engine's default)."""
    if backend == "vllm":
        from executor.backends.vllm import VLLMEngine

        # vLLM allocates its whole budget up front. Without a GPU the plan's budget is a GPU
        # profile's, and every virtual GPU shares this host's memory: vLLM's CPU sizing
        # (VLLM_CPU_KVCACHE_SPACE) stays in charge.
        return VLLMEngine(spec, tp_size=generation.tp, seed=seed, dtype=dtype,
                          kv_cache_budget_bytes=kv_cache_budget_bytes if has_gpu() else None,
                          max_model_len=max_model_tokens,
                          max_num_seqs=generation.max_num_seqs,
                          gpu_memory_utilization=generation.memory_utilization)
    return GenerationEngine(spec, tp_group=tp_group, tp_size=generation.tp, tp_rank=tp_rank,
                            kv_cache_budget_bytes=kv_cache_budget_bytes)


class HybridEngine:
    """The actor's generation side, fed from its trainer's shards."""

    def __init__(self, trainer: Trainer, generation: GenerationConfig,
                 mode: TransitionMode = "micro_dp", backend: str = "native", seed: int = 0,
                 *, kv_cache_budget_bytes: int | None = None,
                 transition_bucket_bytes: int = TRANSITION_BUCKET_BYTES,
                 max_model_tokens: int | None = None):
        par = trainer.par
        if par.tp % generation.tp:
            raise ValueError(f"generation tp {generation.tp} must divide training tp {par.tp}")
        self.trainer = trainer
        self.mode = mode
        self.gen_tp = generation.tp
        self.micro_dp = par.tp // generation.tp
        self.mesh = shared_mesh((par.dp, generation.tp, self.micro_dp),
                                ("dp", "gen_tp", "micro_dp"))
        self.gen_tp_rank = self.mesh.get_local_rank("gen_tp")
        self.micro_dp_rank = self.mesh.get_local_rank("micro_dp")
        self.micro_dp_group = self.mesh.get_group("micro_dp")
        self.replica = self.mesh.get_local_rank("dp") * self.micro_dp + self.micro_dp_rank
        self.backend = backend
        self.transition_bucket_bytes = transition_bucket_bytes
        if backend == "vllm":
            # vLLM holds its own copy of the weights and cuts its own tensor-parallel shards
            # from whole tensors: the transition gathers every tensor whole.
            self.mode = "full"
        self.engine = make_engine(trainer.spec, generation, backend, seed=seed,
                                  tp_group=self.mesh.get_group("gen_tp"),
                                  tp_rank=self.gen_tp_rank,
                                  kv_cache_budget_bytes=kv_cache_budget_bytes,
                                  dtype=trainer.dtype, max_model_tokens=max_model_tokens)
        self._aliased: list[torch.Tensor] = []

    # ----- transitions -----

    @torch.no_grad()
    def to_generation(self) -> TransitionRecord:
        """Build the generation shards and hand them to the engine (no autograd: the
        collectives write into buffers that the training parameters' views must not track)."""
        synchronize()  # the clock starts when the previous operation's kernels are done
        start = time.perf_counter()
        received = 0
        training_bytes = sum(_bytes(p.to_local() if isinstance(p, DTensor) else p)
                             for p in self.trainer.model.parameters())
        gathered = [0]  # bytes the whole tensors' all-gathers received
        if self.mode == "micro_dp":
            weights, received = self._micro_dp_weights()
            self.engine.load(weights)
        elif self.mode == "full" and self.backend == "vllm":
            # One whole tensor at a time, made as vLLM reads it and dropped after: the whole
            # model is never gathered on a GPU at once (issue 31 defect 4). Every rank's
            # engine reads in the same order, so the all-gathers match.
            self.engine.load(self._whole_tensors(gathered))
        else:
            self.engine.load({name: full if self.mode == "full" else self._naive(name, full)
                              for name, full in self._whole_tensors(gathered)})
        received += gathered[0]
        synchronize()  # the all-gathers run asynchronously on GPUs
        seconds = time.perf_counter() - start
        return TransitionRecord(
            mode=self.mode, seconds=seconds, bytes_received_per_gpu=received,
            generation_param_bytes=self.engine.weight_bytes(),
            peak_param_bytes_per_gpu=self._distinct_parameter_bytes(),
            training_param_bytes=training_bytes)

    def _whole_tensors(self, received: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter whole, in the compute dtype (FSDP's fp32 master shards cast
        first), gathered when asked for; adds the bytes each gather received to
        ``received[0]``."""
        for name, param in self.trainer.model.named_parameters():
            param = param.detach().to(self.trainer.dtype)
            local = param.to_local() if isinstance(param, DTensor) else param
            full = param.full_tensor() if isinstance(param, DTensor) else param
            received[0] += _bytes(full) - _bytes(local)
            yield name, full

    def _naive(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's generation shard cut from a whole tensor (DeepSpeed-Chat style)."""
        dim = tp_shard_dim(name)
        return full if dim is None or self.gen_tp == 1 else \
            full.chunk(self.gen_tp, dim=dim)[self.gen_tp_rank].clone()

    def _tp_chunk(self, param: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's training tensor-parallel piece of ``param`` (FSDP's dp shards gathered
        first) and the bytes that gather received."""
        local = param.to_local().detach() if isinstance(param, DTensor) else param.detach()
        if isinstance(param, DTensor) and self.trainer.fsdp:
            # FSDP shards over dp first (under hybrid sharding: over the shard dimension of
            # a (replicate, shard) mesh): gather those (every placement but tensor
            # parallelism's becomes Replicate), cast first to the compute dtype (a trained
            # model's FSDP shards are its fp32 master weights; generation runs in the
            # workload's dtype).
            param = param.detach().to(self.trainer.dtype)
            placements = [p if mesh_dim == "tp" else Replicate() for mesh_dim, p in
                          zip(param.device_mesh.mesh_dim_names or (), param.placements,
                              strict=True)]
            tp_chunk = param.redistribute(param.device_mesh, placements).to_local()
            return tp_chunk, _bytes(tp_chunk) - _bytes(param.to_local())
        return local, 0

    def _micro_dp_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """Every parameter's generation shard, and the bytes this rank received.

        Parameters are taken in order; the ones split along a tensor-parallel dimension fill
        buckets of at most ``transition_bucket_bytes`` gathered, each gathered as soon as it is
        full, so at most one bucket of FSDP-gathered pieces is alive at a time. Every member of
        a micro-DP group holds pieces of equal shapes in the same order, so all members cut
        the same buckets."""
        received = 0
        weights: dict[str, torch.Tensor | None] = {}
        bucket: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        bucket_bytes = 0
        for name, param in self.trainer.model.named_parameters():
            tp_chunk, got = self._tp_chunk(param)
            received += got
            if tp_shard_dim(name) is None or self.micro_dp == 1:
                weights[name] = tp_chunk
                continue
            weights[name] = None  # filled when its bucket is gathered; keeps the order
            gathered = _bytes(tp_chunk) * self.micro_dp
            if bucket and (bucket_bytes + gathered > self.transition_bucket_bytes
                           or tp_chunk.dtype != bucket[0][2].dtype):
                received += self._gather_bucket(bucket, weights)
                bucket, bucket_bytes = [], 0
            bucket.append((name, param, tp_chunk))
            bucket_bytes += gathered
        if bucket:
            received += self._gather_bucket(bucket, weights)
        return {name: shard for name, shard in weights.items() if shard is not None}, received

    def _gather_bucket(self, bucket: list[tuple[str, torch.Tensor, torch.Tensor]],
                       weights: dict[str, torch.Tensor | None]) -> int:
        """One all-gather of this rank's pieces of ``bucket`` within the micro-DP group; puts
        each parameter's generation shard in ``weights``; returns the bytes received."""
        chunks = [chunk for _, _, chunk in bucket]
        # One parameter alone needs no staging copy (reshape of a contiguous piece is a view).
        flat = chunks[0].reshape(-1) if len(chunks) == 1 else \
            torch.cat([chunk.reshape(-1) for chunk in chunks])
        out = torch.empty(self.micro_dp * flat.numel(), dtype=flat.dtype, device=flat.device)
        # torch 2.13's name for all_gather_into_tensor (deprecated there): one flat buffer in,
        # the members' buffers back to back out.
        dist.all_gather_single(out, flat, group=self.micro_dp_group)
        rows = out.view(self.micro_dp, flat.numel())  # row r: member r's pieces, in order
        offset = 0
        for name, param, chunk in bucket:
            dim = tp_shard_dim(name)
            assert dim is not None
            pieces = rows[:, offset:offset + chunk.numel()].view(self.micro_dp, *chunk.shape)
            offset += chunk.numel()
            shape = list(chunk.shape)
            shape[dim] *= self.micro_dp
            # Members' pieces side by side along ``dim``, in micro-DP rank order: the one copy
            # out of the gathered buffer (a view when the bucket is one parameter split along
            # dim 0, whose gathered buffer already is its shard).
            shard = pieces.movedim(0, dim).reshape(shape)
            weights[name] = shard
            if not self.trainer.fsdp and isinstance(param, DTensor):
                # Zero redundancy: the training shard now lives inside the generation shard.
                size = chunk.shape[dim]
                param._local_tensor.data = shard.narrow(dim, self.micro_dp_rank * size, size)
                self._aliased.append(param._local_tensor)
        return _bytes(flat) * (self.micro_dp - 1)

    def _distinct_parameter_bytes(self) -> int:
        if self.backend == "vllm":
            # vLLM's copy lives in its own buffers beside the training shards.
            training = sum(_bytes(p.to_local() if isinstance(p, DTensor) else p)
                           for p in self.trainer.model.parameters())
            return training + self.engine.weight_bytes()
        seen: dict[int, int] = {}
        tensors = list(self.engine.weights.values())
        for param in self.trainer.model.parameters():
            tensors.append(param.to_local() if isinstance(param, DTensor) else param)
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return sum(seen.values())

    def to_training(self) -> None:
        """Free the generation shards; training shards get their own storage back."""
        for local in self._aliased:
            local.data = local.data.clone()
        self._aliased = []
        self.engine.unload()
