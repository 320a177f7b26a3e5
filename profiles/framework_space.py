"""What a framework can express: the search space of a job that runs on it.

A framework profile's ``space:`` section lists which engines each role may use, which roles
must share one engine (or one tensor-parallel size, or one ZeRO stage), which parallel and
memory knobs each engine has, which placements its configuration can set up, and how its
rollout engine's layout relates to the training layout. The planner enumerates only layouts
inside this space, whatever is installed where ``plan`` runs (installed engines matter only to
``execute``), so a plan for framework X is something X runs. Each shipped profile names, next
to each rule, the framework's config schema or code at the version it describes.

Layout vocabulary (the simulator's ``ParallelConfig``): ``family`` torch = FSDP / ZeRO shards
or whole replicas, optional tensor parallelism, no pipeline; megatron = Megatron-core's
pipeline x tensor x data layouts with its distributed optimizer. Sharding: none (whole
replicas), optimizer (ZeRO-1 / distributed optimizer), fsdp (FSDP / ZeRO-3).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from profiles.datafile import SpecError, convert, field_parser, require

LayoutFamily = Literal["torch", "megatron"]
ShardingName = Literal["none", "optimizer", "fsdp"]
RecomputeName = Literal["none", "selective", "full"]
OffloadName = Literal["params", "optimizer"]
ModeName = Literal["sync", "one_step_off", "async"]

SHARDINGS = ("none", "optimizer", "fsdp")
RECOMPUTES = ("none", "selective", "full")
ALL_ROLES = ("actor", "critic", "ref", "reward", "cost")


@dataclass(kw_only=True, slots=True, frozen=True)
class EngineSpace:
    """One training or inference engine of a framework and the layouts it expresses."""

    family: LayoutFamily
    """Which layout family the engine's layouts belong to (see the module docstring)."""
    roles: tuple[str, ...] = ALL_ROLES
    """Roles this engine may run."""
    tensor_parallel: bool = False
    """Tensor parallelism inside a node (Megatron's tp, DeepSpeed's AutoTP, DTensor's tp)."""
    pipeline_parallel: bool = False
    """Pipeline stages (Megatron's pp)."""
    virtual_pipeline: bool = False
    """Interleaved virtual pipeline stages (Megatron's vpp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism, on whenever tp > 1."""
    expert_parallel: bool = False
    """Mixture-of-experts expert parallelism (ep, etp)."""
    ulysses: bool = False
    """DeepSpeed-Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size): each
    sequence's tokens split over sp ranks, heads exchanged by all-to-all around attention."""
    context_parallel: bool = False
    """Context parallelism: each sequence's tokens split over cp ranks that exchange keys and
    values in every attention layer (Megatron's context_parallel_size, OpenRLHF's
    --ds.ring_attn_size; how they exchange is the profile's
    training.context_parallel_exchange)."""
    hybrid_shard: bool = False
    """FSDP in groups of fewer than every data-parallel rank, each group holding a whole copy
    (hybrid sharding: verl's fsdp_size, FSDP2's 2-D mesh); searched at whole nodes."""
    trained_sharding: tuple[ShardingName, ...] = ("fsdp",)
    """How a trained model with more than one data-parallel rank shards its states (one GPU
    keeps its model whole)."""
    frozen_sharding: tuple[ShardingName, ...] = ("none",)
    """How a frozen model (reference, reward, cost) is laid out over its data-parallel ranks."""
    recompute: tuple[RecomputeName, ...] = ("none", "full")
    """Activation recompute settings the engine has (verl's FSDP engine: gradient
    checkpointing on or off; Megatron: recompute granularity selective or full)."""
    offload: tuple[OffloadName, ...] = ()
    """States the engine can keep in host memory between its calls (verl's param_offload and
    optimizer_offload), searched when the framework allows it."""
    token_budget: bool = False
    """Micro-batches by a token budget per GPU instead of a sequence count (verl's
    use_dynamic_bsz with ppo_max_token_len_per_gpu)."""
    uneven_stages: bool = False
    """Pipeline stages of unequal layer counts (Megatron's num_layers_in_first/last_pipeline_
    stage); False: pp (x vpp) divides the layers."""
    even_widths: bool = True
    """Tensor parallelism cuts the KV heads, the MLP and the vocabulary evenly (no padding or
    replicated KV heads)."""
    moe: bool = True
    """Runs mixture-of-experts models (without expert parallelism unless expert_parallel)."""

    def __post_init__(self) -> None:
        require(bool(self.roles), "an engine runs at least one role", "roles")
        for role in self.roles:
            require(role in ALL_ROLES, f"unknown role {role!r} (roles: {', '.join(ALL_ROLES)})",
                    "roles")
        require(bool(self.recompute), "list at least one recompute setting", "recompute")
        require(bool(self.trained_sharding) or not self.trains_any,
                "list at least one sharding for trained models", "trained_sharding")
        require(bool(self.frozen_sharding), "list at least one sharding for frozen models",
                "frozen_sharding")
        if self.family == "torch":
            require(not self.pipeline_parallel, "torch-family engines have no pipeline "
                    "(family: megatron)", "pipeline_parallel")
        else:
            require("fsdp" not in self.trained_sharding + self.frozen_sharding,
                    "Megatron-family engines shard optimizer states (optimizer), not "
                    "FSDP-style", "trained_sharding")
        require(not self.virtual_pipeline or self.pipeline_parallel,
                "virtual pipeline stages need pipeline_parallel", "virtual_pipeline")

    @property
    def trains_any(self) -> bool:
        return any(r in ("actor", "critic") for r in self.roles)

    def runs(self, role: str) -> bool:
        return role in self.roles


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationSpace:
    """The rollout engine's layouts."""

    nested: bool = False
    """The engine computes on the training shards (the 3D-HybridEngine): each GPU's training
    shard lies inside its generation shard, so generation tp and pp divide the training ones.
    False: the engine holds its own copy (vLLM, SGLang) and takes any layout that tiles the
    actor's GPUs."""
    fsdp_regroups: bool = False
    """Nested only: an FSDP-trained actor's generation shards regroup all of its GPUs (any
    tp_g that tiles them), instead of t_g dividing the training tp."""
    pipeline_parallel: bool = False
    """Generation pipeline stages (vLLM's pipeline_parallel_size)."""
    expert_parallel: bool = True
    """Expert-parallel serving of mixture-of-experts models."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PlacementRules:
    """Which roles may share GPUs, as patterns over every role the framework has:
    'actor,critic,ref|reward' is two sets. A job's placement is allowed when it equals a
    pattern once the roles the job does not run on GPUs are dropped. Empty: any placement."""

    sync: tuple[str, ...] = ()
    """Placements of a synchronous plan (the actor generates on its own GPUs)."""
    trainer: tuple[str, ...] = ()
    """Placements of the trainer's sets in one_step_off / async plans, beside the rollout
    set (empty: as ``sync``)."""

    def __post_init__(self) -> None:
        for name in ("sync", "trainer"):
            for i, pattern in enumerate(getattr(self, name)):
                groups = [g for g in pattern.split("|")]
                roles = [r.strip() for g in groups for r in g.split(",")]
                require(all(g.strip() for g in groups) and all(roles),
                        f"{pattern!r}: sets separated by '|', roles by ','", f"{name}[{i}]")
                for role in roles:
                    require(role in ALL_ROLES, f"unknown role {role!r} in {pattern!r}",
                            f"{name}[{i}]")
                require(len(set(roles)) == len(roles), f"a role appears twice in {pattern!r}",
                        f"{name}[{i}]")

    def allows(self, groups: tuple[tuple[str, ...], ...], roles: tuple[str, ...], *,
               trainer: bool) -> bool:
        """Whether the placement ``groups`` of the job's GPU ``roles`` is one of the
        patterns (projected on those roles)."""
        patterns = (self.trainer or self.sync) if trainer else self.sync
        if not patterns:
            return True
        wanted = frozenset(frozenset(g) for g in groups)
        return any(project(pattern, roles) == wanted for pattern in patterns)


def project(pattern: str, roles: tuple[str, ...]) -> frozenset[frozenset[str]]:
    """The sets of ``pattern`` restricted to ``roles`` (empty sets dropped)."""
    out = []
    for group in pattern.split("|"):
        kept = frozenset(r.strip() for r in group.split(",") if r.strip() in roles)
        if kept:
            out.append(kept)
    return frozenset(out)


BATCH_RULES = {
    "verl_minimal_batch": "the actor's sequences per iteration divide into data-parallel "
                          "ranks x micro-batch (Megatron) or GPUs (FSDP) (verl 0.9.1 "
                          "verl/utils/config.py validate_config: real_train_batch_size % "
                          "minimal_bsz == 0)",
    "verl_mini_batch_per_rank": "a mini-batch's sequences divide over each trained model's "
                                "data-parallel ranks (verl 0.9.1 verl/workers/"
                                "engine_workers.py:267, mini_batch_size % data parallel size; "
                                "NeMo-RL 0.7.0 batched_data_dict.py:399 asserts the same)",
    "nemo_rl_tp_micro_batches": "with tp >= 4 the trained model's micro-batch is the "
                                "log-prob micro-batch (NeMo-RL 0.7.0 nemo_rl/models/policy/"
                                "lm_policy.py:178-195)",
    "openrlhf_sample_batches": "the experience's micro-batches are at least the actor's "
                               "data-parallel ranks (OpenRLHF 0.11.2 openrlhf/cli/"
                               "train_ppo_ray.py:757-763)",
}
"""Batch checks a framework makes at start-up (name -> what it asserts, with its source);
``planner/space.py`` holds each as a predicate on a role's layout."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Variant:
    """One choice of the framework's job-wide settings (one engine for the shared roles, one
    tensor-parallel size, one ZeRO stage): the search runs once per variant so every plan
    it returns keeps them. None: not fixed."""

    engine: str | None = None
    """The engine of the ``shared_engine`` roles."""
    tp: int | None = None
    """The one tensor-parallel size of every model."""
    trained_sharding: ShardingName | None = None
    """The one sharding of every trained model."""
    recompute: RecomputeName | None = None
    """The one recompute setting of every trained model."""
    token_budget: bool | None = None
    """Whether every model forms its micro-batches by a token budget (OpenRLHF's one
    --train.dynamic_batch_enable) or by a sequence count."""
    micro_batch: tuple[int, int] | None = None
    """The one (micro_batch_size, micro_batch_tokens) of every trained model (OpenRLHF's
    --train.micro_batch_size and --train.max_tokens_per_gpu)."""
    cp: int | None = None
    """The one context-parallel size of every model (OpenRLHF's --ds.ring_attn_size)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class FrameworkSpace:
    """What the framework can express (see the module docstring). The default is every
    layout the simulator prices on any placement: a framework profile without a ``space:``
    section constrains nothing."""

    source: str = ""
    """Where the rules come from (the framework's config schema or code at a version)."""
    algorithms: tuple[str, ...] = ()
    """Algorithms the framework has a trainer for (empty: any dataflow)."""
    engines: tuple[tuple[str, EngineSpace], ...] = field(
        default=(), metadata=field_parser(lambda value, key: parse_engines(value, key)))
    """(engine name, what it expresses), read from a mapping of name -> engine (empty: every
    layout the simulator prices). A tuple so that profiles stay hashable."""
    shared_engine: tuple[str, ...] = ()
    """Roles that must run on one engine (verl's actor, reference and critic: one
    ``strategy`` for the trainer)."""
    one_tensor_parallel_size: bool = False
    """Every model uses one tensor-parallel size (OpenRLHF's --ds.tensor_parallel_size)."""
    one_trained_sharding: bool = False
    """Every trained model uses one sharding (OpenRLHF's --ds.zero_stage)."""
    one_trained_recompute: bool = False
    """Every trained model uses one recompute setting (OpenRLHF's one
    --actor.gradient_checkpointing_enable)."""
    one_context_parallel_size: bool = False
    """Every model uses one context-parallel size (OpenRLHF's --ds.ring_attn_size)."""
    one_batching: bool = False
    """Every model forms micro-batches the same way: by a token budget or by a sequence count
    for all of them, and the trained models with one micro-batch size and one budget
    (OpenRLHF's --train.dynamic_batch_enable, --train.micro_batch_size,
    --train.max_tokens_per_gpu; one --rollout.max_tokens_per_gpu for every forward pass)."""
    frozen_shard_with_training: bool = False
    """Frozen models are sharded (fsdp) exactly when trained ones are (DeepSpeed inference
    under ZeRO-3, whole models otherwise: OpenRLHF)."""
    placements: PlacementRules = field(default_factory=PlacementRules)
    same_layout: tuple[str, ...] = ()
    """Roles that run in one model's layout (NeMo-RL swaps the reference's weights into the
    policy's model: the same tp, pp and expert layout)."""
    one_megatron_layout_per_set: bool = False
    """The Megatron-trained roles of one colocated set share one (tp, pp, vpp) layout
    (Megatron's parallel state is one per process, and the framework runs a set's models in
    one process per GPU)."""
    one_node_group: bool = False
    """Every set on one kind of node (the framework sizes pools in nodes of one shape)."""
    whole_node_split: bool = False
    """Beside a rollout set, the trainer takes whole nodes once the two span more than one
    node (the framework splits its cluster into training and generation nodes)."""
    generation: GenerationSpace = field(default_factory=GenerationSpace)
    batch_rules: tuple[str, ...] = ()
    """Checks the framework makes of its batch against a layout (``BATCH_RULES``): a plan
    that breaks one would stop at start-up, so the search leaves such layouts out."""
    searchable_rollout: tuple[Literal["max_num_seqs", "gpu_memory_utilization",
                                      "free_cache"], ...] = (
        "max_num_seqs", "gpu_memory_utilization")
    """Rollout engine settings the framework exposes (so the search may choose them);
    free_cache: whether a colocated engine frees its KV cache between generations."""

    def __post_init__(self) -> None:
        for i, rule in enumerate(self.batch_rules):
            require(rule in BATCH_RULES, f"unknown batch rule {rule!r} (known: "
                    f"{', '.join(BATCH_RULES)})", f"batch_rules[{i}]")
        for role in self.shared_engine:
            require(role in ALL_ROLES, f"unknown role {role!r}", "shared_engine")
        if self.shared_engine and self.engines:
            common = [n for n, e in self.engines if all(e.runs(r) for r in self.shared_engine)]
            require(bool(common), "no engine runs every shared_engine role", "shared_engine")

    @property
    def constrained(self) -> bool:
        """Whether the framework narrows the simulator's space at all."""
        return bool(self.engines)

    def engines_for(self, role: str, variant: Variant | None = None
                    ) -> list[tuple[str, EngineSpace]]:
        """The engines ``role`` may use (within ``variant``)."""
        out = [(n, e) for n, e in self.engines if e.runs(role)]
        if variant is not None and variant.engine is not None and role in self.shared_engine:
            out = [(n, e) for n, e in out if n == variant.engine]
        return out

    def variants(self, roles: tuple[str, ...], tensor_sizes: tuple[int, ...], *,
                 batchings: tuple[tuple[tuple[int, int] | None, bool], ...] = (),
                 context_parallel_sizes: tuple[int, ...] = ()) -> tuple[Variant, ...]:
        """Every choice of the job-wide settings for a job with GPU ``roles``
        (``tensor_sizes``: the tensor-parallel sizes the cluster's nodes allow;
        ``batchings``: the job's (trained micro-batch or None, by token budget) choices,
        used when the framework has ``one_batching``; ``context_parallel_sizes``: the
        job's, used when it has ``one_context_parallel_size``)."""
        engines: list[str | None] = [None]
        shared = [r for r in self.shared_engine if r in roles]
        if len(shared) > 1 and self.engines:
            engines = [n for n, e in self.engines if all(e.runs(r) for r in shared)]
        tps: list[int | None] = list(tensor_sizes) if self.one_tensor_parallel_size else [None]
        shardings: list[str | None] = [None]
        if self.one_trained_sharding:
            shardings = sorted({s for _, e in self.engines for s in e.trained_sharding},
                               key=SHARDINGS.index)
        recomputes: list[str | None] = [None]
        if self.one_trained_recompute:
            recomputes = sorted({r for _, e in self.engines for r in e.recompute},
                                key=RECOMPUTES.index)
        batching: list[tuple[tuple[int, int] | None, bool | None]] = [(None, None)]
        if self.one_batching and batchings:
            batching = list(batchings)
        cps: list[int | None] = [None]
        if self.one_context_parallel_size and context_parallel_sizes:
            cps = list(context_parallel_sizes)
        return tuple(Variant(engine=e, tp=t, trained_sharding=s,  # type: ignore[arg-type]
                             recompute=r, micro_batch=m,  # type: ignore[arg-type]
                             token_budget=b, cp=c)
                     for e, t, s, r, (m, b), c in itertools.product(
                         engines, tps, shardings, recomputes, batching, cps))


def parse_engines(value: object, key: str) -> tuple[tuple[str, EngineSpace], ...]:
    """``engines:`` as a mapping of engine name -> EngineSpace (in file order)."""
    if not isinstance(value, dict):
        raise SpecError(f"expected a mapping of engine name -> engine, got {value!r}", key=key)
    return tuple((str(name), convert(engine, EngineSpace, f"{key}.{name}"))
                 for name, engine in value.items())
