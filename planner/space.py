"""The search space: placements (set partitions of the roles), GPU counts a colocated set may
have, how sets are laid out on nodes, and the parallel configs of a model on a set.

Set shapes: a set has a whole number of nodes, or a power-of-two part of one node (1, 2, 4,
... GPUs), so tensor-parallel groups never straddle nodes and sub-node sets pack exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from simulator.plan import RolePlan, megatron_installed, torch_runs
from simulator.specs.job import JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig, outer_stage_layers

Backend = Literal["any", "megatron", "fsdp", "simulated"]
"""Which layouts to search:

- ``any``: what the installed executor backends run: the torch backend (FSDP2 / DTensor: tp x
  dp, pp = 1, FSDP or replicas, generation tp dividing training tp) and, when megatron-core is
  installed, Megatron-core 3D (pp x tp x dp, distributed optimizer, sequence parallelism);
  generation pp = 1 (neither generator runs a pipeline) unless the job pins it;
- ``megatron`` / ``fsdp``: one of those two;
- ``simulated``: every layout the simulator prices, executable or not (generation pp > 1),
  for studies such as the HybridFlow paper's.
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
    recompute: tuple[str, ...] = ("selective", "full")
    """Activation recompute modes tried for trained models."""
    max_num_seqs: tuple[int, ...] = ()
    """Rollout running-batch caps tried beside the framework's default (or the pin)."""
    memory_utilization: tuple[float, ...] = ()
    """Rollout gpu_memory_utilization values tried beside the framework's default (or pin)."""


def _powers_of_two(limit: int) -> list[int]:
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
    return sorted(set(_divisors(layers)) | {p for p in _powers_of_two(layers)
                                            if outer_stage_layers(layers, p) is not None})


