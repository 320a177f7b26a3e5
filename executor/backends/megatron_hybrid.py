"""The 3D-HybridEngine on Megatron shards: the actor's training layout (p, t, d) becomes its
generation layout (p_g = 1, t_g, d_g = p * t / t_g) on the same workers (HybridFlow §5).

A micro-DP group is the ranks of one training replica that hold pieces of the same
generation shard: the t / t_g consecutive tensor-parallel ranks of generation tp index g, on
every pipeline stage. Each member broadcasts its pieces to the group (an all-gather of unequal
parts: stages hold different layers, the first stage the embedding), so every rank receives
exactly the generation shard minus what it already holds. Megatron keeps its parameters in
DDP's contiguous buffers, so the generation shard is a second copy beside them (no aliasing as
in the torch engine); the record counts both.

``full`` (vLLM, which cuts its own shards): the micro-DP group is the whole model-parallel
group, i.e. generation tp 1, and every rank gets whole tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from executor.device import synchronize, worker_device
from executor.generation import tp_shard_dim
from executor.hybrid_engine import TransitionRecord, make_engine
from executor.protocols import RankLayout
from simulator.specs.parallel import GenerationConfig


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MegatronHybridEngine:
    """The actor's generation side, fed from its MegatronTrainer's shards."""

    def __init__(self, trainer: Any, generation: GenerationConfig, backend: str = "native",
                 seed: int = 0, *, kv_cache_budget_bytes: int | None = None,
                 max_model_tokens: int | None = None):
        par = trainer.par
        if par.tp % generation.tp:
            raise ValueError(f"generation tp {generation.tp} must divide training tp {par.tp}")
        if generation.pp != 1:
            raise ValueError("the generators run generation pp = 1")
        self.trainer = trainer
        self.backend = backend
        self.mode = "full" if backend == "vllm" else "micro_dp"
        gather_tp = 1 if self.mode == "full" else generation.tp
        world = dist.get_world_size()
        self.layout = RankLayout(world=world, dp=par.dp, tp=par.tp, gen_tp=gather_tp, pp=par.pp)
        rank = dist.get_rank()
        self.gen_tp_rank = self.layout.gen_tp_rank(rank)
        self.micro_dp_rank = self.layout.micro_dp_rank(rank)
        # The controller splits prompts by generation replica (the generation tp, also when
        # the gather is whole for vLLM).
        self.replica = RankLayout(world=world, dp=par.dp, tp=par.tp, gen_tp=generation.tp,
                                  pp=par.pp).replica_of(rank)
        # Every rank creates every group, in the same order (torch.distributed's rule).
        micro_groups: dict[tuple[int, int], list[int]] = {}
        tp_groups: dict[tuple[int, int], list[int]] = {}
        for r in range(world):
            dp_index = self.layout.dp_index(r)
            micro_groups.setdefault((dp_index, self.layout.gen_tp_rank(r)), []).append(r)
            tp_groups.setdefault((dp_index, self.layout.micro_dp_rank(r)), []).append(r)
        self.members: list[int] = []
        self.micro_dp_group = None
        for _key, ranks in sorted(micro_groups.items()):
            ranks = sorted(ranks, key=self.layout.micro_dp_rank)
            group = dist.new_group(ranks)
            if rank in ranks:
                self.members, self.micro_dp_group = ranks, group
        gen_tp_group = None
        for _key, ranks in sorted(tp_groups.items()):
            group = dist.new_group(sorted(ranks, key=self.layout.gen_tp_rank))
            if rank in ranks:
                gen_tp_group = group
        self.engine = make_engine(trainer.spec, generation, backend, seed=seed,
                                  tp_group=gen_tp_group, tp_rank=self.gen_tp_rank,
                                  kv_cache_budget_bytes=kv_cache_budget_bytes,
                                  dtype=trainer.dtype, max_model_tokens=max_model_tokens)
        # What each member contributes: names and shapes are fixed by the layout, so they are
        # exchanged once.
        # Of the tensor-parallel ranks a stage has in the group, the first brings the tensors
        # tensor parallelism leaves whole (norms).
        tp_index = self.layout.coordinates(rank)[2]
        self.replicated = tp_index % (par.tp // gather_tp) == 0
        mine = [(name, tuple(t.shape), t.dtype) for name, t in
                sorted(trainer.local_hf_shards(self.replicated).items())]
        gathered: list[Any] = [None] * len(self.members)
        dist.all_gather_object(gathered, (self.layout.coordinates(rank)[2], mine),
                               group=self.micro_dp_group)
        # Each tensor's pieces: (member, tp index, shape, dtype), the same order on every
        # member, so that they broadcast tensor by tensor in step.
        self.pieces: dict[str, list[tuple[int, int, tuple[int, ...], torch.dtype]]] = {}
        for member, (tp_index, entries) in zip(self.members, gathered, strict=True):
            for name, shape, dtype in entries:
                self.pieces.setdefault(name, []).append((member, tp_index, shape, dtype))
        for parts in self.pieces.values():
            parts.sort(key=lambda part: part[1])
        self.received_bytes = 0
        """Bytes the last transition received from other members."""

    def _generation_tensors(self, local: dict[str, torch.Tensor],
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """The generation shard (whole tensors for vLLM) one tensor at a time: each piece
        broadcast by the member holding it and joined along its tensor-parallel dimension
        (issue 31 defect 4: nothing holds the whole model at once). Every member must
        consume the whole iterator: the broadcasts are collective. ``received_bytes`` counts
        the bytes that arrived from other members."""
        self.received_bytes = 0
        rank = dist.get_rank()
        device = worker_device()
        for name, parts in self.pieces.items():
            tensors = []
            for member, _, shape, dtype in parts:
                if member == rank:
                    tensor = local[name].contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    self.received_bytes += _bytes(tensor)
                if len(self.members) > 1:
                    dist.broadcast(tensor, src=member, group=self.micro_dp_group)
                tensors.append(tensor)
            dim = tp_shard_dim(name)
            yield name, tensors[0] if dim is None or len(tensors) == 1 else \
                torch.cat(tensors, dim=dim)

    def to_generation(self) -> TransitionRecord:
        start = time.perf_counter()
        local = self.trainer.local_hf_shards(self.replicated)
        training_bytes = sum(_bytes(p) for p in self.trainer.local_parameters().values())
        stream = self._generation_tensors(local)
        # vLLM copies each tensor into its own shard as it arrives; the native generator
        # keeps the shard it is given.
        self.engine.load(stream if self.backend == "vllm" else dict(stream))
        synchronize()
        generation_bytes = self.engine.weight_bytes()
        return TransitionRecord(
            mode=self.mode, seconds=time.perf_counter() - start,
            bytes_received_per_gpu=self.received_bytes,
            generation_param_bytes=generation_bytes,
            peak_param_bytes_per_gpu=training_bytes + generation_bytes,
            training_param_bytes=training_bytes)

    def to_training(self) -> None:
        self.engine.unload()
