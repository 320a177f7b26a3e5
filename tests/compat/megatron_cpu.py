"""Megatron-core on a CPU, for tests only (written for megatron-core 0.16.1).

Megatron-core hard-codes CUDA in a few places that matter for a CPU run: tensors placed on
``torch.cuda.current_device()`` or on a literal ``"cuda"`` (RoPE buffers, the global memory
buffer, DDP's gradient buffers, pipeline messages, the schedules' token counters), CUDA events
and streams in the schedules, the CUDA RNG tracker of tensor-parallel regions, the default
causal mask, ``torch.cuda.FloatTensor`` type checks in the optimizers, and the host copies
of the MoE all-to-all dispatcher's split sizes. ``install()`` redirects those to the CPU, and
lets gloo all-gather parts of different sizes as NCCL does. It changes nothing on a machine
with a GPU.
"""

from __future__ import annotations

import contextlib

import torch

MEGATRON_CORE_VERSION = "0.16.1"
"""The release these shims were written against; ``install`` refuses any other."""

_installed = False


class _NullEvent:
    """torch.cuda.Event stand-in: CPU work is synchronous, so an event is always complete."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def wait(self, *args: object, **kwargs: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0


class _NullStream(_NullEvent):
    """torch.cuda.Stream stand-in."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> _NullEvent:
        return _NullEvent()

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *args: object) -> None:
        pass


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Every ``device="cuda"`` a factory function or ``.to`` is given becomes the CPU, and
    ``.cuda()`` a no-op (the schedules create some tensors with a literal "cuda"). A CPU
    tensor's ``.type()`` answers with the CUDA type name, which the optimizers' type checks
    (``param.type() == "torch.cuda.FloatTensor"``) require."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to and args[1:] and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def install() -> None:
    """Apply the shims (idempotent). Call before building any Megatron object."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    import megatron.core

    if megatron.core.__version__ != MEGATRON_CORE_VERSION:
        raise RuntimeError(f"tests/compat/megatron_cpu.py was written for megatron-core "
                           f"{MEGATRON_CORE_VERSION}, found {megatron.core.__version__}")
    _CudaToCpu().__enter__()  # stays on for the life of the process
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Event = _NullEvent
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by the tests

    # The "CUDA" generator is the CPU one here, so the tracker's check that a forked CUDA
    # state leaves the CPU state alone always fires: silence that one warning.
    import logging

    from megatron.core.tensor_parallel import random as tp_random

    logging.getLogger(tp_random.__name__).setLevel(logging.ERROR)
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask

    # MoE's all-to-all token dispatcher copies its split sizes to the host (as numpy arrays,
    # which ``all_to_all_single`` takes as lists of ints) only when they are CUDA tensors; on
    # the CPU they would reach the collective as tensors, which it refuses.
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    # With experts cut over tensor-parallel ranks (etp > 1) the dispatcher all-gathers each
    # rank's tokens, a different number per rank. NCCL takes such uneven lists; gloo refuses
    # them ("invalid tensor size"): pad every part to the largest, gather, copy back.
    import torch.distributed as dist

    gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or all(t.shape == tensor.shape for t in tensor_list):
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        gather(parts, padded, group=group)
        for target, part in zip(tensor_list, parts, strict=True):
            target.copy_(part[:target.shape[0]])
        return None

    dist.all_gather = all_gather
    _installed = True
