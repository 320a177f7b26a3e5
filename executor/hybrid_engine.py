"""3D-HybridEngine: the actor switches between its training layout (p, t, d) and its
generation layout (p_g, t_g, d_g) on the same workers (HybridFlow §5).

Ranks form a (dp, gen_tp, micro_dp) mesh: micro-DP groups are consecutive ranks and generation
TP groups take every micro_dp-th rank, so the training shards a micro-DP group holds are
exactly one generation shard. The transition all-gathers within micro-DP groups only and the
rank's own training shard becomes a view into its generation shard: no second copy of the
weights. Back in training mode the view is copied out and the generation shard freed.
``naive`` mode instead gathers the full weights on every rank and slices (DeepSpeed-Chat style).

Transitions record what they did: bytes each rank received, seconds, parameter bytes per rank
during generation (distinct storages, so aliasing is counted once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from executor.device import shared_mesh, synchronize
from executor.generation import GenerationEngine, tp_shard_dim
from executor.trainer import Trainer
from simulator.specs.parallel import GenerationConfig

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
                tp_group: Any, tp_rank: int) -> Any:
    """The generator: the native sampler on this rank's generation shard (its generation tp
    group given), or vLLM fed whole tensors (it forms its own tensor-parallel groups)."""
    if backend == "vllm":
        from executor.backends.vllm import VLLMEngine

        return VLLMEngine(spec, tp_size=generation.tp, seed=seed,
                          dtype=torch.float32)  # the trainers compute in fp32
    return GenerationEngine(spec, tp_group=tp_group, tp_size=generation.tp, tp_rank=tp_rank)


class HybridEngine:
    """The actor's generation side, fed from its trainer's shards."""

    def __init__(self, trainer: Trainer, generation: GenerationConfig,
                 mode: TransitionMode = "micro_dp", backend: str = "native", seed: int = 0):
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
        if backend == "vllm":
            # vLLM holds its own copy of the weights and cuts its own tensor-parallel shards
            # from whole tensors: the transition gathers every tensor whole.
            self.mode = "full"
        self.engine = make_engine(trainer.spec, generation, backend, seed=seed,
                                  tp_group=self.mesh.get_group("gen_tp"),
                                  tp_rank=self.gen_tp_rank)
        self._aliased: list[torch.Tensor] = []

    # ----- transitions -----

    def to_generation(self) -> TransitionRecord:
        start = time.perf_counter()
        received = 0
        weights: dict[str, torch.Tensor] = {}
        training_bytes = 0
        for name, param in self.trainer.model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param.detach()
            training_bytes += _bytes(local)
            if self.mode == "full":
                shard = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                got = _bytes(shard) - _bytes(local)
            elif self.mode == "naive":
                shard, got = self._naive(name, param, local)
            else:
                shard, got = self._micro_dp(name, param, local)
            received += got
            weights[name] = shard
        self.engine.load(weights)
        synchronize()  # the all-gathers run asynchronously on GPUs
        seconds = time.perf_counter() - start
        return TransitionRecord(
            mode=self.mode, seconds=seconds, bytes_received_per_gpu=received,
            generation_param_bytes=self.engine.weight_bytes(),
            peak_param_bytes_per_gpu=self._distinct_parameter_bytes(),
            training_param_bytes=training_bytes)

    def _naive(self, name: str, param: torch.Tensor,
               local: torch.Tensor) -> tuple[torch.Tensor, int]:
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        dim = tp_shard_dim(name)
        shard = full if dim is None or self.gen_tp == 1 else \
            full.chunk(self.gen_tp, dim=dim)[self.gen_tp_rank].clone()
        return shard, _bytes(full) - _bytes(local)

    def _micro_dp(self, name: str, param: torch.Tensor,
                  local: torch.Tensor) -> tuple[torch.Tensor, int]:
        received = 0
        if isinstance(param, DTensor) and self.trainer.fsdp:
            # FSDP shards over dp first: gather those (the dp placement becomes Replicate).
            placements = [Replicate() if mesh_dim == "dp" else p for mesh_dim, p in
                          zip(param.device_mesh.mesh_dim_names or (), param.placements,
                              strict=True)]
            tp_chunk = param.redistribute(param.device_mesh, placements).to_local()
            received += _bytes(tp_chunk) - _bytes(local)
        else:
            tp_chunk = local
        dim = tp_shard_dim(name)
        if dim is None or self.micro_dp == 1 or self.trainer.par.tp == 1:
            return tp_chunk, received
        parts = [torch.empty_like(tp_chunk) for _ in range(self.micro_dp)]
        dist.all_gather(parts, tp_chunk.contiguous(), group=self.micro_dp_group)
        received += _bytes(tp_chunk) * (self.micro_dp - 1)
        shard = torch.cat(parts, dim=dim)
        if not self.trainer.fsdp and isinstance(param, DTensor):
            # Zero redundancy: the training shard now lives inside the generation shard.
            size = tp_chunk.shape[dim]
            view = shard.narrow(dim, self.micro_dp_rank * size, size)
            param._local_tensor.data = view
            self._aliased.append(param._local_tensor)
        return shard, received

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
