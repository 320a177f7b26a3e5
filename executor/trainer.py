"""Training / inference backend on torch: DTensor tensor parallelism (``parallelize_module``)
and FSDP2 (``fully_shard``) or replicated data parallelism, on a (dp, tp) device mesh.

Accepted layouts: pp = 1 and vpp = 1 (pipeline parallelism needs the Megatron backend),
sharding ``fsdp`` (FSDP2 over the dp ranks) or ``none`` (replicas, gradients all-reduced over
the dp ranks); tp must divide the heads, the key/value heads, the MLP width and the vocabulary.
Anything else is rejected by ``check_layout`` before a worker starts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from executor.device import shared_mesh, worker_device
from executor.model import CausalLM, build_model
from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def check_layout(spec: ModelSpec, par: ParallelConfig, key: str,
                 generation: GenerationConfig | None = None) -> None:
    """Reject layouts the torch backend cannot run, naming the setting."""
    if par.pp != 1 or par.vpp != 1:
        raise SpecError(f"pp={par.pp} needs pipeline parallelism, which the torch (FSDP2 / "
                        "DTensor) backend does not run; give the role training_backend: "
                        "megatron, or use pp: 1 (plan with --backend fsdp)",
                        key=f"{key}.pp")
    if par.sequence_parallel and par.tp > 1:
        raise SpecError("the torch backend runs tensor parallelism without sequence "
                        "parallelism; set sequence_parallel: false (plan with --backend fsdp)",
                        key=f"{key}.sequence_parallel")
    if par.sharding == "optimizer":
        raise SpecError("the torch backend shards with FSDP (sharding: fsdp) or not at all "
                        "(sharding: none); the distributed optimizer needs the Megatron "
                        "backend (training_backend: megatron; or plan with --backend fsdp)",
                        key=f"{key}.sharding")
    sizes = {"heads": spec.heads, "kv_heads": spec.kv_heads, "ffn_hidden": spec.ffn_hidden,
             "vocab": spec.vocab}
    for label, tp in (("tp", par.tp), ("generation tp", generation.tp if generation else 1)):
        for name, size in sizes.items():
            if size % tp:
                raise SpecError(f"{label}={tp} does not divide {name}={size} of {spec.name}",
                                key=f"{key}.tp")
    if generation is not None and generation.pp != 1:
        raise SpecError("the native generation backend runs generation pp = 1",
                        key=f"{key}.generation.pp")


def tensor_parallel_plan(spec: ModelSpec, value_head: bool) -> dict:
    """Megatron-style column/row split of every block, vocabulary-parallel embedding/head."""
    plan: dict = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    if not value_head:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(), p + "mlp.down_proj": RowwiseParallel(),
        })
        if spec.mlp == "swiglu":
            plan[p + "mlp.gate_proj"] = ColwiseParallel()
    return plan


def move_plain_tensors(model: torch.nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers that are plain tensors (not DTensor shards, which
    already live on their mesh's device) to ``device``, keeping tied parameters tied."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor) or param.device == device:
                continue
            if id(param) not in moved:
                moved[id(param)] = torch.nn.Parameter(param.detach().to(device),
                                                      requires_grad=param.requires_grad)
            module._parameters[name] = moved[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient norm over every rank's shards, in one all-reduce; scales gradients
    down to ``max_norm`` (0: measure only).

    Each rank adds its local squares divided by how many ranks hold the same shard (a
    tensor replicated on all ranks counts once; a DTensor's copies are the ranks of its
    mesh's replicated dimensions and the ranks outside its mesh)."""
    world = dist.get_world_size()
    squares = torch.zeros((), dtype=torch.float64, device=worker_device())
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            shards = 1
            for dim, placement in enumerate(grad.placements):
                if placement.is_shard():
                    shards *= grad.device_mesh.size(dim)
            local = grad.to_local()
        else:
            shards, local = 1, grad
        squares += local.detach().double().pow(2).sum() * shards / world
    if world > 1:
        dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


