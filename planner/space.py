"""The search space: placements (set partitions of the roles), GPU counts a colocated set may
have, how sets are laid out on nodes, and the parallel configs of a model on a set.

Set shapes: a set has a whole number of nodes, or a power-of-two part of one node (1, 2, 4,
... GPUs), so tensor-parallel groups never straddle nodes and sub-node sets pack exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from profiles.framework_space import EngineSpace, FrameworkSpace, GenerationSpace, Variant
from simulator.plan import RolePlan, torch_family_backend
from simulator.specs.job import JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig, outer_stage_layers

Backend = Literal["any", "megatron", "fsdp", "simulated"]
"""Which layouts to search:

- ``any``: what the job's framework can express (its profile's ``space:``: engines per role,
  their parallel dimensions, the placements its configuration sets up), whatever is installed
  where ``plan`` runs;
- ``megatron`` / ``fsdp``: the framework's Megatron-family or torch-family (FSDP / ZeRO /
  DTensor) engines only;
- ``simulated``: every layout the simulator prices on any placement, executable or not
  (generation pp > 1), for studies such as the HybridFlow paper's.
"""


def set_partitions(items: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of ``items`` into non-empty groups (Bell(n) of them), each group and the
    groups in first-item order: 15 for PPO's four models, 52 for five."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield ((first,), *partition)
        for i in range(len(partition)):
            yield (*partition[:i], (first, *partition[i]), *partition[i + 1:])


def canonical(partition: tuple[tuple[str, ...], ...],
              order: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Groups sorted by their roles' order in ``order`` (actor first, ...)."""
    rank = {r: i for i, r in enumerate(order)}
    groups = [tuple(sorted(g, key=rank.__getitem__)) for g in partition]
    return tuple(sorted(groups, key=lambda g: rank[g[0]]))


def placements(roles: tuple[str, ...]) -> list[tuple[tuple[str, ...], ...]]:
    """All placements of ``roles`` in a deterministic order (colocate first)."""
    out = {canonical(p, roles) for p in set_partitions(roles)}
    return sorted(out, key=lambda p: (len(p), [roles.index(g[0]) for g in p], p))


