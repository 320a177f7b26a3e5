"""Device profiles: what a GPU (or CPU) can do, from spec sheets and from measurements.

A profile is a YAML file (see ``profiles/devices/``). Peaks come from public specifications;
efficiency curves say which fraction of a peak an operation of a given size achieves;
``corrections`` are multiplicative factors fitted to measured runs (calibration), recorded with
their provenance. A profile may carry what one GPU costs to hire (``price_per_gpu_hour``) with
where that number comes from (``price_source``), for cost-aware planning.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from profiles.datafile import (
    SpecError,
    convert,
    did_you_mean,
    from_mapping,
    read_mapping,
    require,
)

DEVICES_DIR = Path(__file__).resolve().parent / "devices"
"""Where the shipped profiles live; extra directories come from ``$HYBRIDFLOW_PROFILE_PATH``."""

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
"""Bytes per element of each dtype name used in profiles and workloads."""


def _parse_points(value: object, key: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list) or not value:
        raise SpecError("expected a non-empty list of [size, fraction] pairs", key=key)
    points = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 2:
            raise SpecError(f"item {i} must be a pair [size, fraction], got {item!r}", key=key)
        size = convert(item[0], float, f"{key}[{i}][0]")
        fraction = convert(item[1], float, f"{key}[{i}][1]")
        if size <= 0:
            raise SpecError(f"item {i}: size must be > 0, got {item[0]}", key=key)
        if not 0 < fraction <= 1.5:
            raise SpecError(f"item {i}: fraction must be in (0, 1.5], got {item[1]}", key=key)
        points.append((size, fraction))
    sizes = [p[0] for p in points]
    if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
        raise SpecError("sizes must be strictly increasing", key=key)
    for (s0, f0), (s1, f1) in itertools.pairwise(points):
        if f1 / f0 > s1 / s0:
            raise SpecError(f"the fraction rises faster than the size between {s0:g} and {s1:g}, "
                            "so the larger operation would take less time", key=key)
    return tuple(points)


@dataclass(kw_only=True, slots=True, frozen=True)
class EfficiencyCurve:
    """Achieved fraction of a peak as a function of operation size.

    Interpolated as a power law between points (linear in log-size / log-fraction) and held
    constant beyond the ends, so that an operation's time, size / fraction, never decreases as
    its size grows (the loader rejects points that would break this).
    """

    points: tuple[tuple[float, float], ...] = field(metadata={"parse": _parse_points})
    """(size, fraction) pairs, sizes strictly increasing; the size's unit depends on the curve."""

    _sizes: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _fractions: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _slopes: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """d log(fraction) / d log(size) of each segment (the power law's exponent)."""

    def __post_init__(self) -> None:
        sizes = tuple(p[0] for p in self.points)
        fractions = tuple(p[1] for p in self.points)
        slopes = tuple(math.log(f1 / f0) / math.log(s1 / s0) for (s0, f0), (s1, f1)
                       in itertools.pairwise(self.points))
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_fractions", fractions)
        object.__setattr__(self, "_slopes", slopes)

    def at(self, size: float) -> float:
        """Fraction of peak achieved by an operation of ``size`` (same unit as the points)."""
        # Hot path of every cost model (the search calls it millions of times): one bisect
        # and one power, f0 * (size / s0) ** slope, instead of logs and an exponential.
        sizes = self._sizes
        if size <= sizes[0]:
            return self._fractions[0]
        if size >= sizes[-1]:
            return self._fractions[-1]
        i = bisect.bisect_right(sizes, size) - 1
        return self._fractions[i] * (size / sizes[i]) ** self._slopes[i]

    def at_many(self, sizes: np.ndarray) -> np.ndarray:
        """``at`` of each of ``sizes`` (the same formula, elementwise)."""
        points = np.asarray(self._sizes)
        if len(points) == 1:
            return np.full(len(sizes), self._fractions[0])
        segment = np.clip(np.searchsorted(points, sizes, side="right") - 1, 0,
                          len(points) - 2)
        fractions = np.asarray(self._fractions)
        inside = fractions[segment] * (sizes / points[segment]) ** np.asarray(
            self._slopes)[segment]
        return np.where(sizes <= points[0], fractions[0],
                        np.where(sizes >= points[-1], fractions[-1], inside))

    @classmethod
    def constant(cls, fraction: float) -> EfficiencyCurve:
        return cls(points=((1.0, fraction),))


