"""A run's checkpoints on the controller's side: where they go (``RUN/checkpoints/iter_N``),
how they are written whole (into ``.iter_N.partial``, renamed when complete, the oldest
removed past CHECKPOINTS_KEPT), how the controller's own state is read back, and which one a
restart or a resume starts from. The roles' states are written by the workers
(``executor.checkpoint``)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from profiles.datafile import SpecError, json_text, read_text_file, write_text_atomic

CHECKPOINTS_KEPT = 2
"""Complete checkpoints kept in RUN/checkpoints (older ones are removed)."""


def checkpoint_directories(run: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_")
            and (p / "controller.json").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def read_controller_state(directory: Path) -> dict[str, Any]:
    path = directory / "controller.json"
    try:
        state = json.loads(read_text_file(path, what="UTF-8 JSON"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"not a readable checkpoint: {exc}", source=str(path)) from None
    if not isinstance(state, dict):
        raise SpecError("not a readable checkpoint: expected a JSON mapping",
                        source=str(path))
    for key in ("iterations_done", "generator", "rows", "metrics"):
        if key not in state:
            raise SpecError("missing key", key=key, source=str(path))
    return state


def latest_checkpoint(run: Path) -> Path:
    """The newest complete checkpoint of ``run`` (``--resume``); SpecError when it has none."""
    found = checkpoint_directories(run)
    if not found:
        raise SpecError(f"{run} has no complete checkpoint (checkpoints/iter_N with "
                        "controller.json)", key="--resume")
    return found[-1]


class CheckpointStore:
    """The checkpoints of one run directory, and the last one a restart would go back to."""

    def __init__(self, out: Path | None, resume_from: Path | None):
        self.out = out
        self.last: Path | None = resume_from
        """The newest complete checkpoint (the one resumed from, until one is written)."""
        self.last_time = time.time()
        """When the work a restart would repeat began: the last checkpoint, or a restart."""

    def write(self, iterations_done: int, save_roles: Callable[[Path], float],
              controller_state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint after ``iterations_done`` iterations: ``save_roles(directory)`` has
        the workers write every trained role under ``directory`` (it returns the bytes, summed
        over ranks), then the controller's state; returns the checkpoint's record."""
        assert self.out is not None
        start = time.time()
        root = self.out / "checkpoints"
        final = root / f"iter_{iterations_done:06d}"
        partial = root / f".{final.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        written = save_roles(partial)
        write_text_atomic(partial / "controller.json",
                          json_text(controller_state, default=str))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in checkpoint_directories(self.out)[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        self.last = final
        self.last_time = time.time()
        return {"iterations_done": iterations_done, "seconds": time.time() - start,
                "bytes_rank_sum": written, "path": str(final)}

    def read(self, directory: Path, plan_value: Any) -> dict[str, Any]:
        """The controller's state in ``directory``, refused when another plan wrote it."""
        state = read_controller_state(directory)
        if state.get("plan") != json.loads(json_text(plan_value, default=str)):
            raise SpecError("the checkpoint was written by another plan", key="--resume",
                            source=str(directory))
        return state

    def restarted(self) -> float:
        """Seconds of work a restart repeats (since the last checkpoint or restart); the
        clock starts again."""
        lost = time.time() - self.last_time
        self.last_time = time.time()
        return lost
