"""What every import shares: the models a launch names, the job's parts a launch does not say
(device, node shape, response-length distribution: from ``--job`` or options), and the plan
built from the layouts read.

A launch names its models by checkpoint (a local directory, or a Hugging Face hub id). A local
checkpoint's ``config.json`` is read; a hub id is matched to a preset of the same architecture
(``MODEL_ALIASES``: each names the configs it rests on); anything else is refused in one line
that says how to give the architecture (``--model ROLE=PRESET|SPEC.yaml|config.json``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.space import pack
from profiles.datafile import SpecError
from simulator.plan import ColocatedSet, Plan, RolePlan, RolloutSet
from simulator.specs.cluster import ClusterSpec
from simulator.specs.job import RULE, JobSpec
from simulator.specs.lengths import LengthDistribution
from simulator.specs.model import ModelSpec
from simulator.specs.presets import MODEL_PRESETS, load_model

MODEL_ALIASES = {
    # Qwen2-7B and Qwen2.5-7B (and its Math / Coder / Instruct variants) share one
    # architecture: 28 layers, hidden 3584, intermediate 18944, 28 heads / 4 KV heads, vocab
    # 152064 (huggingface.co/Qwen/Qwen2-7B/blob/main/config.json and Qwen/Qwen2.5-Math-7B).
    "qwen2-7b": "qwen2.5-7b",
    "qwen2-72b": "qwen2.5-72b",   # Qwen/Qwen2-72B config.json: the architecture of Qwen2.5-72B
    "meta-llama-3-8b": "llama3-8b",
    "meta-llama-3-70b": "llama3-70b",
    "meta-llama-3.1-8b": "llama3.1-8b",
    "llama-3.1-8b": "llama3.1-8b",
    "llama-3-8b": "llama3-8b",
    "llama-2-7b": "llama2-7b",
    "llama-2-13b": "llama2-13b",
    "llama-2-70b": "llama2-70b",
}
"""A checkpoint's normalized name -> the preset of the same architecture."""

VARIANT_WORDS = {"instruct", "chat", "base", "hf", "math", "coder", "it", "rl"}
"""Name parts of fine-tuned variants that leave the architecture unchanged."""


def preset_for(checkpoint: str) -> str | None:
    """The preset with ``checkpoint``'s architecture, from its name (``Qwen/Qwen2.5-7B-Instruct``
    -> qwen2.5-7b), or None."""
    name = re.sub(r"[^\w.\-]", "", checkpoint.rstrip("/}\"'").rsplit("/", 1)[-1].lower())
    words = [w for w in name.split("-") if w not in VARIANT_WORDS]
    candidates = {"-".join(words), name}
    for candidate in sorted(candidates):
        if candidate in MODEL_PRESETS:
            return candidate
        if candidate in MODEL_ALIASES:
            return MODEL_ALIASES[candidate]
    return None


@dataclass(slots=True)
class ImportContext:
    """What the user gives beside the launch."""

    device: str | None = None
    """Device profile of the cluster (required unless ``job`` gives the cluster)."""
    models: dict[str, str] = field(default_factory=dict)
    """Role -> preset, spec YAML or config.json (overrides the launch's checkpoints)."""
    job: JobSpec | None = None
    """A job whose models, cluster and response lengths fill what the launch does not say."""
    base_dir: Path | None = None
    """Where relative checkpoint paths of the launch are found."""
    notes: list[str] = field(default_factory=list)
    """What the import assumed (printed with the prediction)."""


def resolve_model(role: str, checkpoint: str | None, key: str, context: ImportContext
                  ) -> ModelSpec:
    """The architecture of ``role``'s model: ``--model``, else the job's, else the launch's
    checkpoint (``key``) read locally or matched by name."""
    if role in context.models:
        return load_model(context.models[role], key=f"--model {role}")
    if context.job is not None and role in context.job.models \
            and context.job.models[role] != RULE:
        return context.job.model(role)
    if not checkpoint:
        raise SpecError(f"the launch names no {role} model: give --model {role}=PRESET", key=key)
    path = Path(checkpoint).expanduser()
    if context.base_dir is not None and not path.is_absolute():
        path = context.base_dir / path
    if (path / "config.json").is_file() or (path.suffix == ".json" and path.is_file()):
        return load_model(str(path), key=key)
    preset = preset_for(checkpoint)
    if preset is None:
        raise SpecError(f"cannot tell the architecture of {checkpoint!r} (not a local "
                        f"checkpoint, no preset of that name): give --model {role}=PRESET|"
                        "SPEC.yaml|config.json (presets: hybridflow list models)", key=key)
    if preset != checkpoint:
        context.notes.append(f"{role}: {checkpoint} read as the {preset} architecture")
    return MODEL_PRESETS[preset]


