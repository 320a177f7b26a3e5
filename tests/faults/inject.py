"""Faults for the executor's failure tests, loaded in every worker with ``execute
--worker-setup tests.faults.inject:<function>`` (tests only)."""

from __future__ import annotations

import os


def _on_second_update(action) -> None:
    """Run ``action`` on rank 1 when the actor's update is called the second time (iteration
    1); the first iteration completes."""
    import torch.distributed as dist

    from executor import roles

    original = roles.ActorRole.update
    calls = {"n": 0}

    def update(self, batch):
        calls["n"] += 1
        if calls["n"] == 2 and dist.get_rank() == 1:
            action()
        return original(self, batch)

    update.protocol = original.protocol  # type: ignore[attr-defined]
    roles.ActorRole.update = update


def raise_in_second_update() -> None:
    def fail() -> None:
        raise RuntimeError("injected fault: CUDA error: an illegal memory access")

    _on_second_update(fail)


def exit_in_second_update() -> None:
    _on_second_update(lambda: os._exit(3))


def kill_in_third_update_once() -> None:
    """SIGKILL rank 1 in the actor's third update (iteration 2), once per run: a marker file
    (``$HYBRIDFLOW_FAULT_MARKER``) remembers that it happened, so the restarted workers run
    on."""
    import signal
    from pathlib import Path

    import torch.distributed as dist

    from executor import roles

    original = roles.ActorRole.update
    calls = {"n": 0}
    marker = Path(os.environ["HYBRIDFLOW_FAULT_MARKER"])

    def update(self, batch):
        calls["n"] += 1
        if calls["n"] == 3 and dist.get_rank() == 1 and not marker.exists():
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batch)

    update.protocol = original.protocol  # type: ignore[attr-defined]
    roles.ActorRole.update = update
