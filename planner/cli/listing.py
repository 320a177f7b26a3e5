"""``hybridflow list``: presets, devices, algorithms and frameworks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    pass
from planner.cli.common import (
    GIB,
    _held_out_accuracy,
    cli,
)


@cli.command("list")
@click.argument("what", type=click.Choice(["models", "devices", "algorithms"]))
def list_(what: str) -> None:
    """List model presets, device profiles or algorithms."""
    if what == "models":
        from simulator.specs.presets import MODEL_PRESETS

        for name, model in MODEL_PRESETS.items():
            moe = (f"  moe {model.moe.experts} experts top-{model.moe.top_k}, "
                   f"{model.active_param_count / 1e9:.2f}B active" if model.moe else "")
            click.echo(f"{name:<16} {model.param_count / 1e9:8.2f}B  layers {model.layers:<4} "
                       f"hidden {model.hidden:<6} heads {model.heads}/{model.kv_heads}{moe}")
    elif what == "devices":
        from profiles.device import available_profiles, load_profile

        names = available_profiles()
        width = max(12, *(len(n) for n in names))
        for name in names:
            p = load_profile(name)
            click.echo(f"{name:<{width}} {p.peak_flops('bf16') / 1e12:6.0f} TFLOP/s bf16  "
                       f"{p.memory_bytes / GIB:6.1f} GiB  {p.description}")
            measured = _held_out_accuracy(p)
            if measured:
                click.echo(f"{'':<{width}} {measured}")
    else:
        from simulator.specs.dataflow import DATAFLOWS

        for name, dataflow in DATAFLOWS.items():
            click.echo(f"{name:<10} roles: {', '.join(dataflow.roles):<32} {dataflow.description}")
