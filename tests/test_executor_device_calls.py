"""What the workers ask of the GPU, recorded through a mocked ``torch.cuda`` on this CPU
machine: the device is bound before anything else, every timed region is bracketed by
synchronisations, peaks are reset per call and read after it; and worker clocks are put on
the controller's clock by their measured offsets."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from executor import device
from executor.controller import offset_from_samples
from executor.worker import SetWorker


@pytest.fixture
def cuda_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Pretend a GPU is there; log every torch.cuda call the executor makes, in order."""
    log: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: log.append(("set_device",
                                                                            index)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a: log.append(("reset_peak",)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda *a: log.append(("read_peak",)) or 123)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return log


class FakeTrainer:
    def state_bytes(self) -> dict[str, int]:
        return {"params": 1, "grads": 0, "optimizer": 0}

    def offload(self, *, optimizer: bool, grads: bool) -> int:
        return 0

    def reload(self) -> None:
        pass


class FakeRole:
    """A role whose operations only write to the log (no tensors on the fake device)."""

    def __init__(self, log: list[tuple]):
        self.log = log
        self.trainer = FakeTrainer()
        self.config = type("Config", (), {"offload_optimizer": False,
                                          "offload_grads": False})()

    def update(self, payload: Any) -> str:
        self.log.append(("compute", "update"))
        return "metrics"

    def state_bytes(self) -> dict[str, int]:
        return self.trainer.state_bytes()


def test_the_worker_binds_its_gpu_from_rays_ids_first(cuda_log: list[tuple],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [5])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    SetWorker(world=2, set_index=0)
    assert cuda_log[0] == ("set_device", 1)  # Ray's GPU 5 is the second visible device
    assert device.process_group_backend() == "nccl"  # one backend per device
    assert device.process_group_device() == torch.device("cuda", 0)


def test_every_call_is_timed_between_synchronisations_with_its_own_peak(
        cuda_log: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    worker = SetWorker.__new__(SetWorker)
    worker.rank, worker.world, worker.set_index = 0, 1, 0
    worker.device = torch.device("cpu")  # payloads are not Batches: nothing is moved
    worker.roles = {"actor": FakeRole(cuda_log)}  # type: ignore[dict-item]
    result, info = worker.call("actor", "update", {"anything": 1})
    assert result == "metrics" and info["peak_gpu_bytes"] == 123
    names = [entry[0] for entry in cuda_log]
    # Queued kernels of the previous call finish before the clock starts; this call's
    # (an update returns only metrics while its kernels may still run) before it stops.
    assert names == ["synchronize", "reset_peak", "compute", "synchronize", "empty_cache",
                     "read_peak"]


def test_the_transition_is_timed_between_synchronisations(
        cuda_log: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    from executor import hybrid_engine

    monkeypatch.setattr(hybrid_engine.time, "perf_counter",
                        lambda: cuda_log.append(("clock",)) or 0.0)
    engine = hybrid_engine.HybridEngine.__new__(hybrid_engine.HybridEngine)
    engine.mode = "micro_dp"
    engine.trainer = type("T", (), {"model": torch.nn.Linear(2, 2)})()
    engine._micro_dp_weights = lambda: (cuda_log.append(("gather",)) or ({}, 0))
    engine.engine = type("E", (), {"load": lambda self, w: None,
                                   "weight_bytes": lambda self: 0})()
    engine._distinct_parameter_bytes = lambda: 0
    engine.to_generation()
    names = [entry[0] for entry in cuda_log]
    assert names == ["synchronize", "clock", "gather", "synchronize", "clock"]


def test_worker_clock_offsets_come_from_the_shortest_round_trip() -> None:
    # The worker's clock runs 100 s ahead; trips are asymmetric and of different lengths.
    samples = [(0.0, 100.0 + 0.4, 1.0),     # 1 s round trip
               (2.0, 100.0 + 2.01, 2.02),   # 20 ms: the one to use
               (3.0, 100.0 + 3.2, 3.5)]
    offset, uncertainty = offset_from_samples(samples)
    assert uncertainty == pytest.approx(0.01)
    assert abs(offset - 100.0) <= uncertainty