@dataclass(frozen=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Maximum global gradient norm (0: no clipping)."""


class Trainer:
    """One model on all ranks of the current process group, laid out as ``par``."""

    def __init__(self, spec: ModelSpec, par: ParallelConfig, *, value_head: bool, seed: int,
                 trainable: bool, optim: OptimConfig | None = None,
                 checkpoint: str | None = None):
        world = dist.get_world_size()
        if par.world_size != world:
            raise SpecError(f"pp*tp*dp = {par.world_size} but the worker group has {world} "
                            "ranks", key="parallel")
        self.spec = spec
        self.par = par
        self.trainable = trainable
        self.mesh: DeviceMesh = shared_mesh((par.dp, par.tp), ("dp", "tp"))
        self.dp_group = self.mesh.get_group("dp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        # Built on the CPU: tensor parallelism and FSDP move each parameter's shard (FSDP:
        # each unit) to the device as they split it, so no GPU ever holds the whole model.
        model = build_model(spec, value_head=value_head, seed=seed, checkpoint=checkpoint)
        self.fsdp = par.sharding == "fsdp" and par.dp > 1
        if par.tp == 1 and not self.fsdp:
            model.to(worker_device())  # a whole replica per GPU anyway
        if par.tp > 1:
            parallelize_module(model, self.mesh["tp"], tensor_parallel_plan(spec, value_head))
            if spec.tied_embeddings and not value_head:
                model.lm_head.weight = model.model.embed_tokens.weight
        if self.fsdp:
            for layer in model.model.layers:
                fully_shard(layer, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
        move_plain_tensors(model, worker_device())  # e.g. norms, which tp leaves replicated
        if not trainable:
            model.requires_grad_(False)
        self.model: CausalLM = model
        self.optim = optim or OptimConfig()
        # foreach=False: parameters mix plain tensors (norms) and DTensors (sharded weights).
        self.optimizer = (torch.optim.AdamW(model.parameters(), lr=self.optim.lr,
                                            weight_decay=self.optim.weight_decay,
                                            foreach=False)
                          if trainable else None)

    # ----- forward -----

    def token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log p(token_t | tokens_<t) for t >= 1: shape (batch, tokens - 1)."""
        logits = self.model(input_ids).float()
        return torch.log_softmax(logits[:, :-1], dim=-1).gather(
            -1, input_ids[:, 1:, None]).squeeze(-1)

    def token_values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Value of each prefix (batch, tokens)."""
        return self.model(input_ids).float()

    def micro_batches(self, size: int, micro: int) -> Iterator[slice]:
        for start in range(0, size, micro):
            yield slice(start, min(size, start + micro))

    @torch.no_grad()
    def infer(self, input_ids: torch.Tensor, micro: int, values: bool) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        parts = [self.token_values(input_ids[s]) if values else
                 self.token_log_probs(input_ids[s])
                 for s in self.micro_batches(len(input_ids), micro)]
        self.model.train(was_training)
        return torch.cat(parts)

    # ----- training -----

    def step(self, batches: list[dict[str, torch.Tensor]],
             loss_fn: Callable[[Trainer, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
             ) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (gradients averaged over them
        and, when replicated, over the data-parallel ranks)."""
        assert self.optimizer is not None
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = sum(len(b["input_ids"]) for b in batches)
        metrics: dict[str, float] = {}
        for micro in batches:
            loss, stats = loss_fn(self, micro)
            (loss * len(micro["input_ids"]) / total).backward()
            for key, value in stats.items():
                metrics[key] = metrics.get(key, 0.0) + float(value) * len(micro["input_ids"]) \
                    / total
        if self.par.dp > 1 and not self.fsdp:
            # Replicas average their gradients in one bucket, as DDP does.
            grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                     for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.par.dp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        norm = clip_grad_norm(list(self.model.parameters()), self.optim.grad_clip)
        metrics["grad_norm"] = norm
        self.optimizer.step()
        return metrics

    # ----- state -----

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (plain tensors)."""
        return {name: (p.to_local() if isinstance(p, DTensor) else p).detach()
                for name, p in self.model.named_parameters()}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradients, optimizer states."""
        def size(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = sum(size(p) for p in self.model.parameters())
        grads = sum(size(p.grad) for p in self.model.parameters() if p.grad is not None)
        optimizer = 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                optimizer += sum(size(v) for v in state.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optimizer}
