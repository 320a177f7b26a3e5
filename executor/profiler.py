"""``hybridflow profile``: measure the local device with torch micro-benchmarks and write a
profile in the same format as the shipped GPU profiles, the raw measurements beside it.

Benchmarks: matrix multiplications over a grid of sizes (per dtype), memory copies, causal
attention forward + backward over sequence lengths, the decode step of a small model over
batch and KV length, and all-reduce / all-gather / reduce-scatter / broadcast among N processes
(gloo on CPU, NCCL on GPUs). torch is imported lazily: the planner never needs it.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from profiles.datafile import SpecError, write_text_atomic


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    device: str = "cpu"
    world_size: int = 2
    quick: bool = False
    name: str = "cpu"
    repeats: int = 5

    @property
    def matmul_sizes(self) -> list[int]:
        return [16, 64, 256, 512] if self.quick else [8, 16, 32, 64, 128, 256, 512, 1024]

    @property
    def copy_bytes(self) -> list[int]:
        return [2**12, 2**18, 2**24] if self.quick else [2**k for k in range(10, 28, 2)]

    @property
    def attention_lengths(self) -> list[int]:
        return [32, 128] if self.quick else [16, 32, 64, 128, 256, 512]

    @property
    def collective_bytes(self) -> list[int]:
        return [2**10, 2**16, 2**20] if self.quick else [2**k for k in range(8, 25, 2)]


@dataclass
class Measurements:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, benchmark: str, size: float, seconds: float, **extra: Any) -> None:
        self.rows.append({"benchmark": benchmark, "size": size, "seconds": seconds, **extra})


def _timer(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Best of ``repeats`` timings, each long enough to be measurable."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(1000, int(0.02 / once)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(size, seconds) with seconds made non-decreasing in size (timing noise at the small
    end must not make a larger operation look faster)."""
    out, longest = [], 0.0
    for size, seconds in sorted(points):
        longest = max(longest, seconds)
        out.append((size, longest))
    return out


def _curve(points: list[tuple[float, float]], work_per_second: float,
           work: Callable[[float], float] = float) -> list[list[float]]:
    """Efficiency points (size, achieved / peak) from (size, seconds); ``work(size)`` is what
    the operation moves or computes. A point never implies a larger operation is faster."""
    curve: list[list[float]] = []
    for size, seconds in _monotone(points):
        fraction = max(1e-9, min(1.0, work(size) / seconds / work_per_second))
        fraction = float(f"{fraction:.6g}")
        if curve:
            previous_size, previous = curve[-1]
            fraction = min(fraction, previous * size / previous_size)
        curve.append([float(size), fraction])
    return curve


