"""``hybridflow profile --device cuda`` without a GPU: its device calls recorded through a
mocked ``torch.cuda`` and a stand-in process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from executor import profiler


def test_collective_processes_bind_their_gpu_before_the_group_forms(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    log: list[tuple] = []

    class StopError(Exception):
        pass

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("set_device",
                                                                             device)))

    def init(backend: str, **kwargs: object) -> None:
        log.append(("init_process_group", backend, kwargs.get("device_id")))
        raise StopError

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(StopError):
        profiler._collective_worker(1, 2, 0, [1024], 1, "nccl", str(tmp_path / "out.csv"))
    assert log == [("set_device", torch.device("cuda", 1)),
                   ("init_process_group", "nccl", torch.device("cuda", 1))]
    assert profiler.collective_device("nccl", 3) == torch.device("cuda", 3)
    assert profiler.collective_device("gloo", 3) == torch.device("cpu")


def test_collectives_are_timed_between_synchronisations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    clock = iter(range(100))
    monkeypatch.setattr(profiler.time, "perf_counter",
                        lambda: log.append("clock") or float(next(clock)))
    best = profiler.time_collective(lambda: log.append("op"), lambda: log.append("sync"),
                                    lambda: log.append("barrier"), repeats=2)
    assert best == 1.0
    assert log == ["op", "sync", "barrier",  # warm-up, then every rank starts together
                   "barrier", "sync", "clock", "op", "sync", "clock",
                   "barrier", "sync", "clock", "op", "sync", "clock"]


def test_a_gpu_profile_takes_the_gpus_memory_not_the_hosts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    assert profiler.device_memory_bytes("cuda", world_size=8) == 80 * 2**30
    host = profiler.device_memory_bytes("cpu", world_size=2)
    assert host != 80 * 2**30 and host > 0


def test_the_profile_says_its_inter_node_figures_are_not_measured() -> None:
    notes = profiler._provenance_notes(profiler.ProfileSettings(device="cuda", quick=True))
    assert "inter_node" in notes and "NOT measured" in notes
