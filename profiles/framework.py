"""Framework profiles: how an RLHF system runs a dataflow on the hardware.

A device profile (``profiles/devices/``) says what a GPU and its links can do; a framework
profile (``profiles/frameworks/NAME.yaml``) says how a training system uses them: which passes
it runs (the old-log-prob recompute), whether it overlaps gradient reduction, whether its
rollout engine runs CUDA graphs or eager kernels, whether it frees the KV cache between
iterations and what waking the engine costs, which resharding scheme moves the actor's weights
into the engine, what it offloads to host memory between phases, and the fixed costs it pays
per call, optimizer step, micro-batch and iteration. Every number in a shipped profile names
its source in a comment; a value no public source gives is 0 and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from profiles.datafile import SpecError, from_mapping, read_mapping, require

FRAMEWORKS_DIR = Path(__file__).resolve().parent / "frameworks"
"""Where the shipped framework profiles live."""

DEFAULT_FRAMEWORK = "verl"
"""The framework a job runs on unless it says otherwise (HybridFlow's open-source system)."""

TransitionScheme = Literal["all_gpus", "train_group", "micro_dp"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Passes:
    """Which forward passes the framework runs beyond the algorithm's own."""

    old_log_prob: bool = True
    """The actor recomputes the log-probs of every generated sequence with its training engine
    after generation (one more forward over the batch on the actor's GPUs), instead of using
    the rollout engine's."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainingSettings:
    """Defaults of the training engine that the plan may override."""

    overlap_grad_reduce: bool = False
    """Default of the gradient reduction's overlap with the backward pass."""
    overlap_param_gather: bool = False
    """Default of the distributed optimizer's (or FSDP's) parameter all-gather overlap."""
    overlap_configurable: bool = True
    """Whether a user can turn the overlap on (then the search may choose it)."""
    transition_fsdp: TransitionScheme = "all_gpus"
    """How FSDP-trained actor weights reach the rollout engine (all_gpus: every tensor
    gathered whole on every GPU; micro_dp: the 3D-HybridEngine)."""
    transition_megatron: TransitionScheme = "train_group"
    """How Megatron-trained actor weights reach the rollout engine (train_group: gathered
    within the tensor x pipeline group)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RolloutSettings:
    """The rollout (generation) engine as the framework configures it."""

    cuda_graphs: bool = True
    """Decode steps replay CUDA graphs (one launch per step) instead of launching every kernel
    from the host (eager)."""
    free_kv_cache: bool = True
    """The engine sleeps after generation (KV cache freed) and wakes before the next."""
    wake_seconds: float = 0.0
    """Fixed cost of waking the engine once per generation (re-mapping the KV cache), s."""
    sleep_seconds: float = 0.0
    """Fixed cost of putting the engine to sleep once per generation, s."""
    weight_backup_bytes_per_s: float = 0.0
    """Sleep level 1 copies the engine's weights to host memory at this rate when it sleeps
    (0: weights are dropped, as at level 2, or kept)."""
    weight_restore_bytes_per_s: float = 0.0
    """...and back to the GPU at this rate when it wakes (0: nothing to restore)."""
    weights_alias_training: bool = False
    """The engine computes on views of the training shards (the 3D-HybridEngine), so it adds
    only the gathered rest; otherwise (vLLM) it holds its own copy of the weights."""
    gpu_memory_utilization: float = 0.9
    """Default fraction of GPU memory the engine may fill with its weights, KV cache and
    workspace. vLLM applies it per engine instance: memory the training states hold is not
    counted against it, but must still fit beside it."""
    max_num_seqs: int = 256
    """Default cap on sequences decoded at once per engine replica."""

    def __post_init__(self) -> None:
        for name in ("wake_seconds", "sleep_seconds", "weight_backup_bytes_per_s",
                     "weight_restore_bytes_per_s"):
            require(getattr(self, name) >= 0, "must be >= 0", name)
        require(0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]",
                "gpu_memory_utilization")
        require(self.max_num_seqs >= 1, "must be a positive integer", "max_num_seqs")


@dataclass(kw_only=True, slots=True, frozen=True)
class OffloadSettings:
    """Trained models' states moved to host memory while the rollout engine runs (and back
    before training), so that the KV cache can use their GPU memory."""

    optimizer: bool = False
    grads: bool = False
    params: bool = False
    bytes_per_s: float = 0.0
    """Rate of those copies (each direction), bytes/s."""
    seconds_per_tensor: float = 0.0
    """Fixed cost of each tensor copied (one copy per tensor and per state kind)."""

    def __post_init__(self) -> None:
        require(self.bytes_per_s >= 0, "must be >= 0", "bytes_per_s")
        require(self.seconds_per_tensor >= 0, "must be >= 0", "seconds_per_tensor")
        require(self.bytes_per_s > 0 or not (self.optimizer or self.grads or self.params),
                "an offload needs a copy rate > 0", "bytes_per_s")

    @property
    def any(self) -> bool:
        return self.optimizer or self.grads or self.params


@dataclass(kw_only=True, slots=True, frozen=True)
class FixedCosts:
    """Seconds the framework spends beyond the kernels and collectives the cost models price."""

    call_seconds: float = 0.0
    """Per controller call (dispatch to a worker group and collection of its result)."""
    optimizer_step_seconds: float = 0.0
    """Per optimizer step (gradient-norm check, logging, host synchronisation)."""
    micro_batch_seconds: float = 0.0
    """Per micro-batch of a training or inference pass (data preparation, host work)."""
    iteration_seconds: float = 0.0
    """Per RL iteration on the controller (metrics, data loading)."""

    def __post_init__(self) -> None:
        for name in ("call_seconds", "optimizer_step_seconds", "micro_batch_seconds",
                     "iteration_seconds"):
            require(getattr(self, name) >= 0, "must be >= 0", name)


@dataclass(kw_only=True, slots=True, frozen=True)
class FrameworkProfile:
    """How one RLHF framework runs a job. Loaded from ``profiles/frameworks/NAME.yaml``."""

    name: str
    version: str = ""
    """The release the profile describes (defaults change between releases)."""
    description: str = ""
    passes: Passes = field(default_factory=Passes)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    fixed_costs: FixedCosts = field(default_factory=FixedCosts)

    def transition_scheme(self, sharding: str) -> TransitionScheme:
        """The resharding scheme for an actor trained with ``sharding``."""
        return self.training.transition_fsdp if sharding == "fsdp" else \
            self.training.transition_megatron


def available_frameworks() -> list[str]:
    return sorted(p.stem for p in FRAMEWORKS_DIR.glob("*.yaml"))


def resolve_framework_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.exists():
            raise SpecError("framework profile file not found", source=name_or_path)
        return candidate
    path = FRAMEWORKS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise SpecError(f"unknown framework {name_or_path!r} (available: "
                        f"{', '.join(available_frameworks())})", key="framework")
    return path


@cache
def load_framework(name_or_path: str = DEFAULT_FRAMEWORK) -> FrameworkProfile:
    """A framework profile by name (``verl``) or path (read once; profiles are immutable)."""
    path = resolve_framework_path(name_or_path)
    return from_mapping(FrameworkProfile, read_mapping(path), source=str(path))
