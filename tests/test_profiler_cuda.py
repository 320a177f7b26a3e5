"""``hybridflow profile --device cuda`` without a GPU: its device calls recorded through a
mocked ``torch.cuda``, a stand-in process group, and tensor factories that note the device
asked for and build the tensor on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import yaml

from executor import profiler
from profiles.datafile import SpecError
from profiles.device import load_profile_file

GPU_MEMORY_BYTES = 80 * 2**30


class FakeCuda:
    """Records the device calls the profiler makes in place of ``torch.cuda``."""

    def __init__(self, log: list[Any], monkeypatch: pytest.MonkeyPatch,
                 device_count: int = 8) -> None:
        """Install the fakes; every call appends to ``log``."""
        self.log = log
        self.properties_asked: list[Any] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
        monkeypatch.setattr(torch.cuda, "set_device",
                            lambda device: log.append(("set_device", device)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.get_device_properties)
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (GPU_MEMORY_BYTES // 2, GPU_MEMORY_BYTES))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")

    def get_device_properties(self, device: Any) -> Any:
        """A GPU with ``GPU_MEMORY_BYTES`` of memory; notes which device was asked about."""
        self.properties_asked.append(device)

        class Properties:
            total_memory = GPU_MEMORY_BYTES

        return Properties()


def redirect_factories(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[Any]:
    """Make ``torch.<name>(..., device=D)`` note D and build on the CPU (no GPU here); returns
    the devices asked for, in call order."""
    devices: list[Any] = []
    for name in names:
        real = getattr(torch, name)

        def factory(*args: Any, _real: Any = real, device: Any = None, **kwargs: Any) -> Any:
            devices.append(device)
            return _real(*args, device="cpu", **kwargs)

        monkeypatch.setattr(torch, name, factory)
    return devices


def fake_clock(log: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that advances one second per read and logs every read."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(profiler.time, "perf_counter",
                        lambda: log.append("clock") or float(next(ticks)))


def assert_every_clock_read_waits_for_the_device(log: list[Any]) -> None:
    """No operation may sit between the clock and the device's queue draining: after any
    logged operation, a sync comes before the next clock read."""
    pending = None
    for event in log:
        if event == "sync":
            pending = None
        elif event == "clock":
            assert pending is None, f"clock read while {pending!r} may still run: {log}"
        elif isinstance(event, tuple) and event[0] == "op":
            pending = event


@pytest.mark.parametrize("rank", [0, 1])
def test_collective_worker_binds_its_gpu_keeps_tensors_there_and_syncs_every_timing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int) -> None:
    log: list[Any] = []
    FakeCuda(log, monkeypatch)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep the test's threads
    devices = redirect_factories(monkeypatch, ("ones", "empty", "tensor"))
    fake_clock(log, monkeypatch)

    def init(backend: str, **kwargs: Any) -> None:
        log.append(("init_process_group", backend, kwargs.get("device_id")))

    def op(name: str) -> Any:
        return lambda *args, **kwargs: log.append(("op", name))

    monkeypatch.setattr(dist, "init_process_group", init)
    for name in ("all_reduce", "all_gather", "reduce_scatter_tensor", "broadcast"):
        monkeypatch.setattr(dist, name, op(name))
    monkeypatch.setattr(dist, "barrier", lambda: log.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: log.append("destroy"))

    out = tmp_path / "out.csv"
    sizes, repeats = [1024, 4096], 2
    profiler._collective_worker(rank, 2, 0, sizes, repeats, "nccl", str(out))

    gpu = torch.device("cuda", rank)
    # The GPU is bound before the process group forms, and NCCL is told which it is.
    assert log[:2] == [("set_device", gpu), ("init_process_group", "nccl", gpu)]
    assert devices and all(device == gpu for device in devices), devices
    assert_every_clock_read_waits_for_the_device(log)
    timed = [e for e in log if e in ("clock",) or (isinstance(e, tuple) and e[0] == "op")]
    # Per size and collective: a warm-up call, then ``repeats`` timed calls between two
    # clock reads each; then the all-reduce of the slowest rank's time.
    per_collective = 1 + 3 * repeats + 1
    assert len(timed) == len(sizes) * 4 * per_collective
    if rank == 0:
        frame = pd.read_csv(out)
        assert sorted(set(frame["benchmark"])) == ["all_gather", "all_reduce", "broadcast",
                                                   "reduce_scatter"]
        assert (frame["seconds"] == 1.0).all()  # one clock tick between the two reads
    else:
        assert not out.exists()


def test_the_cpu_collective_worker_stays_on_the_cpu_without_device_calls(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    log: list[Any] = []
    FakeCuda(log, monkeypatch)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    devices = redirect_factories(monkeypatch, ("ones", "empty", "tensor"))

    class StopError(Exception):
        pass

    def init(backend: str, **kwargs: Any) -> None:
        log.append(("init_process_group", backend, kwargs.get("device_id")))
        raise StopError

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(StopError):
        profiler._collective_worker(1, 2, 0, [1024], 1, "gloo", str(tmp_path / "out.csv"))
    assert log == [("init_process_group", "gloo", None)]
    assert devices == []
    assert profiler.collective_device("gloo", 3) == torch.device("cpu")


def test_collectives_are_timed_between_synchronisations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    fake_clock(log, monkeypatch)
    best = profiler.time_collective(lambda: log.append(("op", "x")),
                                    lambda: log.append("sync"),
                                    lambda: log.append("barrier"), repeats=2)
    assert best == 1.0
    op = ("op", "x")
    assert log == [op, "sync", "barrier",  # warm-up, then every rank starts together
                   "barrier", "sync", "clock", op, "sync", "clock",
                   "barrier", "sync", "clock", op, "sync", "clock"]


def test_compute_timings_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    fake_clock(log, monkeypatch)
    profiler._timer(lambda: log.append(("op", "matmul")), 3, lambda: log.append("sync"))
    assert log[:2] == [("op", "matmul"), "sync"]  # the warm-up finishes before any clock
    assert log.count("clock") == 2 + 2 * 3
    assert_every_clock_read_waits_for_the_device(log)


def test_compute_benchmarks_on_cuda_put_tensors_on_the_gpu_and_sync_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    FakeCuda(log, monkeypatch)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    devices = redirect_factories(monkeypatch, ("randn", "ones"))
    syncs_per_timing: list[int] = []
    real_timer = profiler._timer

    def timer(fn: Any, repeats: int, sync: Any) -> float:
        """The real timer, counting the device syncs it made."""
        before = log.count("sync")
        seconds = real_timer(fn, 1, sync)
        syncs_per_timing.append(log.count("sync") - before)
        return seconds

    monkeypatch.setattr(profiler, "_timer", timer)
    settings = profiler.ProfileSettings(device="cuda", quick=True, repeats=1)
    profiler.measure_compute(settings, profiler.Measurements())

    assert devices and all(device == torch.device("cuda") for device in devices), devices
    timings = (2 * len(settings.matmul_sizes) + len(settings.copy_bytes)
               + len(settings.attention_lengths) + 1)
    assert len(syncs_per_timing) == timings
    assert all(count > 0 for count in syncs_per_timing), syncs_per_timing


def test_a_gpu_profile_takes_the_gpus_memory_not_the_hosts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda([], monkeypatch)

    def no_host_ram(name: str) -> int:
        raise AssertionError(f"host RAM read ({name}) for a GPU profile")

    with monkeypatch.context() as patch:
        patch.setattr(profiler.os, "sysconf", no_host_ram)
        assert profiler.device_memory_bytes("cuda", world_size=8) == GPU_MEMORY_BYTES
    assert fake.properties_asked == [torch.device("cuda")]
    host = profiler.device_memory_bytes("cpu", world_size=2)
    assert host != GPU_MEMORY_BYTES and host > 0


def canned_compute(settings: Any, data: Any, progress: Any = None) -> dict[str, Any]:
    """Compute benchmark results as ``measure_compute`` returns them, without running."""
    matmul = [(1e6, 1e-5), (1e9, 2e-3)]
    return {"peaks": {"fp32": 5e11, "bf16": 1e12}, "matmul": {"fp32": matmul, "bf16": matmul},
            "copy": [(1e6, 1e-5), (1e8, 1e-4)], "bandwidth": 1e12,
            "attention": [(1e6, 1e-5), (1e8, 1e-3)], "launch": 5e-6}


def test_a_cuda_profile_has_gpu_memory_and_says_inter_node_is_not_measured(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    FakeCuda([], monkeypatch)
    monkeypatch.setattr(profiler, "measure_compute", canned_compute)
    monkeypatch.setattr(profiler, "measure_collectives",
                        lambda settings, data, progress=None: [(1024.0, 1e-5),
                                                               (2.0**20, 1e-4)])
    monkeypatch.setattr(profiler, "_decode_overhead", lambda *args: 0.0)
    settings = profiler.ProfileSettings(device="cuda", world_size=2, quick=True, name="gpu")
    with monkeypatch.context() as patch:
        patch.setattr(profiler.os, "sysconf",
                      lambda name: (_ for _ in ()).throw(AssertionError("host RAM read")))
        profile, measurements = profiler.measure_profile(settings)
    assert profile["kind"] == "gpu"
    assert profile["memory_bytes"] == GPU_MEMORY_BYTES
    assert "GPU Fake GPU" in profile["provenance"]["notes"]

    path = profiler.write_profile(profile, measurements, tmp_path / "gpu.yaml")
    loaded = load_profile_file(path)
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    # The schema requires inter_node, so it holds the intra-node figures; the profile must
    # then say, in its notes and in the file's header, that they were not measured.
    assert loaded.inter_node == loaded.intra_node
    for where in (loaded.provenance.notes, " ".join(header)):
        assert "inter_node" in where and "NOT measured" in where
    assert yaml.safe_load(text)["inter_node"] == profile["inter_node"]


def test_a_cuda_profile_needs_a_gpu_per_collective_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda([], monkeypatch, device_count=1)

    def never(*args: Any) -> None:
        raise AssertionError("benchmarks ran although the node lacks GPUs")

    monkeypatch.setattr(profiler, "measure_compute", never)
    with pytest.raises(SpecError, match="2 collective processes need as many GPUs") as info:
        profiler.measure_profile(profiler.ProfileSettings(device="cuda", world_size=2))
    assert info.value.key == "--world-size"
    # A CPU profile is not limited by GPUs.
    profiler.check_world_size(profiler.ProfileSettings(device="cpu", world_size=2))
