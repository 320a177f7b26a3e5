"""Training checkpoints on the workers: every trained role's weights, master weights and
optimizer states, saved with torch distributed checkpointing (DCP) sharded as trained (each
rank writes its own pieces under its own keys) and loaded back into the same layout.

Both training backends are covered by one walk over their tensors: the model's parameters
(this rank's pieces: DTensor and FSDP shards, Megatron's stage and tensor-parallel slices),
the fp32 master copies, and every torch optimizer inside (its parameters and each state
tensor; Megatron's chained and distributed optimizers hold torch optimizers over their main
parameters). Scalars are stored as 0-dim tensors: the files hold tensors only. DCP's metadata
file is a pickle; it is read back with an unpickler that builds DCP's own metadata classes
and nothing else, so no code in a checkpoint runs.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

SCALAR_TYPES = (int, float, bool)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_megatron(trainer: Any) -> bool:
    return hasattr(trainer, "chunks")


def model_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's pieces of the model's parameters and of the fp32 master copies."""
    out: dict[str, torch.Tensor] = {}
    if _is_megatron(trainer):
        for index, chunk in enumerate(trainer.chunks):
            for name, param in chunk.named_parameters():
                out[f"model/{index}/{name}"] = param.data
    else:
        for name, param in trainer.model.named_parameters():
            out[f"model/{name}"] = _local(param).data
        if getattr(trainer, "main", None) is not None:
            for index, master in enumerate(trainer.main.masters):
                out[f"master/{index}"] = master.data
    return out


def torch_optimizers(trainer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the trainer's optimizer states."""
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [inner.optimizer for inner in chained]


def _optimizer_entries(optimizers: list[torch.optim.Optimizer]
                       ) -> Iterator[tuple[str, torch.optim.Optimizer, dict, torch.Tensor]]:
    for k, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                yield f"optim/{k}/{g}/{p}", optimizer, group, param


def saved_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """Everything a resumed run needs of this rank's training state, as named tensors."""
    out = model_tensors(trainer)
    for prefix, optimizer, _group, param in _optimizer_entries(torch_optimizers(trainer)):
        out[f"{prefix}/param"] = _local(param).data
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}/state/{key}"] = _local(value).data
            elif isinstance(value, SCALAR_TYPES):
                out[f"{prefix}/scalar/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    for k, optimizer in enumerate(torch_optimizers(trainer)):
        for g, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and isinstance(value, SCALAR_TYPES) \
                        and not isinstance(value, bool):
                    out[f"optim/{k}/{g}/group/{key}"] = torch.tensor(float(value),
                                                                     dtype=torch.float64)
    return out


def save(trainer: Any, directory: str | Path) -> int:
    """Write this rank's training state into ``directory`` (a collective over the worker
    group: every rank calls it); returns the bytes this rank wrote."""
    rank = dist.get_rank()
    tensors = {f"rank{rank}/{k}": v for k, v in saved_tensors(trainer).items()}
    dcp.save(tensors, checkpoint_id=str(directory))
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ----- loading -------------------------------------------------------------------------


ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
"""DCP's metadata classes (dataclasses and enums: building one runs no other code)."""
ALLOWED_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                 ("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
                 ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
                 ("torch", "strided"), ("torch", "contiguous_format"),
                 ("torch", "preserve_format"), ("torch", "channels_last"),
                 # A layout by name (getattr on torch), and the checkpoint's own path.
                 ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "WindowsPath"), ("pathlib", "Path")}
"""The other names a DCP metadata file holds (sizes, dtypes, layouts, file locations)."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes, dtypes and layouts; refuses anything else
    (a checkpoint is data: nothing in it may run)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ALLOWED_MODULES or (module, name) in ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a checkpoint's metadata may not name {module}.{name}")


class DataOnlyReader(FileSystemReader):
    """DCP's file reader with its metadata read by ``MetadataUnpickler`` (tensors are read
    as raw bytes by DCP itself)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("not a DCP metadata file")
        if not all(isinstance(entry, TensorStorageMetadata)
                   for entry in metadata.state_dict_metadata.values()):
            # DCP would torch.load a non-tensor entry with weights_only=False; save writes
            # tensors only, so such an entry was not written by this code.
            raise pickle.UnpicklingError("a DCP checkpoint entry that is not a tensor")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(trainer: Any, directory: str | Path) -> None:
    """Fill this rank's training state from ``directory`` (written by ``save`` with the same
    layout; a collective over the worker group). Optimizer states a fresh optimizer has not
    made yet are made with the saved shapes, as the parameters' own kind of tensor."""
    rank = dist.get_rank()
    prefix = f"rank{rank}/"
    reader = DataOnlyReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    mine = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
    tensors = model_tensors(trainer)
    missing = [k for k in tensors if k not in mine]
    if missing:
        raise ValueError(f"the checkpoint in {directory} has no {missing[0]} for rank {rank}: "
                         "it was written by another layout")
    wanted: dict[str, torch.Tensor] = dict(tensors)
    optimizers = torch_optimizers(trainer)
    device_of: dict[str, torch.device] = {}
    for entry, _, _, param in _optimizer_entries(optimizers):
        wanted[f"{entry}/param"] = _local(param).data
        device_of[entry] = _local(param).device
    for key, meta in mine.items():
        if key in wanted:
            continue
        entry = key.split("/state/")[0].split("/scalar/")[0].split("/group/")[0]
        wanted[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype,
                                  device=device_of.get(entry, torch.device("cpu")))
    dcp.load({prefix + k: v for k, v in wanted.items()}, checkpoint_id=str(directory),
             storage_reader=reader)
    for entry, optimizer, _group, param in _optimizer_entries(optimizers):
        state = optimizer.state.setdefault(param, {})
        for key, value in wanted.items():
            if key.startswith(f"{entry}/state/"):
                name = key[len(f"{entry}/state/"):]
                current = state.get(name)
                if current is None:
                    if value.dim() and _local(param).shape == value.shape:
                        # The parameter's own kind of tensor (a DTensor for a DTensor).
                        current = torch.zeros_like(param, dtype=value.dtype)
                    else:
                        current = value.clone()
                    state[name] = current
                _local(current).copy_(value)
            elif key.startswith(f"{entry}/scalar/"):
                state[key[len(f"{entry}/scalar/"):]] = _scalar(value)
    for k, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for key, value in wanted.items():
                if key.startswith(f"optim/{k}/{g}/group/"):
                    group[key.split("/group/")[1]] = _scalar(value)


def _scalar(value: torch.Tensor) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() else number
