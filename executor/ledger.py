"""What a run has produced so far, kept by the controller and written to the run directory
as it goes (``executor.records.write_run``): the measurement rows and metrics of the finished
iterations, the reward models' warm-up losses, the restarts and the checkpoints written. A
checkpoint stores the part a resumed run continues from (``state``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RunLedger:
    rows: list[dict[str, Any]] = field(default_factory=list)
    """measurements.csv: one row per operation of every finished iteration."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """metrics.csv: one row per finished iteration."""
    reward_warmup_losses: list[float] = field(default_factory=list)
    """The reward model's fit to the built-in task's rule before RL, per step."""
    cost_warmup_losses: list[float] = field(default_factory=list)
    """The same for Safe-RLHF's cost model."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """Each worker failure the run recovered from, and the time it cost."""
    checkpoints_written: list[dict[str, Any]] = field(default_factory=list)
    """Each checkpoint: iterations done, seconds, bytes summed over ranks, path."""

    @property
    def finished(self) -> int:
        """Iterations whose records are kept."""
        return len(self.metrics)

    def finish_iteration(self, rows: list[dict[str, Any]], metric: dict[str, Any]) -> None:
        """An iteration counts once all of it has run (a failure before repeats it whole)."""
        self.rows.extend(rows)
        self.metrics.append(metric)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run's records continue these."""
        return {"reward_warmup_losses": self.reward_warmup_losses,
                "cost_warmup_losses": self.cost_warmup_losses,
                "rows": self.rows, "metrics": self.metrics}

    def restore(self, state: dict[str, Any]) -> None:
        """The records as a checkpoint's ``state`` left them."""
        self.rows = list(state["rows"])
        self.metrics = list(state["metrics"])
        self.reward_warmup_losses = list(state.get("reward_warmup_losses", []))
        self.cost_warmup_losses = list(state.get("cost_warmup_losses", []))

    def start_over(self) -> None:
        """No iteration kept (a restart without a checkpoint runs from the start)."""
        self.rows, self.metrics = [], []
