"""Batch: named tensors sharing their first dimension, plus metadata. It is what travels
between the controller and the workers (through Ray's object store)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """Rows of named tensors (every tensor has the same length) and free-form metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {name: len(t) for name, t in self.tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"tensors of a batch must have the same length, got {lengths}")

    def __reduce__(self) -> tuple:
        # Tensors travel as numpy arrays: Ray serialises those without copies and an order
        # of magnitude faster than pickled torch tensors (bfloat16 keeps torch's pickling).
        arrays = {n: t.detach().cpu().numpy() if t.dtype != torch.bfloat16 else t.cpu()
                  for n, t in self.tensors.items()}
        return (_from_arrays, (arrays, self.meta))

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device`` (no copy where already there)."""
        return Batch({n: t.to(device) for n, t in self.tensors.items()}, self.meta)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values()))) if self.tensors else 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        """The column ``name``, or ``default`` when the batch has none."""
        return self.tensors.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def __or__(self, other: Batch) -> Batch:
        """Union of the columns of two batches with the same rows."""
        if self.tensors and other.tensors and len(self) != len(other):
            raise ValueError(f"cannot join batches of {len(self)} and {len(other)} rows")
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta})

    def select(self, *names: str) -> Batch:
        return Batch({n: self.tensors[n] for n in names}, dict(self.meta))

    def rows(self, index: slice | torch.Tensor) -> Batch:
        return Batch({n: t[index] for n, t in self.tensors.items()}, dict(self.meta))

    def split(self, parts: int) -> list[Batch]:
        """``parts`` consecutive chunks of equal size (the rows must divide evenly)."""
        if parts <= 0 or len(self) % parts:
            raise ValueError(f"{len(self)} rows do not split into {parts} equal parts")
        size = len(self) // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def chunks(self, size: int) -> Iterator[Batch]:
        """Consecutive chunks of at most ``size`` rows."""
        for start in range(0, len(self), size):
            yield self.rows(slice(start, start + size))

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Rows of all batches in order; metadata from the first (lists are concatenated)."""
        batches = [b for b in batches if b.tensors]
        if not batches:
            return Batch()
        names = list(batches[0].tensors)
        for b in batches[1:]:
            if list(b.tensors) != names:
                raise ValueError(f"cannot concatenate batches with columns {names} and "
                                 f"{list(b.tensors)}")
        width = {n: max(b.tensors[n].shape[1] if b.tensors[n].dim() > 1 else 0
                        for b in batches) for n in names}
        tensors = {n: torch.cat([_pad_to(b.tensors[n], width[n]) for b in batches])
                   for n in names}
        return Batch(tensors, dict(batches[0].meta))

    def repeat(self, times: int) -> Batch:
        """Each row ``times`` times in a row (GRPO's group of samples per prompt)."""
        return Batch({n: t.repeat_interleave(times, dim=0) for n, t in self.tensors.items()},
                     dict(self.meta))

    def pad_rows(self, multiple: int) -> tuple[Batch, int]:
        """Repeat the last row until the length is a multiple of ``multiple``; returns the
        padded batch and how many rows were added (drop them after collecting)."""
        extra = (-len(self)) % multiple
        if extra == 0:
            return self, 0
        last = self.rows(slice(len(self) - 1, len(self)))
        return Batch.concat([self, *([last] * extra)]), extra


def _pad_to(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad the second dimension with zeros (sequences of different lengths)."""
    if tensor.dim() < 2 or tensor.shape[1] == width:
        return tensor
    pad = torch.zeros((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]),
                      dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=1)


def _from_arrays(arrays: dict[str, Any], meta: dict[str, Any]) -> Batch:
    def tensor(array: Any) -> torch.Tensor:
        if isinstance(array, torch.Tensor):
            return array
        # Arrays read from Ray's object store are read-only views; tensors must be writable.
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    return Batch({n: tensor(a) for n, a in arrays.items()}, meta)
