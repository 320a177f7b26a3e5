"""Framework profiles: how an RLHF system runs a dataflow on the hardware.

A device profile (``profiles/devices/``) says what a GPU and its links can do; a framework
profile (``profiles/frameworks/NAME.yaml``) says how a training system uses them: which passes
it runs (the old-log-prob recompute), whether it overlaps gradient reduction, whether its
rollout engine runs CUDA graphs or eager kernels, whether it frees the KV cache between
iterations and what waking the engine costs, which resharding scheme moves the actor's weights
into the engine, what it offloads to host memory between phases, how its driver hands each
call its batch, and the fixed costs it pays
per call, optimizer step, micro-batch and iteration. Every number in a shipped profile names
its source in a comment; a value no public source gives is 0 and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from profiles.datafile import (
    SpecError,
    convert,
    field_parser,
    from_mapping,
    merged_mapping,
    read_mapping,
    require,
)
from profiles.framework_space import FrameworkSpace

FRAMEWORKS_DIR = Path(__file__).resolve().parent / "frameworks"
"""Where the shipped framework profiles live."""

DEFAULT_FRAMEWORK = "verl"
"""The framework a job runs on unless it says otherwise (HybridFlow's open-source system)."""

TransitionScheme = Literal["all_gpus", "train_group", "micro_dp"]
FsdpGather = Literal["hierarchical", "dtensor_fp32"]
MegatronGather = Literal["hierarchical", "tp_then_pp_broadcast"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Passes:
    """Which forward passes the framework runs beyond the algorithm's own."""

    old_log_prob: bool = True
    """The actor recomputes the log-probs of every generated sequence with its training engine
    after generation (one more forward over the batch on the actor's GPUs), instead of using
    the rollout engine's."""
    one_step_off_old_log_prob: bool | None = None
    """The same in ``one_step_off`` mode, where the generating policy is one update behind
    (None: as ``old_log_prob``)."""
    async_old_log_prob: bool | None = None
    """The same in ``async`` mode (None: as ``old_log_prob``)."""

    def old_log_prob_in(self, mode: str) -> bool:
        """Whether the recompute runs in ``mode`` (sync and auto: the synchronous trainer)."""
        by_mode = {"one_step_off": self.one_step_off_old_log_prob,
                   "async": self.async_old_log_prob}.get(mode)
        return self.old_log_prob if by_mode is None else by_mode


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
    transition_megatron_gather: MegatronGather = "hierarchical"
    """How a Megatron-trained tensor is gathered whole under ``train_group``. hierarchical:
    one all-gather over the tensor x pipeline group (between nodes each local rank's share,
    then inside each node). tp_then_pp_broadcast: tensor by tensor, an all-gather over the
    stage's tensor-parallel ranks, then a broadcast of the tp-complete tensor from its stage
    to the other stages (NeMo-RL v0.3's refit): pipeline stages are tp x dp ranks apart, so
    across nodes every GPU receives the other stages' whole tensors over its own NIC."""
    transition_fsdp_gather: FsdpGather = "hierarchical"
    """How an FSDP-trained tensor is gathered whole under ``all_gpus``. hierarchical: in the
    training dtype, as one all-gather over the sharding group (between nodes each local rank's
    share, then inside each node). dtensor_fp32: DTensor ``full_tensor()`` of fp32 master
    weights, cast to the training dtype afterwards (NeMo-RL's DTensor policy, verl's FSDP
    actor): every byte moves in fp32, and on a (data, tensor)-parallel mesh torch gathers the
    innermost mesh dimension first, so the tensor-parallel ranks of a node gather first and
    the data-parallel ranks then exchange the tensor-complete weights across nodes."""
    grad_reduce_in_fp32: bool = True
    """Megatron-style training keeps (and reduces) its main gradients in fp32; false: in the
    training dtype (half the gradient memory and traffic)."""
    sequence_packing: bool = False
    """Training and the log-prob passes pack sequences into bins of (longest sequence x
    micro-batch size) tokens, one bin per micro-batch (NeMo-RL's sequence_packing): bins
    filled first-fit-decreasing, dealt round-robin to the data-parallel ranks (the busiest
    paces the step) and, with pipeline parallelism, each padded to its rank's longest bin
    (``simulator/packing.py``). False: micro-batches of ``micro_batch_size`` sequences."""
    token_budget_per_tensor_rank: bool = False
    """A per-GPU token budget (``micro_batch_tokens``) counts every GPU of the model-parallel
    group that shares a micro-batch, tensor-parallel ranks included (OpenRLHF: the budget
    times ring_attn_size x tensor_parallel_size); False: only the ranks that split each
    sequence (verl: times the Ulysses or context-parallel size)."""
    context_parallel_exchange: Literal["ring", "all_gather"] = "ring"
    """How context-parallel ranks get each other's keys and values in every attention layer:
    ring = Megatron's ring of point-to-point steps hidden behind attention on zigzag-balanced
    chunks; all_gather = ring-flash-attn's llama3 variant (OpenRLHF's ring attention):
    all-gathers of the whole micro-batch's keys and values, unhidden, on contiguous slices
    (``simulator/costs/context_parallel.py``)."""
    logprob_forward_bytes_per_vocab_entry: float = 12.0
    """HBM bytes per token and vocabulary entry of computing log-probs over the full
    vocabulary in a forward pass (a fused fp32 log-softmax: read the logits, write the
    probabilities, a few passes, 3 x 4 bytes)."""
    logprob_backward_bytes_per_vocab_entry: float = 24.0
    """The same in the training backward (twice the forward's fused passes)."""
    fsdp_logits_bytes_per_vocab_entry: float = 8.0
    """Bytes held per token and vocabulary entry while an FSDP-engine (torch-family) model's
    loss runs: fp32 logits and their fp32 gradient (8) unless the framework says otherwise.
    Megatron-family layouts keep 8 (Megatron's cross entropy saves an fp32 copy of the
    logits and computes its gradient in it, megatron-core tensor_parallel/cross_entropy.py)."""
    fsdp_forward_logits_bytes_per_vocab_entry: float = 8.0
    """The same in a forward-only log-prob pass (fp32 logits and their log-softmax)."""
    fsdp_entropy_bytes_per_vocab_entry: float = 0.0
    """Bytes the actor's recompute of the old log-probs adds per token and vocabulary entry
    when the framework also computes the policy's entropy there (the softmax and its product
    with the logits)."""
    loss_per_packed_sequence: bool = False
    """With sequence packing, the loss runs once per sequence of a bin on a slice of the bin's
    fp32 logits: each slice's backward materialises a zero-filled gradient of the whole bin's
    logits and the k gradients are summed, (16k - 4) more bytes per token and vocabulary entry
    for k sequences per bin."""
    reference_weights: Literal["gpu", "host_swap"] = "gpu"
    """gpu: the reference model is a model of its own, resident on its GPUs; host_swap: its
    weights live in host memory and are swapped into the actor's model for the reference pass
    (the actor's weights go to host and come back), so a reference colocated with the actor
    holds no GPU memory and its pass runs in the actor's layout."""

    def __post_init__(self) -> None:
        for name in ("logprob_forward_bytes_per_vocab_entry",
                     "logprob_backward_bytes_per_vocab_entry",
                     "fsdp_logits_bytes_per_vocab_entry",
                     "fsdp_forward_logits_bytes_per_vocab_entry",
                     "fsdp_entropy_bytes_per_vocab_entry"):
            require(getattr(self, name) >= 0, "must be >= 0", name)


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
    weight_backup_on_host_link: bool = False
    """The engine backs its weights up to pinned host memory by plain copies when it sleeps
    and copies them back when it wakes, at the device profile's ``host_link`` pinned rate
    (torch_memory_saver's CPU backup under SGLang); the measured rates above are then 0."""
    pipeline_parallel: bool = True
    """The framework starts the engine with a pipeline-parallel size (vLLM's
    pipeline_parallel_size); False: tensor (and expert) parallelism only."""
    workspace_in_memory_fraction: bool = True
    """The engine's memory fraction bounds its weights, KV cache and activation workspace
    (vLLM's gpu_memory_utilization); False: weights and KV cache only, the workspace sits
    outside it (SGLang's mem_fraction_static)."""
    weights_alias_training: bool = False
    """The engine computes on views of the training shards (the 3D-HybridEngine), so it adds
    only the gathered rest; otherwise (vLLM) it holds its own copy of the weights."""
    gpu_memory_utilization: float = 0.9
    """Default fraction of GPU memory the engine may fill with its weights, KV cache and
    workspace. vLLM applies it per engine instance: memory the training states hold is not
    counted against it, but must still fit beside it."""
    max_num_seqs: int = 256
    """Default cap on sequences decoded at once per engine replica."""
    decode_host_seconds_per_sequence: float = 0.0
    """Host work of the engine per running sequence per decode step (scheduling, input
    preparation, output processing) that the GPU waits for: serialised with the step when the
    engine does not schedule asynchronously, s."""

    def __post_init__(self) -> None:
        for name in ("wake_seconds", "sleep_seconds", "weight_backup_bytes_per_s",
                     "weight_restore_bytes_per_s", "decode_host_seconds_per_sequence"):
            require(getattr(self, name) >= 0, "must be >= 0", name)
        require(0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]",
                "gpu_memory_utilization")
        require(self.max_num_seqs >= 1, "must be a positive integer", "max_num_seqs")
        require(not self.weight_backup_on_host_link
                or (self.weight_backup_bytes_per_s == 0 and self.weight_restore_bytes_per_s == 0),
                "the host link's rate prices the backup: set weight_backup_bytes_per_s and "
                "weight_restore_bytes_per_s to 0", "weight_backup_on_host_link")


HostCopy = Literal["pinned_buffer", "new_pageable", "freed"]
"""How a framework parks a training state in host memory between phases.

pinned_buffer: copied into a page-locked host buffer that is kept between iterations, and back
(Megatron's parameter buffer ``offload_to_cpu``: ``param_data.cpu().pin_memory()`` once, then
``copy_``); new_pageable: copied tensor by tensor into freshly allocated pageable memory
(``tensor.to("cpu")``), which the kernel maps page by page on first touch, and back from it;
freed: dropped and re-created (zeroed) on the way back, nothing copied (Megatron's gradient
buffer, ``storage().resize_(0)``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OffloadSettings:
    """Trained models' states moved to host memory while the rollout engine runs (and back
    before they are needed), so that the KV cache can use their GPU memory. The copy rates are
    the device's (``host_link`` of the device profile)."""

    optimizer: bool = False
    """Adam states (and fp32 master weights) leave the GPU around generation."""
    grads: bool = False
    """Gradient buffers leave the GPU around generation."""
    params: bool = False
    """Parameters leave the GPU around generation (the engine holds its own copy meanwhile)."""
    optimizer_to: HostCopy = "new_pageable"
    """How the optimizer states are parked (see HostCopy)."""
    grads_to: HostCopy = "freed"
    """How the gradient buffers are parked."""
    params_to: HostCopy = "pinned_buffer"
    """How the parameters are parked."""

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


