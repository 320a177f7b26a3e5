"""The Megatron-core backend on this CPU machine, through the test-only shims of
tests/compat/megatron_cpu.py (megatron-core 0.16.1). Every layout starts from the same
Hugging Face-named weights of the torch model."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.engines import megatron_workers

LOG_PROB_TOLERANCE = 1e-5
"""fp32: the layouts reduce in different orders (seen: 5e-7)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_layouts_compute_the_torch_models_log_probs_and_export_its_weights(
        tp: int, pp: int, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    mp.start_processes(megatron_workers.log_probs_and_round_trip,
                       args=(tp * pp, free_port(), tp, pp, str(out)), nprocs=tp * pp,
                       start_method="spawn")
    result = json.loads(out.read_text())
    assert result["max_log_prob_error"] < LOG_PROB_TOLERANCE
    assert result["round_trip_exact"] and result["missing"] == []