def _curve(value: object, key: str) -> EfficiencyCurve:
    return EfficiencyCurve(points=_parse_points(value, key))


@dataclass(kw_only=True, slots=True, frozen=True)
class EfficiencyCurves:
    """Measured or published achieved fractions of peak, per kind of operation."""

    matmul: EfficiencyCurve = field(metadata={"parse": _curve})
    """Dense matrix multiplication; size = FLOPs of one GEMM (2*m*n*k)."""
    attention: EfficiencyCurve = field(metadata={"parse": _curve})
    """Fused (flash) attention kernels; size = FLOPs of one call."""
    memory: EfficiencyCurve = field(metadata={"parse": _curve})
    """Memory-bound kernels (elementwise, decode GEMV, optimizer); size = bytes moved per call."""
    intra_node_collective: EfficiencyCurve = field(metadata={"parse": _curve})
    """Collectives within a node; size = message bytes; fraction of ``intra_node`` bandwidth."""
    inter_node_collective: EfficiencyCurve = field(metadata={"parse": _curve})
    """Collectives across nodes; size = message bytes; fraction of ``inter_node`` bandwidth."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Link:
    """A communication link seen from one device."""

    bandwidth_bytes_per_s: float
    """Unidirectional bandwidth per device, in bytes/s (the 'bus bandwidth' of nccl-tests)."""
    latency_seconds: float
    """Latency of one message (one ring step), in seconds."""

    def __post_init__(self) -> None:
        require(self.bandwidth_bytes_per_s > 0, "must be > 0", "bandwidth_bytes_per_s")
        require(self.latency_seconds >= 0, "must be >= 0", "latency_seconds")


@dataclass(kw_only=True, slots=True, frozen=True)
class HostLink:
    """Copies between one device and its host's memory (PCIe), as frameworks use them to
    offload training states or park weights between phases."""

    pinned_bytes_per_s: float
    """Copy rate to or from page-locked host memory (DMA at the link's rate), bytes/s."""
    pageable_bytes_per_s: float
    """Copy rate to or from ordinary (pageable) host memory that is already mapped: the driver
    stages it through a pinned buffer, so the host's memcpy limits it, bytes/s."""
    page_fault_seconds: float = 0.0
    """Extra seconds per 4 KiB page when a copy writes pageable host memory that was just
    allocated (``tensor.to("cpu")``): the kernel maps every page on first touch."""

    def __post_init__(self) -> None:
        require(self.pinned_bytes_per_s > 0, "must be > 0", "pinned_bytes_per_s")
        require(self.pageable_bytes_per_s > 0, "must be > 0", "pageable_bytes_per_s")
        require(self.page_fault_seconds >= 0, "must be >= 0", "page_fault_seconds")


HOST_PAGE_BYTES = 4096
"""Size of one host memory page (x86-64 Linux default), bytes."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Overheads:
    """Fixed costs that do not scale with work, in seconds."""

    kernel_launch_seconds: float = 5e-6
    """Launch + scheduling cost of one kernel (added per kernel the cost models count)."""
    decode_step_seconds: float = 0.0
    """Per decode step of a generation engine beyond kernels (scheduler, sampler, host sync)."""
    iteration_seconds: float = 0.0
    """Per optimizer step (data loading, logging, host synchronisation, optimizer loop)."""
    fsdp_unit_seconds: float = 0.0
    """Per FSDP unit (layer) per forward or backward pass: the hooks that gather and free
    its parameters, beyond the collective itself (0 in the GPU profiles, where the CPU
    work hides behind the GPU's)."""
    call_seconds: float = 0.0
    """Per dataflow edge: the single controller collecting a result and dispatching the next
    call (0 in the GPU profiles, where it is negligible next to the stages)."""
    operation_seconds: float = 0.0
    """Per model operation (one generate, infer or train call) inside the worker, beyond its
    kernels: moving the batch, preparing inputs, gathering outputs on the host (0 in the GPU
    profiles: not measured there; fitted on CPU runs)."""

    shared_host_slowdown: float = 1.0
    """CPU profiles: how much slower every operation of a set of more than one worker process
    runs, because the processes share the machine's cores with each other, the controller and
    Ray's daemons (1 in the GPU profiles, whose hosts have cores to spare; fitted on CPU runs)."""

    def __post_init__(self) -> None:
        for name in ("kernel_launch_seconds", "decode_step_seconds", "iteration_seconds",
                     "fsdp_unit_seconds", "call_seconds", "operation_seconds"):
            require(getattr(self, name) >= 0, "must be >= 0", name)
        require(self.shared_host_slowdown >= 1, "must be >= 1", "shared_host_slowdown")


CORRECTION_KEYS = (
    "train_compute",
    "infer_compute",
    "prefill_compute",
    "decode",
    "collective",
    "train_collective",
    "transfer",
    "expert_imbalance",
)
"""Names of the multiplicative corrections a calibration may fit (1.0 = no correction).
``expert_imbalance`` is the busiest expert's routed tokens over the mean (MoE models)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Provenance:
    """Where a profile's numbers come from."""

    source: str = "public specifications"
    """How the profile was made: 'public specifications', 'measured by hybridflow profile', ..."""
    fitted_on: tuple[str, ...] = ()
    """Run directories (or ids) the corrections were fitted on."""
    fitted_at: str | None = None
    """ISO date-time of the fit."""
    residual_before: float | None = None
    """Relative RMS error of stage times before the fit."""
    residual_after: float | None = None
    """Relative RMS error of stage times after the fit."""
    accuracy: dict[str, float] = field(default_factory=dict)
    """Measured prediction error on runs not used for fitting (e.g. median_abs_error_pct,
    max_abs_error_pct, kendall_tau, runs), written by ``make accuracy``."""
    parameters_at_bounds: tuple[str, ...] = ()
    """Fitted parameters that ended at a bound of their allowed range (``name=lower`` or
    ``name=upper``): the fit wanted to go further, so a mechanism is missing or the parameter
    does not matter for these runs."""
    commit: str | None = None
    """Git commit of the code the fit ran on ('+dirty' when the checkout had changes)."""
    code_fingerprint: str | None = None
    """Hash of the executor and cost-model sources the fit ran on (planner/provenance.py);
    ``hybridflow plan`` warns when the code has changed since."""
    executor_fingerprint: str | None = None
    """Hash of the executor code the fitted runs executed (planner/provenance.py)."""
    predictions: dict[str, float] = field(default_factory=dict)
    """Seconds per iteration this profile predicted for each calibration plan when it was
    fitted (``make accuracy``'s plans, by name): CI predicts them again and fails when the
    cost model's answer moved, which means the fit describes other code."""
    notes: str = ""
    """Free text: machine, versions, settings."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class DeviceProfile:
    """What one device can do. Loaded from ``profiles/devices/NAME.yaml``.

    Compared and hashed by identity (``load_profile`` returns one object per file), which keeps
    it usable as a cache key in the cost models.
    """

    name: str
    """Profile name, as used by ``cluster.device`` and ``--device``."""
    description: str = ""
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops_per_s: dict[str, float]
    """Dense peak FLOP/s per dtype name (bf16, fp16, fp32, tf32, fp8, int8)."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    reserved_memory_bytes: float = 0.0
    """Memory not available to tensors (runtime context, communication buffers, fragmentation)."""
    memory_bandwidth_bytes_per_s: float
    """Peak device memory bandwidth, in bytes/s."""
    intra_node: Link
    """Link between devices of one node (e.g. NVLink)."""
    inter_node: Link
    """One network interface between nodes (e.g. one 200 Gb/s InfiniBand NIC); the node has
    ``nics_per_node`` of them."""
    nics_per_node: int | None = None
    """NICs per node for inter-node traffic, shared by the node's GPUs (None: one per GPU).
    A cluster's ``network:`` overrides it and the NIC bandwidth."""
    efficiency: EfficiencyCurves
    host_link: HostLink | None = None
    """Copies to and from host memory (None: not described; a framework that offloads states
    to the host then cannot be priced on this device)."""
    price_per_gpu_hour: float | None = None
    """What one GPU costs to hire, in US dollars per GPU per hour (None: not priced). The GPU
    profiles carry a cloud provider's on-demand list price divided by the instance's GPUs, so
    it includes the host's share (CPUs, memory, network) of the instance."""
    price_source: str | None = None
    """Where ``price_per_gpu_hour`` comes from: a citation (provider, instance, region, date),
    or text starting with "assumed" that says what the number was derived from. Required with
    a price, and only with one."""
    overheads: Overheads = field(default_factory=Overheads)
    corrections: dict[str, float] = field(default_factory=dict)
    """Fitted multiplicative corrections of predicted seconds (keys: CORRECTION_KEYS)."""
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        require(bool(self.peak_flops_per_s), "at least one dtype is required", "peak_flops_per_s")
        for dtype, flops in self.peak_flops_per_s.items():
            require(dtype in DTYPE_BYTES, f"unknown dtype (allowed: {', '.join(DTYPE_BYTES)})",
                    f"peak_flops_per_s.{dtype}")
            require(flops > 0, "must be > 0", f"peak_flops_per_s.{dtype}")
        require(self.memory_bytes > 0, "must be > 0", "memory_bytes")
        require(0 <= self.reserved_memory_bytes < self.memory_bytes,
                "must be >= 0 and less than memory_bytes", "reserved_memory_bytes")
        require(self.memory_bandwidth_bytes_per_s > 0, "must be > 0",
                "memory_bandwidth_bytes_per_s")
        require(self.nics_per_node is None or self.nics_per_node >= 1,
                "must be a positive integer", "nics_per_node")
        for key, value in self.corrections.items():
            require(key in CORRECTION_KEYS,
                    f"unknown correction (allowed: {', '.join(CORRECTION_KEYS)})",
                    f"corrections.{key}")
            require(value > 0, "must be > 0", f"corrections.{key}")
        if self.price_per_gpu_hour is None:
            require(self.price_source is None,
                    "given without price_per_gpu_hour: add the price it is the source of, "
                    "or remove it", "price_source")
        else:
            price = self.price_per_gpu_hour
            require(math.isfinite(price) and price > 0,
                    f"must be > 0 (US dollars per GPU per hour), got {price}",
                    "price_per_gpu_hour")
            require(bool(self.price_source and self.price_source.strip()),
                    "missing: price_per_gpu_hour needs a source (a citation, or 'assumed: ...' "
                    "saying what the price was derived from)", "price_source")

    @property
    def price_is_assumed(self) -> bool:
        """Whether the price is an assumption rather than a cited list price (its
        ``price_source`` starts with "assumed"); False when the profile has no price."""
        return (self.price_per_gpu_hour is not None and self.price_source is not None
                and self.price_source.strip().lower().startswith("assumed"))

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; bf16/fp16 fall back on each other."""
        table = self.peak_flops_per_s
        if dtype in table:
            return table[dtype]
        fallback = {"bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}.get(dtype)
        if fallback in table:
            return table[fallback]
        raise SpecError(
            f"profile {self.name} has no peak for dtype {dtype} "
            f"(has: {', '.join(table)})", key="dtype")

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes available to parameters, optimizer states, activations and KV cache."""
        return self.memory_bytes - self.reserved_memory_bytes

    def correction(self, key: str) -> float:
        """Fitted factor for ``key`` (1.0 when the profile has not been calibrated)."""
        return self.corrections.get(key, 1.0)


def profile_search_path() -> list[Path]:
    """Directories searched for ``NAME.yaml``: ``$HYBRIDFLOW_PROFILE_PATH``, then shipped ones."""
    extra = os.environ.get("HYBRIDFLOW_PROFILE_PATH", "")
    dirs = [Path(p) for p in extra.split(os.pathsep) if p]
    return [*dirs, DEVICES_DIR]


def available_profiles() -> list[str]:
    """Names of all profiles on the search path."""
    names: set[str] = set()
    for directory in profile_search_path():
        if directory.is_dir():
            names.update(p.stem for p in directory.glob("*.yaml"))
    return sorted(names)


def resolve_profile_path(name_or_path: str) -> Path:
    """The file of a profile given by name (``a100-80gb``) or by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.exists():
            raise SpecError(f"profile file not found: {name_or_path}", key="device")
        return candidate
    for name in (name_or_path, name_or_path.lower()):
        for directory in profile_search_path():
            path = directory / f"{name}.yaml"
            if path.exists():
                return path
    available = available_profiles()
    raise SpecError(
        f"unknown device profile {name_or_path!r}{did_you_mean(name_or_path, available)} "
        f"(available: {', '.join(available)})", key="device")


def load_profile_file(path: str | Path) -> DeviceProfile:
    """Parse and validate one profile file."""
    return from_mapping(DeviceProfile, read_mapping(path), source=str(path))


_IN_MEMORY: dict[str, DeviceProfile] = {}
IN_MEMORY_PREFIX = "memory:"


def register_profile(profile: DeviceProfile) -> str:
    """Make an in-memory profile loadable by the returned name (calibration evaluates many
    candidate profiles without writing files)."""
    key = f"{IN_MEMORY_PREFIX}{profile.name}:{id(profile)}"
    _IN_MEMORY[key] = profile
    return key


def load_profile(name_or_path: str) -> DeviceProfile:
    """A device profile by name or path (files are read once: profiles are immutable)."""
    if name_or_path.startswith(IN_MEMORY_PREFIX):
        if name_or_path not in _IN_MEMORY:
            raise SpecError(f"unknown in-memory profile {name_or_path!r}", key="device")
        return _IN_MEMORY[name_or_path]
    return _load_profile_cached(name_or_path)


@cache
def _load_profile_cached(name_or_path: str) -> DeviceProfile:
    return load_profile_file(resolve_profile_path(name_or_path))


UNSET_KEYS_LEFT_OUT = ("price_per_gpu_hour", "price_source")
"""Keys ``profile_to_mapping`` leaves out when unset, so that writing a profile without a price
(the calibrated CPU profile) gives the same file as before profiles could carry one."""


def profile_to_mapping(profile: DeviceProfile) -> dict[str, Any]:
    """The profile as a plain mapping in its file format (for writing YAML); the price keys
    appear only when the profile has a price."""
    def value(obj: Any) -> Any:
        if isinstance(obj, EfficiencyCurve):
            return [[float(a), float(b)] for a, b in obj.points]
        if dataclasses.is_dataclass(obj):
            return {f.name: value(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                    if f.init}
        if isinstance(obj, (list, tuple)):
            return [value(v) for v in obj]
        if isinstance(obj, dict):
            return {k: value(v) for k, v in obj.items()}
        return obj

    mapping = value(profile)
    for key in UNSET_KEYS_LEFT_OUT:
        if mapping.get(key) is None:
            mapping.pop(key, None)
    return mapping


def write_profile_file(profile: DeviceProfile, path: str | Path, header: str = "") -> None:
    """Write ``profile`` as YAML (atomically), after checking it loads back."""
    import yaml

    from profiles.datafile import write_text_atomic

    mapping = profile_to_mapping(profile)
    from_mapping(DeviceProfile, mapping, source=str(path))
    text = yaml.safe_dump(mapping, sort_keys=False)
    write_text_atomic(path, (header if header.endswith("\n") or not header else header + "\n")
                      + text)