Dispatch = Literal["shared", "per_worker"]
Collect = Literal["one_per_shard", "every_worker"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ControllerSettings:
    """How the single driver hands a model call its batch and takes the results back. The
    driver pickles the batch's CPU tensors on one thread (Ray passes numpy arrays zero-copy,
    but torch tensors are pickled by copying their storage), so a call costs the batch's bytes
    over the serialization rate, once per copy it sends. The batch is padded to its longest
    sequence. A byte count of 0 leaves that leg unpriced."""

    dispatch: Dispatch = "shared"
    """'shared': each data-parallel shard is serialized once and its tensor x pipeline
    parallel workers read that one object (``ray.put`` first); 'per_worker': every worker
    gets its own by-value copy, so the driver pickles each shard tp x pp times."""
    collect: Collect = "one_per_shard"
    """'every_worker': the driver fetches and unpickles every worker's result, the replicated
    ones too, before keeping one per shard; 'one_per_shard': only one worker's per shard."""
    infer_input_bytes_per_token: float = 0.0
    """Bytes per padded token slot of the batch a forward-only call (log-probs, values) gets."""
    train_input_bytes_per_token: float = 0.0
    """Bytes per padded token slot of the batch a training call gets."""
    infer_output_bytes_per_token: float = 0.0
    """Bytes per padded token slot a forward-only call returns from each worker it collects."""
    serialize_bytes_per_s: float | None = None
    """Rate at which the driver (or a worker) pickles batch tensors, bytes per second
    (``benchmarks/bench_dispatch.py`` measures it); needed once a byte count is set."""
    deserialize_bytes_per_s: float | None = None
    """Rate at which a process unpickles them, bytes per second; needed likewise."""

    def __post_init__(self) -> None:
        for name in BYTE_COUNTS:
            require(getattr(self, name) >= 0, "must be >= 0", name)
        for name in ("serialize_bytes_per_s", "deserialize_bytes_per_s"):
            rate = getattr(self, name)
            require(rate is None or rate > 0, "must be > 0", name)
            require(rate is not None or not self.priced,
                    "needed when a batch byte count is set (benchmarks/bench_dispatch.py "
                    "measures it)", name)

    @property
    def priced(self) -> bool:
        """Whether any leg of the dispatch has a byte count."""
        return any(getattr(self, name) > 0 for name in BYTE_COUNTS)


BYTE_COUNTS = ("infer_input_bytes_per_token", "train_input_bytes_per_token",
               "infer_output_bytes_per_token")
"""ControllerSettings' batch byte counts (0: that leg is not priced)."""


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
    rollout_engine: str = "vllm"
    """The rollout engine ``rollout:`` describes (the framework's default)."""
    rollout_engines: tuple[tuple[str, RolloutSettings], ...] = field(
        default=(), metadata=field_parser(lambda value, key: _parse_engines(value, key)))
    """Other rollout engines the framework runs, by name, each read as ``rollout:`` with its
    own settings on top (a job picks one with ``rollout_engine:``)."""
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    fixed_costs: FixedCosts = field(default_factory=FixedCosts)
    space: FrameworkSpace = field(default_factory=FrameworkSpace)
    """What the framework can express: the search space of its jobs
    (``profiles/framework_space.py``)."""

    @property
    def rollout_engine_names(self) -> tuple[str, ...]:
        return (self.rollout_engine, *(name for name, _ in self.rollout_engines))

    def rollout_for(self, engine: str | None) -> RolloutSettings:
        """The settings of rollout engine ``engine`` (None: the default)."""
        if engine is None or engine == self.rollout_engine:
            return self.rollout
        for name, settings in self.rollout_engines:
            if name == engine:
                return settings
        raise SpecError(f"framework {self.name} has no rollout engine {engine!r} (engines: "
                        f"{', '.join(self.rollout_engine_names)})", key="rollout_engine")

    def transition_scheme(self, sharding: str) -> TransitionScheme:
        """The resharding scheme for an actor trained with ``sharding``."""
        return self.training.transition_fsdp if sharding == "fsdp" else \
            self.training.transition_megatron


def _parse_engines(value: object, key: str) -> tuple[tuple[str, RolloutSettings], ...]:
    """``rollout_engines:`` as a mapping of engine name -> RolloutSettings (each already
    merged onto ``rollout:`` by ``_engines_on_rollout``)."""
    if not isinstance(value, dict):
        raise SpecError(f"expected a mapping of engine name -> rollout settings, got "
                        f"{value!r}", key=key)
    return tuple((str(name), convert(settings or {}, RolloutSettings, f"{key}.{name}"))
                 for name, settings in value.items())


def _engines_on_rollout(data: dict) -> dict:
    """The profile's mapping with each of ``rollout_engines`` read as ``rollout:`` plus its
    own settings."""
    engines = data.get("rollout_engines")
    if not isinstance(engines, dict):
        return data
    rollout = data.get("rollout") or {}
    return {**data, "rollout_engines": {
        name: merged_mapping(rollout, settings) if isinstance(settings, dict) else settings
        for name, settings in engines.items()}}


def available_frameworks() -> list[str]:
    return sorted(p.stem for p in FRAMEWORKS_DIR.glob("*.yaml"))


def resolve_framework_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.exists():
            raise SpecError(f"framework profile file not found: {name_or_path}",
                            key="framework")
        return candidate
    path = FRAMEWORKS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise SpecError(f"unknown framework {name_or_path!r} (available: "
                        f"{', '.join(available_frameworks())})", key="framework")
    return path


def framework_mapping(name_or_path: str, chain: tuple[str, ...] = ()) -> dict:
    """A profile's raw mapping with its ``base:`` profiles applied underneath it: a profile
    that names a base only writes what differs (a release of a framework, or a user's
    settings on top of a shipped profile)."""
    path = resolve_framework_path(name_or_path)
    if str(path) in chain:
        raise SpecError(f"profiles name each other as base: {' -> '.join(chain)}",
                        key="base", source=str(path))
    data = read_mapping(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise SpecError("expected the name or path of another framework profile",
                        key="base", source=str(path))
    if not base.endswith((".yaml", ".yml")) or Path(base).is_absolute():
        parent = base
    else:
        parent = str(path.parent / base)
    return merged_mapping(framework_mapping(parent, (*chain, str(path))), data)


@cache
def load_framework(name_or_path: str = DEFAULT_FRAMEWORK) -> FrameworkProfile:
    """A framework profile by name (``verl``) or path (read once; profiles are immutable)."""
    path = resolve_framework_path(name_or_path)
    return from_mapping(FrameworkProfile, _engines_on_rollout(framework_mapping(name_or_path)),
                        source=str(path))


def write_fixed_costs_profile(base: str, fixed: FixedCosts, path: str | Path,
                              header: str = "") -> None:
    """Write a framework profile that is ``base`` with ``fixed`` as its fixed costs: a file
    that names ``base`` and holds only what differs, checked to load back before it is
    written (atomically)."""
    import os

    import yaml

    from profiles.datafile import to_mapping, write_text_atomic

    out = Path(path)
    base_ref = base
    if base.endswith((".yaml", ".yml")):
        # framework_mapping resolves a relative base against the profile's own directory.
        base_ref = os.path.relpath(Path(base).resolve(), out.resolve().parent)
    mapping = {"base": base_ref, "name": out.stem,
               "description": f"{load_framework(base).name} with fixed costs fitted by "
                              "hybridflow calibrate",
               "fixed_costs": to_mapping(fixed)}
    from_mapping(FrameworkProfile,
                 _engines_on_rollout(merged_mapping(framework_mapping(base), {
                     k: v for k, v in mapping.items() if k != "base"})), source=str(out))
    text = yaml.safe_dump(mapping, sort_keys=False)
    write_text_atomic(out, (header if header.endswith("\n") or not header else header + "\n")
                      + text)
