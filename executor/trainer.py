"""Training / inference backend on torch: DTensor tensor parallelism (``parallelize_module``)
and FSDP2 (``fully_shard``) or replicated data parallelism, on a (dp, tp) device mesh.

Accepted layouts: pp = 1 and vpp = 1 (pipeline parallelism needs the Megatron backend),
sharding ``fsdp`` (FSDP2 over the dp ranks) or ``none`` (replicas, gradients all-reduced over
the dp ranks); tp must divide the heads, the key/value heads, the MLP width and the vocabulary.
Anything else is rejected by ``check_layout`` before a worker starts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from executor.device import shared_mesh, worker_device
from executor.model import CausalLM, InitialWeights, materialise
from profiles.datafile import SpecError
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The workload dtypes the executor computes in (fp16 would need loss scaling)."""


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a workload ``dtype``; SpecError for one the executor cannot run."""
    if name not in COMPUTE_DTYPES:
        raise SpecError(f"the executor computes in {' or '.join(COMPUTE_DTYPES)}; {name} "
                        "needs loss scaling, which it does not run", key="workload.dtype")
    return COMPUTE_DTYPES[name]


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
        # Logits stay split over the vocabulary (a DTensor): log-probabilities are computed
        # with a vocabulary-parallel softmax, never gathering the full logits on a rank.
        plan["lm_head"] = ColwiseParallel(use_local_output=False)
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


def norm_share(param: torch.Tensor) -> float:
    """The fraction of ``param``'s squared gradient norm this rank adds to the global sum:
    1 / (ranks holding the same local piece). A tensor replicated on all ranks counts once;
    a DTensor's copies are the ranks of its mesh's replicated dimensions and the ranks
    outside its mesh."""
    shards = 1
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if placement.is_shard():
                shards *= param.device_mesh.size(dim)
    return shards / dist.get_world_size()


def clip_grad_norm(grads: list[tuple[torch.Tensor, float]], max_norm: float) -> float:
    """Global gradient norm over every rank's shards, in one all-reduce; scales gradients
    down to ``max_norm`` (0: measure only). ``grads``: (local gradient, its ``norm_share``)."""
    squares = torch.zeros((), dtype=torch.float64, device=worker_device())
    for grad, share in grads:
        squares += grad.detach().double().pow(2).sum() * share
    if dist.get_world_size() > 1:
        dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad, _ in grads:
            grad.mul_(scale)
    return norm


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor (the tensor itself when it is not a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MainParams:
    """Megatron's mixed precision for a model whose weights are held in 16 bits: fp32 master
    copies of this rank's shards, which the optimizer updates, and fp32 main gradients the
    micro-batches accumulate into (kept between steps, as Megatron's gradient buffer)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [local(p).detach().float().clone().requires_grad_(True) for p in params]
        for master in self.masters:
            master.grad = torch.zeros_like(master)

    def accumulate(self) -> None:
        """Add the micro-batch's 16-bit gradients into the fp32 main gradients, and free them."""
        for param, master in zip(self.params, self.masters, strict=True):
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                # DTensor's bf16 embedding backward returns the gradient replicated.
                grad = grad.redistribute(param.device_mesh, param.placements)
            master.grad.add_(local(grad))
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The updated master weights, rounded into the model's weights."""
        for param, master in zip(self.params, self.masters, strict=True):
            local(param).copy_(master)


@dataclass(frozen=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Maximum global gradient norm (0: no clipping)."""


LOG_PROB_CHUNK_ROWS = 1024
"""Token positions whose log-softmax over the vocabulary is computed in fp32 at once: with a
152k vocabulary, 1024 positions are 0.6 GB of fp32 transients however long the batch."""


def _chunk_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for rows of logits (rows, vocab), in fp32: the target's logit minus
    the log of the partition function."""
    wide = logits.float()
    return wide.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(wide, dim=-1)


def gathered_log_probs(logits: torch.Tensor, targets: torch.Tensor,
                       chunk_rows: int = LOG_PROB_CHUNK_ROWS) -> torch.Tensor:
    """log p(targets) (batch, tokens) in fp32 from logits (batch, tokens, vocab) in the
    compute dtype, ``chunk_rows`` positions at a time (issue 31 defect 9: a whole
    ``log_softmax(logits.float())`` holds the logits plus two fp32 copies of them). Under
    autograd each chunk is checkpointed, so the backward keeps only the logits themselves
    and recomputes one chunk's fp32 softmax at a time."""
    rows = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    parts = []
    for start in range(0, rows.shape[0], chunk_rows):
        chunk, chunk_targets = rows[start:start + chunk_rows], \
            flat_targets[start:start + chunk_rows]
        if torch.is_grad_enabled() and chunk.requires_grad:
            parts.append(checkpoint(_chunk_log_probs, chunk, chunk_targets,
                                    use_reentrant=False))
        else:
            parts.append(_chunk_log_probs(chunk, chunk_targets))
    return torch.cat(parts).view(targets.shape)


GRADIENT_BUCKET_BYTES = 25 * 1024 * 1024
"""Most gradient bytes replicas all-reduce in one call: DDP's default bucket
(``bucket_cap_mb=25``, torch.nn.parallel.DistributedDataParallel). One flat copy of every
gradient would hold a second copy of them all (issue 31 defect 9)."""


def gradient_buckets(grads: list[torch.Tensor],
                     cap_bytes: int = GRADIENT_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into runs of one dtype and at most ``cap_bytes`` each (a
    tensor larger than the cap is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > cap_bytes or buckets[-1][0].dtype != grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


@torch.no_grad()
def average_in_buckets(grads: list[torch.Tensor], group: Any, replicas: int,
                       cap_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Average ``grads`` over the data-parallel ``group`` in place, one all-reduce per bucket
    (``gradient_buckets``): at most one bucket's flat copy exists at a time."""
    for bucket in gradient_buckets(grads, cap_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(replicas)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        del flat


class Trainer:
    """One model on all ranks of the current process group, laid out as ``par``, computing
    in ``dtype`` (the workload's).

    Precision: in bf16, FSDP2 keeps a trained model's shards in fp32 (they are the
    optimizer's master weights) and casts each layer to bf16 as it gathers it, reducing
    gradients in fp32 (``MixedPrecisionPolicy``); replicated and tensor-parallel layouts hold
    bf16 weights with fp32 master copies and main gradients (``MainParams``, Megatron's
    scheme); models that do not train hold bf16 weights only. Log-probabilities, values and
    losses are computed in fp32. These are the bytes the simulator's memory model counts."""

    def __init__(self, spec: ModelSpec, par: ParallelConfig, *, value_head: bool, seed: int,
                 trainable: bool, optim: OptimConfig | None = None,
                 checkpoint: str | None = None, dtype: str = "fp32"):
        world = dist.get_world_size()
        if par.world_size != world:
            raise SpecError(f"pp*tp*dp = {par.world_size} but the worker group has {world} "
                            "ranks", key="parallel")
        self.spec = spec
        self.par = par
        self.trainable = trainable
        self.dtype = compute_dtype(dtype)
        self.mesh: DeviceMesh = shared_mesh((par.dp, par.tp), ("dp", "tp"))
        self.dp_group = self.mesh.get_group("dp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        # Built on the meta device (shapes only), sharded, then only this rank's shards are
        # allocated on its device and filled, one whole tensor at a time on the host: no
        # host or GPU ever holds the whole model.
        weights = InitialWeights(spec, value_head=value_head, seed=seed, checkpoint=checkpoint)
        with torch.device("meta"):
            model = CausalLM(spec, value_head=value_head)
        if spec.tied_embeddings and not value_head:
            model.lm_head.weight = model.model.embed_tokens.weight
        # recompute: full keeps each layer's input only and recomputes the layer in the
        # backward, as the planner prices it (issue 31 defect 9: it was ignored). selective
        # (Megatron's: the attention scores recomputed) has nothing to drop here: torch's
        # scaled_dot_product_attention keeps no scores on GPUs (flash / memory-efficient).
        model.recompute_layers = trainable and par.recompute == "full"
        self.fsdp = par.sharding == "fsdp" and par.dp > 1
        if not (self.fsdp and trainable):
            model.to(self.dtype)
        tp_mesh, shard_mesh = self._tp_and_shard_meshes(par)
        if par.tp > 1:
            parallelize_module(model, tp_mesh, tensor_parallel_plan(spec, value_head))
            if spec.tied_embeddings and not value_head:
                model.lm_head.weight = model.model.embed_tokens.weight
        if self.fsdp:
            policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=shard_mesh, mp_policy=policy)
            fully_shard(model, mesh=shard_mesh, mp_policy=policy)
        model.to_empty(device=worker_device())
        if spec.tied_embeddings and not value_head and not self.fsdp:
            model.lm_head.weight = model.model.embed_tokens.weight  # to_empty untied them
        materialise(model, weights)
        if not trainable:
            model.requires_grad_(False)
        self.model: CausalLM = model
        self.optim = optim or OptimConfig()
        params = list(model.parameters())
        self.shares = [norm_share(p) for p in params]
        self.main: MainParams | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if trainable:
            if self.dtype != torch.float32 and not self.fsdp:
                self.main = MainParams(params)
                groups = [self.main.masters]
            else:
                # foreach kernels take one kind of tensor per group: DTensor shards apart
                # from the plain tensors tensor parallelism leaves replicated (norms).
                groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                                      [p for p in params if not isinstance(p, DTensor)]) if g]
                if not self.fsdp:
                    for p in params:  # resident gradients, as Megatron's gradient buffer
                        p.grad = torch.zeros_like(p)
            self.optimizer = torch.optim.AdamW([{"params": g} for g in groups],
                                               lr=self.optim.lr,
                                               weight_decay=self.optim.weight_decay,
                                               foreach=True)

    def _tp_and_shard_meshes(self, par: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh]:
        """The tensor-parallel mesh and the mesh FSDP2 shards over: the dp dimension, or under
        hybrid sharding the (replicate, shard) dimensions of a (replicate, shard, tp) mesh,
        on which ``fully_shard`` shards inside a group and all-reduces across groups. Its
        ranks are the (dp, tp) mesh's (dp rank = replicate * shard size + shard rank), and
        tensor parallelism takes its dimension from the same mesh, as FSDP2 wants."""
        if not par.fsdp_size:
            return self.mesh["tp"], self.mesh["dp"]
        hybrid = shared_mesh((par.fsdp_replicas, par.fsdp_shards, par.tp),
                             ("replicate", "shard", "tp"))
        return hybrid["tp"], hybrid["replicate", "shard"]

    # ----- forward -----

    def token_log_probs(self, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """log p(token_t | tokens_<t) for t >= 1: shape (batch, tokens - 1), in fp32
        (``attention_mask``: 0 on left padding)."""
        logits = self.model(input_ids, attention_mask)
        targets = input_ids[:, 1:]
        if isinstance(logits, DTensor):
            # Vocabulary-parallel: each rank holds a slice of every position's logits; the
            # softmax's max and sum and the target's logit are all-reduced, not the logits.
            shaped = logits[:, :-1].float().flatten(0, 1)
            with loss_parallel():
                nll = F.cross_entropy(shaped, targets.flatten(), reduction="none")
            return -local(nll).view_as(targets)
        return gathered_log_probs(logits[:, :-1], targets)

    def token_values(self, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Value of each prefix (batch, tokens)."""
        return self.model(input_ids, attention_mask).float()

    def micro_batches(self, size: int, micro: int) -> Iterator[slice]:
        for start in range(0, size, micro):
            yield slice(start, min(size, start + micro))

    @torch.no_grad()
    def infer(self, input_ids: torch.Tensor, micro: int, values: bool,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()

        def mask(s: slice) -> torch.Tensor | None:
            return None if attention_mask is None else attention_mask[s]

        parts = [self.token_values(input_ids[s], mask(s)) if values else
                 self.token_log_probs(input_ids[s], mask(s))
                 for s in self.micro_batches(len(input_ids), micro)]
        if self.fsdp:
            # FSDP2 keeps the root's gathered weights (embedding, head) after a forward that
            # no backward follows: free them, as the planner assumes between operations.
            self.model.reshard()
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
        params = list(self.model.parameters())
        total = sum(len(b["input_ids"]) for b in batches)
        metrics: dict[str, float] = {}
        for micro in batches:
            loss, stats = loss_fn(self, micro)
            # The vocabulary-parallel softmax's backward runs under the same context.
            with loss_parallel() if self.par.tp > 1 else contextlib.nullcontext():
                (loss * len(micro["input_ids"]) / total).backward()
            if self.main is not None:
                self.main.accumulate()
            for key, value in stats.items():
                metrics[key] = metrics.get(key, 0.0) + float(value) * len(micro["input_ids"]) \
                    / total
        grads = (self.main.masters if self.main is not None else params)
        pairs = [(local(p.grad), share) for p, share in zip(grads, self.shares, strict=True)
                 if p.grad is not None]
        if self.par.dp > 1 and not self.fsdp:
            average_in_buckets([g for g, _ in pairs], self.dp_group, self.par.dp)
        metrics["grad_norm"] = clip_grad_norm(pairs, self.optim.grad_clip)
        self.optimizer.step()
        if self.main is not None:
            self.main.copy_to_model()
        # FSDP frees its gradients until the next step (the simulator counts them only while
        # the model trains); the other layouts keep theirs, zeroed, as Megatron does. (Not
        # Optimizer.zero_grad: its foreach zeroing mixes DTensors with plain tensors.)
        for p in grads:
            if self.fsdp:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        return metrics

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Whole tensors under Hugging Face names, on every rank (gathered from the shards;
        in the compute dtype)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                .to(self.dtype) for name, p in self.model.named_parameters()}

    # ----- offload -----

    @torch.no_grad()
    def offload(self, *, optimizer: bool, grads: bool) -> int:
        """Move the states only training uses to host memory while generation runs (the
        framework profile's ``offload``): optimizer states with the fp32 master weights,
        and the resident gradients. Returns the bytes moved; ``reload`` brings them back."""
        moved = 0
        host = torch.device("cpu")
        if optimizer and self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        moved += local(value).numel() * value.element_size()
                        state[key] = value.to(host, non_blocking=True)
            if self.main is not None:
                for master in self.main.masters:
                    moved += master.numel() * master.element_size()
                    master.data = master.data.to(host, non_blocking=True)
        if grads:
            holders = self.main.masters if self.main is not None else \
                list(self.model.parameters())
            for holder in holders:
                if holder.grad is not None and not isinstance(holder.grad, DTensor):
                    moved += holder.grad.numel() * holder.grad.element_size()
                    holder.grad.data = holder.grad.data.to(host, non_blocking=True)
        return moved

    @torch.no_grad()
    def reload(self) -> None:
        """Bring back what ``offload`` moved to host memory."""
        device = worker_device()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and \
                            value.device != device:
                        state[key] = value.to(device, non_blocking=True)
        holders = (self.main.masters if self.main is not None else
                   list(self.model.parameters()))
        for holder in holders:
            if holder.device != device:
                holder.data = holder.data.to(device, non_blocking=True)
            if holder.grad is not None and not isinstance(holder.grad, DTensor) and \
                    holder.grad.device != device:
                holder.grad.data = holder.grad.data.to(device, non_blocking=True)

    def resident_bytes(self) -> int:
        """Bytes of this rank's states on its device (what offloading frees)."""
        device = worker_device()
        return sum(n for n, where in self._state_tensors() if where == device)

    def _state_tensors(self) -> Iterator[tuple[int, torch.device]]:
        """(bytes, device) of every parameter, gradient and optimizer tensor of this rank."""
        for p in self.model.parameters():
            yield local(p).numel() * p.element_size(), local(p).device
            if p.grad is not None:
                yield local(p.grad).numel() * p.grad.element_size(), local(p.grad).device
        if self.main is not None:
            for m in self.main.masters:
                yield m.numel() * m.element_size(), m.device
                yield m.grad.numel() * m.grad.element_size(), m.grad.device
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield local(v).numel() * v.element_size(), local(v).device

    # ----- state -----

    def local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (plain tensors)."""
        return {name: (p.to_local() if isinstance(p, DTensor) else p).detach()
                for name, p in self.model.named_parameters()}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradients (fp32 main gradients included),
        optimizer states (fp32 master weights included)."""
        def size(t: torch.Tensor) -> int:
            t = local(t)
            return t.numel() * t.element_size()

        params = sum(size(p) for p in self.model.parameters())
        grads = sum(size(p.grad) for p in self.model.parameters() if p.grad is not None)
        optimizer = 0
        if self.main is not None:
            grads += sum(size(m.grad) for m in self.main.masters)
            optimizer += sum(size(m) for m in self.main.masters)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                optimizer += sum(size(v) for v in state.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optimizer}