def set_sizes(total_gpus: int, gpus_per_node: int) -> list[int]:
    """GPU counts a colocated set may have: powers of two below a node, then whole nodes."""
    sizes = []
    size = 1
    while size < gpus_per_node and size <= total_gpus:
        sizes.append(size)
        size *= 2
    sizes.extend(gpus_per_node * n for n in range(1, total_gpus // gpus_per_node + 1))
    return sizes


def pack(sizes: tuple[int, ...], total_gpus: int, gpus_per_node: int) -> list[int] | None:
    """First GPU of each set, or None if the sets do not fit the cluster.

    Whole-node sets take whole nodes from the start; sub-node sets go, largest first, into
    the first remaining node with room (first-fit decreasing), never straddling two nodes.
    With nodes of a power of two GPUs this packs them without gaps whenever their total fits.
    """
    first = [0] * len(sizes)
    cursor = 0
    for i, size in enumerate(sizes):
        if size >= gpus_per_node:
            first[i] = cursor
            cursor += size
    if cursor > total_gpus:
        return None
    node_starts = range(cursor, total_gpus - gpus_per_node + 1, gpus_per_node)
    used = [0] * len(node_starts)  # GPUs taken in each remaining node
    small = sorted((i for i, s in enumerate(sizes) if s < gpus_per_node),
                   key=lambda i: (-sizes[i], i))
    for i in small:
        node = next((n for n, taken in enumerate(used)
                     if taken + sizes[i] <= gpus_per_node), None)
        if node is None:
            return None
        first[i] = node_starts[node] + used[node]
        used[node] += sizes[i]
    return first


@dataclass(frozen=True, slots=True)
class SpaceOptions:
    """Which parallel configs the search tries for each model."""

    backend: Backend = "any"
    micro_batches: tuple[int, ...] = (1, 2, 4)
    """Training micro-batch sizes tried (sequences per GPU)."""
    recompute: tuple[str, ...] = ()
    """Activation recompute modes tried for trained models, among those the engine has
    (empty: every mode the engine has)."""
    max_num_seqs: tuple[int, ...] = ()
    """Rollout running-batch caps tried beside the framework's default (or the pin)."""
    memory_utilization: tuple[float, ...] = ()
    """Rollout gpu_memory_utilization values tried beside the framework's default (or pin)."""


STUDY_SPACE = FrameworkSpace(
    source="every layout the simulator prices (--backend simulated)",
    engines=(
        ("megatron", EngineSpace(family="megatron", tensor_parallel=True, pipeline_parallel=True,
                                 virtual_pipeline=True, sequence_parallel=True,
                                 expert_parallel=True, uneven_stages=True, even_widths=False,
                                 trained_sharding=("optimizer",), frozen_sharding=("none",),
                                 recompute=("selective", "full"))),
        ("fsdp", EngineSpace(family="torch", tensor_parallel=True, sequence_parallel=True,
                             even_widths=False, trained_sharding=("fsdp",),
                             frozen_sharding=("fsdp",), recompute=("selective", "full"))),
    ),
    generation=GenerationSpace(nested=True, fsdp_regroups=True, pipeline_parallel=True))
"""``--backend simulated``: every layout the simulator prices on any placement, executable by
a framework or not (studies such as the HybridFlow paper's; generation pipelines included)."""


def search_space(job: JobSpec, options: SpaceOptions) -> FrameworkSpace:
    """The space the search enumerates for ``job``: its framework's (``--backend any``, or one
    engine family of it with ``fsdp`` / ``megatron``), or the study space (``simulated``)."""
    space = job.framework_profile.space
    if options.backend == "simulated" or not space.constrained:
        return STUDY_SPACE
    return space


def engine_choices(job: JobSpec, role: str, options: SpaceOptions,
                   variant: Variant | None = None) -> list[tuple[str, EngineSpace]]:
    """The engines ``role`` may use in ``job``'s search: the framework's (within the variant),
    narrowed to one family by ``--backend fsdp|megatron``, and to those that run the model
    (mixture of experts)."""
    space = search_space(job, options)
    engines = space.engines_for(role, variant)
    if options.backend in FAMILY_OF_BACKEND:
        engines = [(n, e) for n, e in engines if e.family == FAMILY_OF_BACKEND[options.backend]]
    model = job.model(role)
    if model.moe is not None:
        engines = [(n, e) for n, e in engines if e.moe]
    return engines


FAMILY_OF_BACKEND = {"fsdp": "torch", "megatron": "megatron"}
"""``--backend`` values that narrow the framework's engines to one layout family."""


def powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_sizes(layers: int) -> list[int]:
    """Pipeline sizes to search for a model of ``layers`` layers: those dividing the layers
    and the powers of two up to them (stages of unequal layer counts, the heaviest pacing the
    pipeline: DeepSeek-V3's 61 layers, Qwen3-235B's 94), when Megatron's first/last stage sizes
    can cut them (none of the outer stages left empty)."""
    return sorted(set(_divisors(layers)) | {p for p in powers_of_two(layers)
                                            if outer_stage_layers(layers, p) is not None})


@dataclass(frozen=True, slots=True)
class Layout:
    """One training / inference layout of a model on a set, before the per-step knobs."""

    tp: int
    pp: int
    sharding: str
    engine: EngineSpace


def tensor_sizes(job: JobSpec, role: str, gpus: int, engine: EngineSpace,
                 pins: dict[str, Any], variant: Variant | None) -> list[int]:
    """Tensor-parallel sizes of ``role`` on ``gpus`` GPUs: powers of two up to a node that
    divide the heads and the set (a set smaller than a node lies inside one; a multi-node
    set's tp groups must tile its nodes: 6-GPU nodes cannot hold tp=4 groups side by side)."""
    model = job.model(role)
    gpn = job.cluster.gpus_per_node
    candidates = powers_of_two(min(gpn, gpus)) if engine.tensor_parallel else [1]
    out = [t for t in candidates
           if model.heads % t == 0 and gpus % t == 0 and pins.get("tp", t) == t
           and (gpus < gpn or gpn % t == 0)
           and (variant is None or variant.tp in (None, t))]
    if engine.even_widths:
        out = [t for t in out if all(size % t == 0 for size in (model.kv_heads, model.ffn_hidden,
                                                                 model.vocab))]
    return out


def stage_counts(job: JobSpec, role: str, engine: EngineSpace, pins: dict[str, Any]
                 ) -> list[int]:
    """Pipeline sizes of ``role`` the engine can cut its model into."""
    model = job.model(role)
    if not engine.pipeline_parallel:
        sizes = [1]
    elif engine.uneven_stages:
        sizes = pipeline_sizes(model.layers)
    else:
        sizes = _divisors(model.layers)
    vpp = pins.get("vpp", 1)
    return [p for p in sizes if pins.get("pp", p) == p
            and (engine.uneven_stages or model.layers % (p * vpp) == 0)]


def shardings(job: JobSpec, role: str, dp: int, engine: EngineSpace, pins: dict[str, Any],
              space: FrameworkSpace, variant: Variant | None) -> list[str]:
    """How ``role``'s states may be laid out over ``dp`` data-parallel ranks: a trained model
    shards them as the engine does (one rank: whole), a frozen one as the engine serves it."""
    trained = role in job.dataflow.trained_roles
    if trained:
        options = list(engine.trained_sharding) if dp > 1 else ["none"]
        if variant is not None and variant.trained_sharding is not None and dp > 1:
            options = [s for s in options if s == variant.trained_sharding]
    else:
        options = list(engine.frozen_sharding)
        if space.frozen_shard_with_training and variant is not None \
                and variant.trained_sharding is not None:
            options = ["fsdp" if variant.trained_sharding == "fsdp" else "none"]
        if dp == 1:
            options = ["none"] if options else []
    if "sharding" in pins:
        options = [s for s in options if s == pins["sharding"]] or (
            [pins["sharding"]] if dp == 1 and pins["sharding"] == "none" else [])
    return list(dict.fromkeys(options))


def layouts(job: JobSpec, role: str, gpus: int, options: SpaceOptions,
            variant: Variant | None, pins: dict[str, Any]) -> list[Layout]:
    """Every (tp, pp, sharding) of ``role`` on ``gpus`` GPUs that one of its engines runs."""
    space = search_space(job, options)
    out: dict[tuple[int, int, str, bool], Layout] = {}
    for _name, engine in engine_choices(job, role, options, variant):
        for tp in tensor_sizes(job, role, gpus, engine, pins, variant):
            for pp in stage_counts(job, role, engine, pins):
                if gpus % (tp * pp):
                    continue
                dp = gpus // (tp * pp)
                for sharding in shardings(job, role, dp, engine, pins, space, variant):
                    if sharding == "fsdp" and pp > 1:
                        continue
                    key = (tp, pp, sharding, engine.sequence_parallel)
                    out.setdefault(key, Layout(tp=tp, pp=pp, sharding=sharding, engine=engine))
    return list(out.values())


def expert_layouts(job: JobSpec, role: str, layout: Layout, gpus: int,
                   pins: dict[str, Any]) -> list[tuple[int, int]]:
    """(ep, etp) to try: pinned, else for an MoE model every power of two that divides the
    experts and the stage's tp * dp ranks (within a node the exchange stays on NVLink,
    beyond it crosses the NICs; not with FSDP, not on an engine without expert
    parallelism)."""
    model = job.model(role)
    if model.moe is None:
        return [(1, 1)]
    etp = pins.get("etp", 1)
    ranks = layout.tp * (gpus // (layout.tp * layout.pp))
    if "ep" in pins:
        if pins["ep"] > 1 and not layout.engine.expert_parallel:
            return []
        return [(pins["ep"], etp)] if ranks % (pins["ep"] * etp) == 0 else []
    if layout.sharding == "fsdp" or not layout.engine.expert_parallel:
        return [(1, etp)] if ranks % etp == 0 else []
    return [(ep, etp) for ep in powers_of_two(min(ranks, model.moe.experts))
            if model.moe.experts % ep == 0 and ranks % (ep * etp) == 0]


def serving_eps(job: JobSpec, role: str, gpus: int, gen_tp: int, gen_pp: int,
                pins: dict[str, Any], space: FrameworkSpace) -> list[int]:
    """Generation ep to try: pinned, else 1 (every replica holds every expert) and, for an
    MoE model the framework serves with expert parallelism, vLLM's expert parallelism over
    the largest power of two of the GPUs that the replicas tile."""
    model = job.model(role)
    if "generation_ep" in pins:
        pinned = pins["generation_ep"]
        fits = pinned == 1 or (pinned % gen_tp == 0 and gpus % (pinned * gen_pp) == 0)
        return [pinned] if fits else []
    if model.moe is None or not space.generation.expert_parallel:
        return [1]
    widest = max((e for e in powers_of_two(min(gpus, model.moe.experts))
                  if e % gen_tp == 0 and model.moe.experts % e == 0
                  and gpus % (e * gen_pp) == 0), default=1)
    return sorted({1, widest if widest > gen_tp else 1})


def generation_shapes(job: JobSpec, role: str, gpus: int, par: ParallelConfig,
                      pins: dict[str, Any], space: FrameworkSpace) -> list[tuple[int, int]]:
    """(tp_g, pp_g) of the actor's rollout engine on its ``gpus`` training GPUs. Nested (the
    3D-HybridEngine): each GPU's training shard lies inside its generation shard (t_g | t and
    p_g | p, unless FSDP regroups the GPUs or an MoE copy spans its expert group). Otherwise
    the engine holds its own copy: any tensor size within a node that tiles the GPUs, and
    pipeline stages once tensor parallelism fills a node (or the set)."""
    model = job.model(role)
    gpn = job.cluster.gpus_per_node
    generation = space.generation
    if generation.nested and not (par.sharding == "fsdp" and generation.fsdp_regroups):
        # One copy of an MoE model spans its tp group, or its wider ep x etp group.
        shards = par.weight_shards if par.sharding == "fsdp" \
            else max(par.tp, par.ep * par.etp) * par.pp
        must_divide_tp = par.ep == 1
    else:
        shards = gpus
        must_divide_tp = False
    out = []
    for gen_tp in powers_of_two(min(gpn, shards)):
        if model.heads % gen_tp or shards % gen_tp or (gpus >= gpn and gpn % gen_tp):
            continue
        if must_divide_tp and par.tp % gen_tp:
            continue
        if pins.get("generation_tp", gen_tp) != gen_tp:
            continue
        out += [(gen_tp, gen_pp) for gen_pp in _generation_pipelines(
            model.layers, par, gen_tp, gpus, shards, pins, space, gpn,
            engine_pipelines=job.rollout.pipeline_parallel)]
    return out


def _generation_pipelines(layers: int, par: ParallelConfig, gen_tp: int, gpus: int,
                          shards: int, pins: dict[str, Any], space: FrameworkSpace,
                          gpn: int, *, engine_pipelines: bool = True) -> list[int]:
    """pp_g to try for one tp_g (pinned; 1 when the framework or its engine runs no
    pipeline)."""
    nested = space.generation.nested
    if "generation_pp" in pins:
        candidates = [pins["generation_pp"]]
    elif not space.generation.pipeline_parallel or not engine_pipelines:
        candidates = [1]
    elif nested:
        # Uneven training stages group into generation stages vLLM would cut otherwise (61
        # on 8 x 2: 32/29, vLLM 31/30): such an engine runs whole.
        candidates = [p for p in _divisors(par.pp if par.sharding != "fsdp" else 1)
                      if p <= layers and (p == 1 or layers % par.pp == 0)]
    else:
        # A pipeline only once tensor parallelism fills a node (or the set): within a node
        # tensor parallelism is the cheaper split.
        candidates = [1] + [p for p in powers_of_two(layers)[1:]
                            if gen_tp == min(gpn, gpus) and gpus % (gen_tp * p) == 0]
    return [p for p in candidates if shards % (gen_tp * p) == 0
            and not (nested and par.sharding != "fsdp" and par.pp % p)]


def _verl_minimal_batch(job: JobSpec, role: str, par: ParallelConfig, family: str) -> bool:
    if role != "actor":
        return True
    ranks = par.data_shards * par.micro_batch_size if family == "megatron" \
        else par.world_size
    return job.workload.sequences_per_iteration % ranks == 0


def _verl_mini_batch_per_rank(job: JobSpec, role: str, par: ParallelConfig,
                              family: str) -> bool:
    if role not in job.dataflow.trained_roles:
        return True
    work = job.workload
    mini = work.sequences_per_iteration // work.mini_batches_per_epoch
    # verl's Megatron engine divides by its data-parallel size, dp / cp here.
    return mini % (par.data_shards if family == "megatron" else par.dp) == 0


def _openrlhf_sample_batches(job: JobSpec, role: str, par: ParallelConfig,
                             family: str) -> bool:
    work = job.workload
    return role != "actor" or \
        work.sequences_per_iteration // work.infer_micro_batch_size \
        >= par.world_size // (par.tp * par.cp)


def _nemo_rl_tp_micro_batches(job: JobSpec, role: str, par: ParallelConfig,
                              family: str) -> bool:
    return role not in job.dataflow.trained_roles or par.tp < 4 \
        or par.micro_batch_size == job.workload.infer_micro_batch_size


BATCH_CHECKS = {"verl_minimal_batch": _verl_minimal_batch,
                "nemo_rl_tp_micro_batches": _nemo_rl_tp_micro_batches,
                "verl_mini_batch_per_rank": _verl_mini_batch_per_rank,
                "openrlhf_sample_batches": _openrlhf_sample_batches}
"""Each of ``profiles.framework_space.BATCH_RULES`` as a predicate on (job, role, layout)."""


def meets_batch_rules(job: JobSpec, role: str, par: ParallelConfig, space: FrameworkSpace,
                      family: str) -> bool:
    """Whether the framework's start-up batch checks pass for ``role`` laid out as ``par`` on
    an engine of ``family``."""
    return all(BATCH_CHECKS[rule](job, role, par, family) for rule in space.batch_rules)


def role_configs(job: JobSpec, role: str, gpus: int,
                 options: SpaceOptions = SpaceOptions(),
                 variant: Variant | None = None) -> list[RolePlan]:
    """Algorithm 2's space for one model on ``gpus`` GPUs, within the job's framework (its
    engines and their dimensions, ``search_space``) and the job's pins: tp up to a node
    (dividing the heads), pp dividing the layers, dp = gpus / (tp * pp); trained models also
    over micro-batch and recompute; the actor also over its generation layout and engine
    settings."""
    trained = role in job.dataflow.trained_roles
    # An actor whose generation runs on a rollout set of its own (asynchronous modes' trainer
    # side) keeps only its training layout here.
    generates = "generate" in job.dataflow.operations_of(role) and not job.generation_elsewhere
    pin = job.parallel.get(role)
    pins = pin.set_fields() if pin else {}
    space = search_space(job, options)
    studies = space is STUDY_SPACE
    vpp = pins.get("vpp", 1)
    overlap_grad, overlap_param = job.overlap_for(role)
    out: list[RolePlan] = []
    generations: dict[tuple, list[GenerationConfig]] = {}
    for layout in layouts(job, role, gpus, options, variant, pins):
        # Interleaving runs equal chunks.
        if vpp > 1 and (layout.pp == 1 or not layout.engine.virtual_pipeline
                        or job.model(role).layers % (layout.pp * vpp)):
            continue
        engine = layout.engine
        if studies:
            sequence_parallel = pins.get("sequence_parallel", True)
        else:
            sequence_parallel = pins.get("sequence_parallel", engine.sequence_parallel) \
                and layout.tp > 1 and layout.sharding != "fsdp"
        if job.model(role).moe is not None and layout.tp > 1 and not sequence_parallel:
            continue  # MoE layers under tp > 1 need sequence parallelism (ParallelConfig)
        # NeMo-RL trains a model under tp >= 4 at its log-prob micro-batch only
        # (nemo_rl_tp_micro_batches): that micro-batch is tried too.
        required = job.workload.infer_micro_batch_size \
            if "nemo_rl_tp_micro_batches" in space.batch_rules and layout.tp >= 4 else None
        # Each knob's values read the layout only: listed once, then combined.
        batchings = _batchings(job, trained, engine, pins, options, required, variant)
        recomputes = _recomputes(trained, engine, pins, options, variant)
        offloads = _offloads(trained, engine, job)
        sps = ulysses_sizes(job, role, layout, gpus)
        groups = fsdp_group_sizes(job, role, layout, gpus)
        cps = context_parallel_sizes(job, role, layout, gpus, variant)
        knobs = [(ep_etp, batching, recompute, offload, sp, group, cp)
                 for ep_etp in expert_layouts(job, role, layout, gpus, pins)
                 for batching in batchings for recompute in recomputes for offload in offloads
                 for sp in sps for group in groups for cp in cps]
        for (ep, etp), (mbs, tokens, infer_tokens), recompute, (offload_params,
                                                                 offload_optimizer), sp, \
                group, cp in knobs:
            par = ParallelConfig(
                tp=layout.tp, pp=layout.pp, dp=gpus // (layout.tp * layout.pp),
                vpp=vpp, sharding=layout.sharding,  # type: ignore[arg-type]
                recompute=recompute,  # type: ignore[arg-type]
                sequence_parallel=sequence_parallel, micro_batch_size=mbs,
                overlap_grad_reduce=overlap_grad, overlap_param_gather=overlap_param,
                ep=ep, etp=etp, moe_dispatcher=pins.get("moe_dispatcher", "alltoall"),
                offload_params=offload_params, offload_optimizer=offload_optimizer,
                micro_batch_tokens=tokens, infer_micro_batch_tokens=infer_tokens, ulysses=sp,
                fsdp_size=group, cp=cp)
            if not meets_batch_rules(job, role, par, space, engine.family):
                continue
            backend = torch_family_backend(par) if engine.family == "torch" else "megatron"
            if not generates:
                out.append(RolePlan(parallel=par, training_backend=backend))
                continue
            # The generation configs read the layout's shape and sharding only, not its
            # micro-batch, recompute or offload: layouts of one shape share one list.
            shape = (par.tp, par.pp, par.dp, par.ep, par.etp, par.sharding,
                     par.weight_shards)
            if shape not in generations:
                generations[shape] = _generations(job, role, gpus, par, pins, space, options)
            out += [RolePlan(parallel=par, generation=gen, training_backend=backend)
                    for gen in generations[shape]]
    return out


ULYSSES_FROM_TOKENS = 16384
"""Sequences (prompt + response) from which the search offers Ulysses sequence parallelism:
it saves activation memory (a rank holds 1 / sp of each sequence) at the price of four
all-to-alls per layer and smaller kernels, which pays only once one sequence's activations
weigh on a GPU (verl's long-response recipes: DAPO at 30k tokens runs sp 4; a search bound,
not a rule of the framework)."""


def ulysses_sizes(job: JobSpec, role: str, layout: Layout, gpus: int) -> list[int]:
    """Ulysses sizes to try: pinned, else 1 and, on an engine that has it and for long
    sequences, every power of two within a node that divides the data-parallel ranks and
    leaves each rank whole heads."""
    pin = job.parallel.get(role)
    dp = gpus // (layout.tp * layout.pp)
    heads = job.model(role).heads

    def fits(s: int) -> bool:
        return s == 1 or (layout.engine.ulysses and layout.pp == 1 and dp % s == 0
                          and heads % (layout.tp * s) == 0)

    if pin is not None and pin.ulysses:
        return [pin.ulysses] if fits(pin.ulysses) else []
    if job.workload.max_sequence_tokens < ULYSSES_FROM_TOKENS:
        return [1]
    return [s for s in powers_of_two(min(job.cluster.gpus_per_node, dp)) if fits(s)]


def context_parallel_sizes(job: JobSpec, role: str, layout: Layout, gpus: int,
                           variant: Variant | None = None) -> list[int]:
    """Context-parallel sizes to try: pinned, else 1 and, on an engine that has it and for
    long sequences (as for Ulysses, ULYSSES_FROM_TOKENS), every power of two that keeps the
    tp x cp ranks inside a node and divides the data-parallel ranks; within the variant's one
    size where the framework has one."""
    pin = job.parallel.get(role)
    dp = gpus // (layout.tp * layout.pp)

    def fits(c: int) -> bool:
        return (c == 1 or (layout.engine.context_parallel and dp % c == 0)) \
            and (variant is None or variant.cp in (None, c))

    if pin is not None and pin.cp:
        return [pin.cp] if fits(pin.cp) else []
    if variant is not None and variant.cp is not None:
        return [variant.cp] if fits(variant.cp) else []
    if job.workload.max_sequence_tokens < ULYSSES_FROM_TOKENS:
        return [1]
    return [c for c in powers_of_two(min(job.cluster.gpus_per_node // layout.tp, dp))
            if fits(c)]


def context_parallel_variants(job: JobSpec) -> tuple[int, ...]:
    """The job's choices of one context-parallel size for every model
    (``FrameworkSpace.one_context_parallel_size``): 1 and, for long sequences, the powers of
    two up to a node."""
    if job.workload.max_sequence_tokens < ULYSSES_FROM_TOKENS:
        return ()
    return tuple(powers_of_two(job.cluster.gpus_per_node))


def fsdp_group_sizes(job: JobSpec, role: str, layout: Layout, gpus: int) -> list[int]:
    """FSDP group sizes to try (``ParallelConfig.fsdp_size``; 0: every data-parallel rank):
    pinned, else 0 and, on an engine with hybrid sharding whose ranks span several nodes, a
    group per node: its per-layer gathers stay on NVLink and only the gradient shards cross
    the nodes, at the price of a node's share of the states (verl's recipes set fsdp_size 8;
    a search bound: larger groups are tried when pinned)."""
    pin = job.parallel.get(role)
    pinned = pin.fsdp_size if pin is not None else None
    if layout.sharding != "fsdp":
        return [] if pinned else [0]
    dp = gpus // (layout.tp * layout.pp)
    if pinned:
        return [0] if pinned == dp else (
            [pinned] if layout.engine.hybrid_shard and 1 < pinned < dp and dp % pinned == 0
            else [])
    node_ranks = job.cluster.gpus_per_node // layout.tp
    if not layout.engine.hybrid_shard or node_ranks < 2 or dp <= node_ranks:
        return [0]
    return [0, node_ranks] if dp % node_ranks == 0 else [0]


def _offloads(trained: bool, engine: EngineSpace, job: JobSpec) -> list[tuple[bool, bool]]:
    """(offload_params, offload_optimizer) to try: on the GPU, and, where the engine can keep
    them in host memory between calls and the device profile prices the copies (its
    host_link), all of a trained model's states (parameters and optimizer) or a frozen
    model's parameters."""
    out = [(False, False)]
    if job.cluster.profile().host_link is None:
        return out
    if trained and {"params", "optimizer"} <= set(engine.offload):
        out.append((True, True))
    elif not trained and "params" in engine.offload:
        out.append((True, False))
    return out


def _pinned_micro_batch(job: JobSpec, trained: bool, pins: dict[str, Any]) -> int | None:
    """The micro-batch the job fixes: the role's pin, else for a trained role the workload's
    ``train_micro_batch_size`` where it gives one."""
    if "micro_batch_size" in pins:
        return pins["micro_batch_size"]
    return job.workload.train_micro_batch_size if trained else None


def _micro_batches(job: JobSpec, trained: bool, pins: dict[str, Any],
                   options: SpaceOptions, required: int | None = None) -> tuple[int, ...]:
    """Micro-batches to try: the pinned one, else for a trained model the options' (and
    ``required``, one the framework insists on for this layout), else the forward passes'."""
    pinned = _pinned_micro_batch(job, trained, pins)
    if pinned is not None:
        return (pinned,)
    if not trained:
        return (job.workload.infer_micro_batch_size,)
    if required is not None and required not in options.micro_batches:
        return (*options.micro_batches, required)
    return options.micro_batches


def _batchings(job: JobSpec, trained: bool, engine: EngineSpace, pins: dict[str, Any],
               options: SpaceOptions, required: int | None = None,
               variant: Variant | None = None) -> list[tuple[int, int, int]]:
    """(micro_batch_size, training token budget, forward token budget) to try: micro-batches
    of whole sequences, and, on an engine that forms them by a token budget and for
    responses of varying length (for one length the two are the same), budgets of as many
    longest sequences (verl requires a budget of at least the longest sequence); within the
    variant's one batching where the framework has one."""
    out = [(mbs, 0, 0) for mbs in _micro_batches(job, trained, pins, options, required)]
    work = job.workload
    if engine.token_budget and _pinned_micro_batch(job, trained, pins) is None \
            and work.response_length.max_tokens != work.response_length.mean_tokens():
        longest = work.max_sequence_tokens
        infer = work.infer_micro_batch_size * longest
        out += [(1, mbs * longest, infer) for mbs in options.micro_batches] if trained \
            else [(work.infer_micro_batch_size, 0, infer)]
    if variant is not None and variant.token_budget is not None:
        out = [b for b in out if bool(b[2]) == variant.token_budget]
    if trained and variant is not None and variant.micro_batch is not None:
        out = [b for b in out if b[:2] == variant.micro_batch]
    return out


def batching_variants(job: JobSpec, options: SpaceOptions
                      ) -> tuple[tuple[tuple[int, int] | None, bool], ...]:
    """The job's choices of one batching for every model (``FrameworkSpace.one_batching``):
    by a token budget or by a sequence count, and, when more than one model trains, the
    trained models' one (micro_batch_size, micro_batch_tokens). Empty where the framework
    lets each model choose."""
    space = search_space(job, options)
    if not space.one_batching:
        return ()
    engines = [e for _, e in space.engines_for("actor")]
    if not engines:
        return ()
    pin = job.parallel.get("actor")
    found = {b for engine in engines
             for b in _batchings(job, True, engine, pin.set_fields() if pin else {}, options)}
    trained = [r for r in job.gpu_roles if r in job.dataflow.trained_roles]
    if len(trained) > 1:
        return tuple(sorted(((mbs, tokens), bool(infer)) for mbs, tokens, infer in found))
    return tuple((None, budget) for budget in sorted({bool(infer) for *_, infer in found}))


def _recomputes(trained: bool, engine: EngineSpace, pins: dict[str, Any],
                options: SpaceOptions, variant: Variant | None) -> tuple[str, ...]:
    """Recompute settings of a trained model (pinned, else the engine's, narrowed by the
    options and the framework's one setting for every trained model); a frozen model
    recomputes nothing (it runs no backward)."""
    if not trained:
        return (pins.get("recompute", "none"),)
    if "recompute" in pins:
        found: tuple[str, ...] = (pins["recompute"],)
    elif options.recompute:
        found = tuple(r for r in options.recompute if r in engine.recompute)
    else:
        found = engine.recompute
    if variant is not None and variant.recompute is not None:
        found = tuple(r for r in found if r == variant.recompute)
    return found


def _generations(job: JobSpec, role: str, gpus: int, par: ParallelConfig,
                 pins: dict[str, Any], space: FrameworkSpace,
                 options: SpaceOptions) -> list[GenerationConfig]:
    """The actor's generation configs on its training GPUs: layouts x the engine settings the
    framework exposes (running-batch cap, memory utilization) x expert-parallel serving."""
    default_seqs, default_utilization = job.rollout_defaults()
    exposed = space.searchable_rollout
    seq_caps = (default_seqs,) if "max_num_seqs" in pins or "max_num_seqs" not in exposed \
        else tuple(sorted({default_seqs, *options.max_num_seqs}))
    utilizations = (default_utilization,) if "gpu_memory_utilization" in pins \
        or "gpu_memory_utilization" not in exposed \
        else tuple(sorted({default_utilization, *options.memory_utilization}))
    caches = free_cache_choices(job, pins, space)
    return [GenerationConfig(tp=gen_tp, pp=gen_pp, max_num_seqs=seqs,
                             memory_utilization=utilization, ep=gen_ep, free_cache=cache)
            for gen_tp, gen_pp in generation_shapes(job, role, gpus, par, pins, space)
            for seqs in seq_caps for utilization in utilizations
            for gen_ep in serving_eps(job, role, gpus, gen_tp, gen_pp, pins, space)
            for cache in caches]


def free_cache_choices(job: JobSpec, pins: dict[str, Any],
                       space: FrameworkSpace) -> tuple[bool | None, ...]:
    """Whether the colocated engine frees its KV cache between generations: pinned; both where
    the framework exposes the setting (sleep and wake each iteration, or hold the engine's
    memory through training); else the framework's default (None)."""
    if "free_cache" in pins:
        return (pins["free_cache"],)
    if "free_cache" in space.searchable_rollout and job.rollout.free_kv_cache:
        return (True, False)
    return (None,)