def role_configs(job: JobSpec, role: str, gpus: int,
                 options: SpaceOptions = SpaceOptions()) -> list[RolePlan]:
    """Algorithm 2's space for one model on ``gpus`` GPUs, within the job's pins: tp up to a
    node (dividing the heads), pp dividing the layers, dp = gpus / (tp * pp); trained models
    also over micro-batch and recompute; the actor also over generation tp and pp (each GPU's
    training shard must lie inside its generation shard: t_g | t and p_g | p)."""
    model = job.model(role)
    dataflow = job.dataflow
    trained = role in dataflow.trained_roles
    # An actor whose generation runs on a rollout set of its own (asynchronous modes' trainer
    # side) keeps only its training layout here.
    generates = "generate" in dataflow.operations_of(role) and not job.generation_elsewhere
    gpn = job.cluster.gpus_per_node
    pin = job.parallel.get(role)
    pins = pin.set_fields() if pin else {}
    # A set smaller than a node lies inside one; a multi-node set's tp groups must tile its
    # nodes (6-GPU nodes cannot hold tp=4 groups side by side).
    tps = [t for t in _powers_of_two(min(gpn, gpus))
           if model.heads % t == 0 and gpus % t == 0 and pins.get("tp", t) == t
           and (gpus < gpn or gpn % t == 0)]

    layouts: list[tuple[int, int, str]] = []  # (tp, pp, sharding)
    # The executor's Megatron path takes no left-padded prompts, so a job with its own data
    # trains with torch unless the user asks for Megatron.
    megatron = options.backend in ("megatron", "simulated") or (
        options.backend == "any" and megatron_installed() and job.data is None)
    if megatron and pins.get("sharding") in (None, "none", "optimizer"):
        for tp in tps:
            for pp in pipeline_sizes(model.layers):
                if gpus % (tp * pp) or pins.get("pp", pp) != pp:
                    continue
                dp = gpus // (tp * pp)
                sharding = "optimizer" if trained and dp > 1 else "none"
                if pins.get("sharding") == "none":
                    sharding = "none"
                layouts.append((tp, pp, sharding))
    if options.backend in ("any", "fsdp", "simulated") and \
            pins.get("sharding") in (None, "fsdp") and pins.get("pp", 1) == 1:
        layouts.extend((tp, 1, "fsdp") for tp in tps if gpus // tp > 1)
    torch_only = options.backend == "fsdp" or (options.backend == "any" and not megatron)
    if torch_only and pins.get("sharding") in (None, "none") and pins.get("pp", 1) == 1:
        # The torch backend also runs plain replicas (and a whole model per GPU).
        layouts.extend((tp, 1, "none") for tp in tps if not (trained and gpus // tp > 1
                                                              and (tp, 1, "fsdp") in layouts))
    if model.moe is not None and options.backend != "simulated":
        # The executor trains mixture-of-experts models with Megatron-core only.
        layouts = [(tp, pp, sh) for tp, pp, sh in layouts if sh != "fsdp"
                   and not (torch_only and sh == "none")]
    if options.backend != "simulated":
        # Both executor backends cut every sharded width evenly (heads, KV heads, MLP,
        # vocabulary) and give each pipeline stage the same number of layers.
        layouts = [(tp, pp, sh) for tp, pp, sh in layouts
                   if all(size % tp == 0 for size in (model.kv_heads, model.ffn_hidden,
                                                        model.vocab))
                   and model.layers % (pp * pins.get("vpp", 1)) == 0]

    micro_batches = (pins["micro_batch_size"],) if "micro_batch_size" in pins else (
        options.micro_batches if trained else (job.workload.infer_micro_batch_size,))
    recomputes = (pins["recompute"],) if "recompute" in pins else (
        options.recompute if trained else ("selective",))
    vpp = pins.get("vpp", 1)
    overlap_grad, overlap_param = job.overlap_for(role)
    default_seqs, default_utilization = job.rollout_defaults()
    seq_caps = (default_seqs,) if "max_num_seqs" in pins else tuple(
        sorted({default_seqs, *options.max_num_seqs}))
    utilizations = (default_utilization,) if "gpu_memory_utilization" in pins else tuple(
        sorted({default_utilization, *options.memory_utilization}))
    # Megatron layouts with tensor parallelism use sequence parallelism (as verl and NeMo-RL
    # configure Megatron); the torch backend runs without it.
    sequence_parallel = pins.get("sequence_parallel", not torch_only)
    # No generator the executor has runs a pipeline.
    studies = options.backend == "simulated"
    generation_pipelines = studies

    def expert_layouts(tp: int, pp: int, sharding: str) -> list[tuple[int, int]]:
        """(ep, etp) to try: pinned, else for an MoE model every power of two that divides the
        experts and the stage's tp * dp ranks (within a node the exchange stays on NVLink,
        beyond it crosses the NICs; not with FSDP)."""
        if model.moe is None:
            return [(1, 1)]
        etp = pins.get("etp", 1)
        ranks = tp * (gpus // (tp * pp))
        if "ep" in pins:
            return [(pins["ep"], etp)] if ranks % (pins["ep"] * etp) == 0 else []
        if sharding == "fsdp":
            return [(1, etp)] if ranks % etp == 0 else []
        return [(ep, etp) for ep in _powers_of_two(min(ranks, model.moe.experts))
                if model.moe.experts % ep == 0 and ranks % (ep * etp) == 0]

    def serving_eps(gen_tp: int, gen_pp: int) -> list[int]:
        """Generation ep to try: pinned, else 1 (every replica holds every expert) and, for an
        MoE model, vLLM's expert parallelism over the largest power of two of the GPUs that
        the replicas tile."""
        if "generation_ep" in pins:
            pinned = pins["generation_ep"]
            fits = pinned == 1 or (pinned % gen_tp == 0 and gpus % (pinned * gen_pp) == 0)
            return [pinned] if fits else []
        if model.moe is None:
            return [1]
        widest = max((e for e in _powers_of_two(min(gpus, model.moe.experts))
                      if e % gen_tp == 0 and model.moe.experts % e == 0
                      and gpus % (e * gen_pp) == 0), default=1)
        return sorted({1, widest if widest > gen_tp else 1})

    out: list[RolePlan] = []
    candidates = [(t, p, sh, e) for t, p, sh in layouts for e in expert_layouts(t, p, sh)]
    for tp, pp, sharding, (ep, etp) in candidates:
        if vpp > 1 and (pp == 1 or model.layers % (pp * vpp)):  # interleaving: equal chunks
            continue
        for mbs in micro_batches:
            for recompute in recomputes:
                par = ParallelConfig(tp=tp, pp=pp, dp=gpus // (tp * pp), vpp=vpp,
                                     sharding=sharding, recompute=recompute,  # type: ignore[arg-type]
                                     sequence_parallel=sequence_parallel if studies else
                                     sequence_parallel and sharding != "fsdp" and tp > 1,
                                     micro_batch_size=mbs, overlap_grad_reduce=overlap_grad,
                                     overlap_param_gather=overlap_param, ep=ep, etp=etp,
                                     moe_dispatcher=pins.get("moe_dispatcher", "alltoall"))
                backend = "torch" if torch_runs(par) and (sharding == "fsdp" or torch_only) \
                    else "megatron"
                if not generates:
                    out.append(RolePlan(parallel=par, training_backend=backend))
                    continue
                # One copy of an MoE model spans its tp group, or its wider ep x etp group.
                shards = gpus if sharding == "fsdp" else max(tp, ep * etp) * pp
                gen_pps = [pins["generation_pp"]] if "generation_pp" in pins else [
                    p for p in _divisors(pp if sharding != "fsdp" else 1)
                    if p <= model.layers and (p == 1 or generation_pipelines)
                    # Uneven training stages group into generation stages vLLM would cut
                    # otherwise (61 on 8 x 2: 32/29, vLLM 31/30): such an engine runs whole.
                    and (p == 1 or model.layers % pp == 0)]
                for gen_tp in _powers_of_two(min(gpn, shards)):
                    if model.heads % gen_tp or shards % gen_tp or (gpus >= gpn and gpn % gen_tp):
                        continue
                    if (sharding != "fsdp" or torch_only) and ep == 1 and tp % gen_tp:
                        continue
                    if pins.get("generation_tp", gen_tp) != gen_tp:
                        continue
                    for gen_pp in gen_pps:
                        if shards % (gen_tp * gen_pp) or (sharding != "fsdp" and pp % gen_pp):
                            continue
                        for seqs in seq_caps:
                            for utilization in utilizations:
                                for gen_ep in serving_eps(gen_tp, gen_pp):
                                    gen = GenerationConfig(tp=gen_tp, pp=gen_pp,
                                                           max_num_seqs=seqs,
                                                           memory_utilization=utilization,
                                                           ep=gen_ep)
                                    out.append(RolePlan(parallel=par, generation=gen,
                                                        training_backend=backend))
    return out