def response_lengths(max_tokens: int, context: ImportContext) -> LengthDistribution:
    """The responses' lengths: the job's distribution when its longest response is the
    launch's, else every response at the launch's maximum (a bound: real responses are
    shorter, so give ``--job`` with a distribution for a closer price)."""
    if context.job is not None and context.job.workload.response_length.max_tokens == max_tokens:
        return context.job.workload.response_length
    context.notes.append(f"every response priced at the launch's maximum, {max_tokens} tokens "
                         "(give --job with a response_length distribution for a closer price)")
    return LengthDistribution.fixed(max_tokens)


@dataclass(slots=True)
class LaunchLayout:
    """What a launch places and how it lays each model out."""

    sets: list[tuple[tuple[str, ...], int]]
    """(roles, GPUs) of each training set, the actor's first."""
    roles: dict[str, RolePlan]
    mode: str = "sync"
    max_staleness: int = 0
    partial_rollout: bool = False
    rollout_gpus: int = 0


def build_plan(job: JobSpec, layout: LaunchLayout, *, strategy: str = "imported") -> Plan:
    """The plan of a launch: its training sets packed as the search packs them (whole nodes
    first, then parts of nodes), the rollout set on the cluster's last GPUs."""
    total = job.cluster.total_gpus
    trainer_gpus = total - layout.rollout_gpus
    sizes = tuple(gpus for _, gpus in layout.sets)
    # The trainer's GPUs as the asynchronous search sees them (the cluster less the rollout's).
    per_node = job.cluster.with_total_gpus(trainer_gpus).gpus_per_node if layout.rollout_gpus \
        else job.cluster.gpus_per_node
    firsts = pack(sizes, trainer_gpus, per_node)
    if firsts is None:
        raise SpecError(f"the launch's sets of {'+'.join(map(str, sizes))} GPUs do not fit "
                        f"{trainer_gpus} GPUs in nodes of {per_node}", key="sets")
    sets = [ColocatedSet(roles=roles, gpus=gpus, first_gpu=first)
            for (roles, gpus), first in zip(layout.sets, firsts, strict=True)]
    rollout = RolloutSet(gpus=layout.rollout_gpus, first_gpu=trainer_gpus) \
        if layout.rollout_gpus else None
    return Plan(algorithm=job.algorithm, sets=tuple(sets), roles=layout.roles,
                strategy=strategy, mode=layout.mode, max_staleness=layout.max_staleness,
                partial_rollout=layout.partial_rollout, rollout=rollout)


def parse_bool(value: Any, key: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "null", "none", ""):
        return False
    raise SpecError(f"expected true or false, got {value!r}", key=key)


def parse_int(value: Any, key: str) -> int:
    try:
        number = parse_float(value, key)
    except SpecError as exc:
        raise SpecError(exc.problem.replace("a number", "an integer"), key=key) from None
    if not number.is_integer():
        raise SpecError(f"expected an integer, got {value!r}", key=key)
    return int(number)


def parse_float(value: Any, key: str) -> float:
    text = str(value).strip()
    if "$" in text:
        raise SpecError(f"{text} is a shell variable the script does not set: give "
                        f"--env {text.strip('${}').split(':')[0]}=VALUE", key=key)
    try:
        return float(text)
    except ValueError:
        raise SpecError(f"expected a number, got {value!r}", key=key) from None


def clean(value: str) -> str:
    """A Hydra value without its quotes."""
    return re.sub(r"^['\"](.*)['\"]$", r"\1", value.strip())


def read_launch_as(launch: Any, context: ImportContext,
                   read: Callable[[Any, ImportContext], tuple[JobSpec, Plan]]
                   ) -> tuple[JobSpec, Plan]:
    """``read(launch, context)``, its errors naming the launch's file."""
    try:
        return read(launch, context)
    except SpecError as exc:
        raise exc.within(source=launch.source) from None


def launch_cluster(gpus: int, gpus_per_node: int, context: ImportContext, *,
                   key: str) -> ClusterSpec:
    """The cluster the launch uses: the job's (when it holds the launch's GPUs), else as many
    nodes of ``--device`` as the pools fill. ``key`` names the launch setting that
    sets the GPU count, for the message when the job's cluster is too small."""
    if context.job is not None:
        cluster = context.job.cluster
        if cluster.total_gpus < gpus:
            raise SpecError(f"the launch uses {gpus} GPUs; the job's cluster has "
                            f"{cluster.total_gpus}", key=key)
        return cluster
    if context.device is None:
        raise SpecError("a launch does not say which GPUs run it: give --device (hybridflow "
                        "list devices) or --job", key="--device")
    nodes = max(1, -(-gpus // gpus_per_node))
    return ClusterSpec.homogeneous(nodes=nodes, gpus_per_node=min(gpus_per_node, gpus)
                                   if nodes == 1 else gpus_per_node, device=context.device)
