"""Per-GPU memory: a breakdown by kind, and the 'does not fit' message that explains why."""

from __future__ import annotations

from dataclasses import dataclass, fields

GIB = 1024**3


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryBreakdown:
    """Bytes per GPU, by kind."""

    params: float = 0.0
    """Model weights (training shard, inference weights, or generation weights)."""
    grads: float = 0.0
    """Gradients (fp32 main gradients in mixed precision)."""
    optimizer: float = 0.0
    """Adam moments and fp32 master weights."""
    activations: float = 0.0
    """Saved activations, logits and temporary buffers of the running operation."""
    kv_cache: float = 0.0
    """Key/value cache of generation."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        # Field by field, spelled out: the search adds breakdowns in its inner loops.
        return MemoryBreakdown(params=self.params + other.params,
                               grads=self.grads + other.grads,
                               optimizer=self.optimizer + other.optimizer,
                               activations=self.activations + other.activations,
                               kv_cache=self.kv_cache + other.kv_cache)

    def __sub__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(params=self.params - other.params,
                               grads=self.grads - other.grads,
                               optimizer=self.optimizer - other.optimizer,
                               activations=self.activations - other.activations,
                               kv_cache=self.kv_cache - other.kv_cache)

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out

    def describe(self) -> str:
        """'params A, optimizer B, ...' in GiB, skipping empty kinds."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value > 0:
                parts.append(f"{f.name.replace('_', ' ')} {value / GIB:.1f}")
        return ", ".join(parts) or "nothing"


def does_not_fit_message(what: str, needed: MemoryBreakdown, available_bytes: float) -> str:
    """'X does not fit: needs N GiB per GPU, has M GiB (params A, optimizer B, ...)'."""
    return (f"{what} does not fit: needs {needed.total / GIB:.1f} GiB per GPU, has "
            f"{available_bytes / GIB:.1f} GiB ({needed.describe()})")


def stack(*parts: MemoryBreakdown) -> MemoryBreakdown:
    total = MemoryBreakdown()
    for part in parts:
        total = total + part
    return total
