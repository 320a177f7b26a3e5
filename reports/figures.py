"""Figures of a planning run (matplotlib figures drawn by the Agg canvas, PNG files).

Figures are made with ``matplotlib.figure.Figure`` directly, not through pyplot: no global
figure manager to close, and a third of a second less to start ``plan``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from simulator.costs.memory import GIB
from simulator.engine import TimelineEvent
from simulator.predict import SetMemory

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "kv_cache")
MEMORY_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
                  "activations": "#c44e52", "kv_cache": "#8172b3"}
STRATEGY_COLOURS = {"searched": "#2a9d8f", "pinned": "#2a9d8f", "colocate": "#e9c46a",
                    "standalone": "#f4a261", "split": "#e76f51"}


def _figure(**kwargs) -> tuple[Figure, object]:
    """A figure on an Agg canvas and its one axes."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Figure, path: Path) -> Path:
    """Write the PNG through a temporary file and a rename (never half a file)."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp")
    fig.savefig(temporary, dpi=120, format="png")
    os.replace(temporary, path)
    return path


def throughput_by_strategy(names: Sequence[str], placements: Sequence[str],
                           throughputs: Sequence[float | None], path: Path,
                           title: str, reasons: Sequence[str] = ()) -> Path:
    """Bars of tokens/s per strategy; a strategy without a plan is marked, not drawn, with
    the gist of its reason (``reasons``: the strategies table's, as the CLI prints them)."""
    fig, ax = _figure(figsize=(7.5, 4.2))
    positions = range(len(names))
    values = [t or 0.0 for t in throughputs]
    bars = ax.bar(positions, values,
                  color=[STRATEGY_COLOURS.get(n, "#888888") for n in names])
    top = max(values) if any(values) else 1.0
    gists = list(reasons) or [""] * len(names)
    for bar, value, reason in zip(bars, throughputs, gists, strict=True):
        label = f"{value:,.0f}" if value is not None else reason.split(":")[0] \
            if reason.startswith("not ") else "does not fit"
        ax.text(bar.get_x() + bar.get_width() / 2, (value or 0) + top * 0.01, label,
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(positions))
    ax.set_xticklabels([f"{n}\n{p}" for n, p in zip(names, placements, strict=True)],
                       fontsize=8)
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_ylim(0, top * 1.15)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


OPERATION_COLOURS = {"generate": "#264653", "infer": "#2a9d8f", "train": "#e76f51",
                     "controller": "#e9c46a", "transition": "#999999", "transfer": "#8d99ae"}
"""Timeline colours: the GPU operations, work on the controller's CPU (a rule reward, the
advantage), the actor's train->generate transition and transfers between sets."""

MIN_VISIBLE_FRACTION = 0.006
"""Transitions and transfers shorter than this share of the iteration are drawn this wide
(and outlined), so that they can be seen; their seconds are in the trace."""


def _legend_kind(event: TimelineEvent) -> str:
    """The legend entry an event is drawn as (a key of ``OPERATION_COLOURS``)."""
    if event.kind in ("transition", "transfer"):
        return event.kind
    if event.lane == "controller":
        return "controller"
    return event.operation


def timeline_gantt(events: Sequence[TimelineEvent], path: Path, title: str) -> Path:
    """One row per colocated set (plus controller and network when they are visible at this
    scale), one bar per operation; the legend names only the kinds drawn."""
    end = max((e.end for e in events), default=1.0)
    longest: dict[str, float] = {}
    for event in events:
        longest[event.lane] = max(longest.get(event.lane, 0.0), event.seconds)
    lanes = [lane for lane in longest
             if lane not in ("controller", "network") or longest[lane] > 0.002 * end]
    events = [e for e in events if e.lane in lanes]
    fig, ax = _figure(figsize=(10, 1.3 + 0.45 * len(lanes)), layout="constrained")
    drawn: set[str] = set()
    for event in events:
        row = lanes.index(event.lane)
        kind = _legend_kind(event)
        colour = OPERATION_COLOURS.get(kind, "#888888")
        drawn.add(kind)
        small = event.kind in ("transition", "transfer") and \
            event.seconds < MIN_VISIBLE_FRACTION * end
        ax.barh(row, max(event.seconds, MIN_VISIBLE_FRACTION * end) if small else
                event.seconds, left=event.start, height=0.6, color=colour,
                edgecolor="black" if small else "white", linewidth=0.5)
        if event.kind == "compute" and event.seconds > end * 0.04:
            ax.text(event.start + event.seconds / 2, row, f"{event.role}\n{event.operation}",
                    ha="center", va="center", fontsize=7,
                    color="black" if kind == "controller" else "white")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (seconds)")
    ax.set_xlim(0, end * 1.01)
    ax.set_title(title, fontsize=10)
    legend = [Patch(color=colour, label=name) for name, colour in OPERATION_COLOURS.items()
              if name in drawn]
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), fontsize=8,
               frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def memory_by_set(memory: Sequence[SetMemory], path: Path, title: str) -> Path:
    """Per-GPU memory of each set at its peak, stacked by kind, against what is usable."""
    fig, ax = _figure(figsize=(8.5, 4.2))
    mixed = len({m.device for m in memory}) > 1
    labels = [f"{m.label}\n({m.gpus} x {m.device})" if mixed else f"{m.label}\n({m.gpus} GPUs)"
              for m in memory]
    bottoms = [0.0] * len(memory)
    for kind in MEMORY_KINDS:
        values = [getattr(m.peak, kind) / GIB for m in memory]
        ax.bar(range(len(memory)), values, bottom=bottoms, label=kind.replace("_", " "),
               color=MEMORY_COLOURS[kind])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    if memory:
        usables = [m.available_bytes / GIB for m in memory]
        if len(set(usables)) == 1:
            ax.axhline(usables[0], color="black", linestyle="--", linewidth=1,
                       label=f"usable ({usables[0]:.0f} GiB)")
        else:  # a mixed cluster: each set against its own device's memory
            ax.hlines(usables, [i - 0.45 for i in range(len(memory))],
                      [i + 0.45 for i in range(len(memory))], color="black", linestyle="--",
                      linewidth=1, label="usable on the set's device")
        ax.set_ylim(0, max(*usables, *bottoms) * 1.1)
    ax.set_xticks(range(len(memory)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def throughput_vs_gpus(gpus: Sequence[int], series: dict[str, Sequence[float | None]],
                       path: Path, title: str) -> Path:
    """Throughput of each strategy against cluster size (the shape of HybridFlow Fig. 12)."""
    fig, ax = _figure(figsize=(7.5, 4.5))
    markers = {"searched": "o", "colocate": "s", "standalone": "^", "split": "D"}
    for name, values in series.items():
        xs = [g for g, v in zip(gpus, values, strict=True) if v]
        ys = [v for v in values if v]
        if not xs:
            continue
        if name == "searched":
            # Drawn wide and underneath: where a standard strategy is the optimum, both show.
            ax.plot(xs, ys, label="searched (best)", color=STRATEGY_COLOURS["searched"],
                    linewidth=7, alpha=0.35, zorder=1, solid_capstyle="round")
        else:
            ax.plot(xs, ys, marker=markers.get(name, "o"), label=name, zorder=2,
                    color=STRATEGY_COLOURS.get(name, "#888888"), linewidth=1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(gpus))
    ax.set_xticklabels([str(g) for g in gpus])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)