def device_sync(device: Any) -> Callable[[], None]:
    """What a timing waits on before reading the clock: the GPU's queue under CUDA (its
    kernels and NCCL collectives return before they finish), nothing on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _emit(progress: Callable[[str], None] | None, message: str) -> None:
    """Report ``message`` when the caller asked for progress."""
    if progress is not None:
        progress(message)


def measure_compute(settings: ProfileSettings, data: Measurements,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Matmul, copy, attention and launch-cost benchmarks in this process."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    torch.set_num_threads(1)
    device = torch.device(settings.device)
    sync = device_sync(device)
    peaks: dict[str, float] = {}
    matmul_points: dict[str, list[tuple[float, float]]] = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        points = []
        for n in settings.matmul_sizes:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            seconds = _timer(lambda a=a, b=b: a @ b, settings.repeats, sync)
            flops = 2.0 * n**3
            points.append((flops, seconds))
            data.add("matmul", flops, seconds, dtype=dtype_name, n=n,
                     flops_per_s=flops / seconds)
        matmul_points[dtype_name] = points
        peaks[dtype_name] = max(f / s for f, s in points)
        _emit(progress, f"matmul {dtype_name}: best {peaks[dtype_name] / 1e9:.1f} GFLOP/s")

    copy_points = []
    for size in settings.copy_bytes:
        count = size // 4
        src = torch.randn(count, device=device)
        dst = torch.empty_like(src)
        seconds = _timer(lambda src=src, dst=dst: dst.copy_(src), settings.repeats, sync)
        moved = 2.0 * size  # read + write
        copy_points.append((moved, seconds))
        data.add("copy", moved, seconds, bytes_per_s=moved / seconds)
    bandwidth = max(b / s for b, s in copy_points)
    _emit(progress, f"memory copy: best {bandwidth / 1e9:.2f} GB/s")

    attention_points = []
    for length in settings.attention_lengths:
        q = torch.randn(1, 4, length, 32, device=device, requires_grad=True)
        k = torch.randn(1, 4, length, 32, device=device, requires_grad=True)
        v = torch.randn(1, 4, length, 32, device=device, requires_grad=True)

        def run(q=q, k=k, v=v) -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()

        seconds = _timer(run, settings.repeats, sync)
        forward_flops = 4.0 * length * length * 4 * 32 * 0.5
        # The cost model charges attention forward + 2.5x for backward (FlashAttention-2).
        attention_points.append((forward_flops, seconds / 3.5))
        data.add("attention_fwd_bwd", forward_flops, seconds, length=length)

    tiny = torch.ones(4, device=device)
    out = torch.empty_like(tiny)
    launch = _timer(lambda: torch.add(tiny, tiny, out=out), settings.repeats * 4, sync)
    data.add("launch", 1, launch)
    _emit(progress, f"one small kernel: {launch * 1e6:.1f} us")
    return {"peaks": peaks, "matmul": matmul_points, "copy": copy_points,
            "bandwidth": bandwidth, "attention": attention_points, "launch": launch}


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int,
                       backend: str, out: str) -> None:
    """One process of the collective benchmarks; rank 0 writes the slowest rank's times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = collective_device(backend, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group forms: NCCL binds to it
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            device_id=device if device.type == "cuda" else None)
    sync = device_sync(device)
    results = []
    for size in sizes:
        count = max(world, size // 4 // world * world)
        tensor = torch.ones(count, device=device)
        parts = [torch.empty(count // world, device=device) for _ in range(world)]
        chunk = torch.ones(count // world, device=device)
        ops = {
            "all_reduce": lambda tensor=tensor: dist.all_reduce(tensor),
            "all_gather": lambda chunk=chunk, parts=parts: dist.all_gather(parts, chunk),
            "reduce_scatter": lambda tensor=tensor, chunk=chunk: dist.reduce_scatter_tensor(
                chunk, tensor) if backend == "nccl" else dist.reduce_scatter(
                chunk, list(tensor.chunk(world))),
            "broadcast": lambda tensor=tensor: dist.broadcast(tensor, 0),
        }
        for name, op in ops.items():
            best = time_collective(op, sync, dist.barrier, repeats)
            best_tensor = torch.tensor([best], device=device)
            dist.all_reduce(best_tensor, op=dist.ReduceOp.MAX)
            results.append({"benchmark": name, "size": count * 4,
                            "seconds": float(best_tensor)})
    if rank == 0:
        pd.DataFrame(results).to_csv(out, index=False)
    dist.destroy_process_group()


def time_collective(op: Callable[[], Any], sync: Callable[[], None],
                    barrier: Callable[[], Any], repeats: int) -> float:
    """Best seconds of ``op`` over ``repeats``: a warm-up first (NCCL sets up its
    communicator on the first call), every rank starting together, and the device
    synchronised before the clock starts and before it stops (NCCL collectives return
    before they finish)."""
    op()
    sync()
    barrier()
    best = math.inf
    for _ in range(repeats):
        barrier()
        sync()
        start = time.perf_counter()
        op()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def collective_device(backend: str, rank: int) -> Any:
    """Where a collective benchmark process keeps its tensors: GPU ``rank`` under NCCL (one
    process per GPU of this node), else the CPU."""
    import torch

    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def device_memory_bytes(device: str, world_size: int) -> float:
    """Memory of one device: a GPU's own (its properties), or this host's RAM shared by the
    ``world_size`` worker processes of a CPU profile."""
    import torch

    if torch.device(device).type == "cuda":
        # The profiled GPU's own capacity: the host's RAM says nothing about it.
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") \
        if hasattr(os, "sysconf") else 16 * 2**30
    return memory / max(world_size, 1)


INTER_NODE_NOT_MEASURED = (
    "inter_node and efficiency.inter_node_collective are NOT measured: the profiler runs on "
    "one node, so they repeat the intra-node figures; replace them with the cluster's "
    "network (NIC bandwidth and latency, nics_per_node) before planning across nodes")


def check_world_size(settings: ProfileSettings) -> None:
    """Refuse a CUDA profile with more collective processes than this node has GPUs (each
    process binds GPU ``rank``; NCCL cannot put two ranks on one GPU)."""
    if settings.device != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if settings.world_size > count:
        raise SpecError(f"{settings.world_size} collective processes need as many GPUs; this "
                        f"node has {count}", key="--world-size")


def measure_collectives(settings: ProfileSettings, data: Measurements,
                        progress: Callable[[str], None] | None = None) -> list[tuple[float,
                                                                                   float]]:
    """(message bytes, seconds) of all-reduce among ``world_size`` processes; every collective
    is kept in the measurements."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if settings.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "collectives.csv")
        mp.start_processes(_collective_worker,
                           args=(settings.world_size, port, settings.collective_bytes,
                                 settings.repeats, backend, out),
                           nprocs=settings.world_size, start_method="spawn")
        frame = pd.read_csv(out)
    for row in frame.to_dict(orient="records"):
        data.add(f"collective_{row['benchmark']}", row["size"], row["seconds"],
                 world_size=settings.world_size)
    all_reduce = frame[frame["benchmark"] == "all_reduce"]
    points = list(zip(all_reduce["size"].astype(float), all_reduce["seconds"], strict=True))
    _emit(progress, f"all-reduce among {settings.world_size}: {len(points)} sizes")
    return points


def _decode_overhead(settings: ProfileSettings, data: Measurements, launch: float,
                     draft: dict[str, Any]) -> float:
    """Fixed cost of a decode step beyond what the cost model charges, fitted (least squares)
    to decode steps of the tiny-4l model over batch sizes and KV lengths."""
    import numpy as np
    import torch

    from executor.generation import GenerationEngine
    from executor.model import build_model
    from profiles.datafile import from_mapping
    from profiles.device import DeviceProfile
    from simulator.costs.generation import decode_step_model
    from simulator.specs.parallel import GenerationConfig
    from simulator.specs.presets import MODEL_PRESETS

    spec = MODEL_PRESETS["tiny-4l"]
    device = torch.device(settings.device)
    sync = device_sync(device)
    engine = GenerationEngine(spec)
    engine.load({n: p.detach().to(device) for n, p in build_model(spec).named_parameters()})
    profile = from_mapping(DeviceProfile, {**draft, "overheads": {
        "kernel_launch_seconds": launch, "decode_step_seconds": 0.0}})
    step_model = decode_step_model(spec, GenerationConfig(), "fp32", 1)
    gaps = []
    batches = [1, 8] if settings.quick else [1, 4, 16, 64]
    lengths = [16, 64] if settings.quick else [16, 64, 256]
    for batch in batches:
        for kv in lengths:
            prompts = torch.randint(4, 14, (batch, kv), device=device)
            cache = [[torch.zeros(batch, spec.kv_heads, kv + 1, spec.head_dim_value,
                                  device=device)
                      for _ in range(2)] for _ in range(spec.layers)]
            positions = torch.full((batch, 1), kv, device=device)
            engine._forward(prompts, torch.arange(kv, device=device).expand(batch, kv), cache,
                            0)
            token = torch.ones(batch, 1, dtype=torch.long, device=device)
            seconds = _timer(lambda token=token, positions=positions, cache=cache, kv=kv:
                             engine._forward(token, positions, cache, kv),
                             settings.repeats, sync)
            predicted = step_model.step_seconds(profile, "fp32", batch, batch * (kv + 1))
            data.add("decode_step", batch * (kv + 1), seconds, batch=batch, kv_tokens=kv,
                     predicted_without_overhead=predicted)
            gaps.append(seconds - predicted)
    return float(max(0.0, np.median(gaps)))


def measure_profile(settings: ProfileSettings,
                    progress: Callable[[str], None] | None = None) -> tuple[dict[str, Any],
                                                                            pd.DataFrame]:
    """Run every benchmark; returns the profile mapping and the measurements table."""
    check_world_size(settings)  # before minutes of compute benchmarks, not after
    data = Measurements()
    compute = measure_compute(settings, data, progress)
    collectives = measure_collectives(settings, data, progress)
    peak = compute["peaks"]["fp32"]
    bandwidth = compute["bandwidth"]
    bus = []
    world = settings.world_size
    for size, seconds in collectives:
        bus.append((size, 2 * (world - 1) / world * size / seconds))
    link = max(b for _, b in bus)
    latency = min(s for _, s in collectives)
    collective_curve = _curve(collectives, link, lambda size: 2 * (world - 1) / world * size)
    per_worker = device_memory_bytes(settings.device, world)
    draft = {
        "name": settings.name,
        "description": f"measured by hybridflow profile on {socket.gethostname()} "
                       f"({settings.device}, {settings.world_size} processes)",
        "kind": "cpu" if settings.device == "cpu" else "gpu",
        "peak_flops_per_s": {k: float(v) for k, v in compute["peaks"].items()},
        "memory_bytes": float(per_worker),
        "reserved_memory_bytes": float(min(per_worker * 0.5, 512 * 2**20)),
        "memory_bandwidth_bytes_per_s": float(bandwidth),
        "intra_node": {"bandwidth_bytes_per_s": float(link), "latency_seconds": float(latency)},
        "nics_per_node": 1,  # one machine: only loopback between its processes
        # NOT measured: one node has no inter-node link to time, and DeviceProfile requires
        # the field, so it copies intra_node; INTER_NODE_NOT_MEASURED says so in the
        # provenance notes and the file's header, for the user to replace.
        "inter_node": {"bandwidth_bytes_per_s": float(link), "latency_seconds": float(latency)},
        "efficiency": {
            "matmul": _curve(compute["matmul"]["fp32"], peak),
            "attention": _curve(compute["attention"], peak),
            "memory": _curve(compute["copy"], bandwidth),
            "intra_node_collective": collective_curve,
            # A copy of the intra-node curve, not measured (see inter_node above).
            "inter_node_collective": [list(point) for point in collective_curve],
        },
    }
    decode = _decode_overhead(settings, data, compute["launch"], draft)
    _emit(progress, f"decode step overhead: {decode * 1e6:.0f} us")
    profile = {
        **draft,
        "overheads": {"kernel_launch_seconds": float(compute["launch"]),
                      "decode_step_seconds": decode, "iteration_seconds": 0.0},
        "corrections": {},
        "provenance": {
            "source": "measured by hybridflow profile",
            "fitted_on": [], "fitted_at": _dt.datetime.now(_dt.UTC).isoformat(
                timespec="seconds"),
            "notes": _provenance_notes(settings),
        },
    }
    return profile, pd.DataFrame(data.rows)


def _provenance_notes(settings: ProfileSettings) -> str:
    """Machine, versions and settings of the measurement, and what was not measured."""
    import torch

    # A GPU profile names its GPU (a CPU profile's notes stay as they were).
    gpu = f"GPU {torch.cuda.get_device_name(torch.device(settings.device))}, " \
        if settings.device == "cuda" else ""
    return (f"machine {socket.gethostname()}, {platform.platform()}, {os.cpu_count()} CPUs, "
            f"{gpu}"
            f"python {platform.python_version()}, torch {torch.__version__}, device "
            f"{settings.device}, {settings.world_size} processes for collectives, one thread "
            f"per process, quick={settings.quick}, best of {settings.repeats} repeats. "
            f"{INTER_NODE_NOT_MEASURED}")


def write_profile(profile: dict[str, Any], measurements: pd.DataFrame, path: Path) -> Path:
    """profile YAML (validated by the loader first) and its measurements CSV beside it."""
    from profiles.datafile import from_mapping
    from profiles.device import DeviceProfile

    try:
        from_mapping(DeviceProfile, profile, source=str(path))
    except SpecError as exc:
        raise SpecError(f"measured profile is invalid: {exc.problem}", key=exc.key,
                        source=str(path)) from None
    header = (f"# Device profile measured by `hybridflow profile` on "
              f"{_dt.date.today().isoformat()}.\n# Raw measurements: "
              f"{path.with_suffix('.measurements.csv').name}; provenance below.\n"
              f"# {INTER_NODE_NOT_MEASURED}.\n")
    write_text_atomic(path, header + yaml.safe_dump(profile, sort_keys=False))
    write_text_atomic(path.with_suffix(".measurements.csv"), measurements.to_csv(index=False))
    return path
