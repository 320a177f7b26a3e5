"""Plan: where each model lives and how it is parallelised. Versioned JSON that the simulator
evaluates, the planner writes, the executor runs, and a person can read and edit.

The type lives in the simulator (the planner produces plans, the simulator evaluates them, and
the simulator may not import the planner).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from profiles.datafile import (
    SpecError,
    from_mapping,
    json_text,
    read_mapping,
    to_mapping,
    write_text_atomic,
)
from simulator.costs.primitives import first_straddling_group
from simulator.specs.asynchrony import MODE_STALENESS, MODES
from simulator.specs.cluster import Pool
from simulator.specs.job import JobSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig

PLAN_FORMAT = "hybridflow-plan"
PLAN_VERSION = 1
"""Bump when the schema changes incompatibly; readers reject other versions with a message."""


def check_location(gpus: int, first_gpu: int, node_group: int) -> None:
    """Raise SpecError (naming the key) for a set's GPU count, first GPU or node group."""
    if gpus < 1:
        raise SpecError(f"must be a positive integer, got {gpus}", key="gpus")
    if first_gpu < 0:
        raise SpecError("must be >= 0", key="first_gpu")
    if node_group < 0:
        raise SpecError("must be >= 0 (an index into cluster.node_groups)", key="node_group")


@dataclass(kw_only=True, slots=True, frozen=True)
class ColocatedSet:
    """Models that share the same GPUs (and, on those GPUs, one worker process per GPU)."""

    roles: tuple[str, ...]
    """Roles in this set, in the order they run."""
    gpus: int
    """GPUs of this set."""
    first_gpu: int = 0
    """Index of the set's first GPU in its node group (node = index // gpus_per_node)."""
    node_group: int = 0
    """Index in the job's ``cluster.node_groups`` of the group the set runs on (a set never
    spans groups, except identical ones, which form one pool counted from the first)."""

    def __post_init__(self) -> None:
        if not self.roles:
            raise SpecError("a colocated set needs at least one role", key="roles")
        check_location(self.gpus, self.first_gpu, self.node_group)

    def label(self) -> str:
        return ",".join(self.roles)

    def node_range(self, gpus_per_node: int) -> tuple[int, int]:
        """First and last node index (inclusive) this set occupies."""
        return (self.first_gpu // gpus_per_node,
                (self.first_gpu + self.gpus - 1) // gpus_per_node)


@dataclass(kw_only=True, slots=True, frozen=True)
class RolloutSet:
    """GPUs that only generate, apart from every training set (asynchronous modes): the
    actor's rollout replicas (``roles.actor.generation`` layout, ``gpus / (tp * pp)`` of them),
    which receive the trainer's weights after each update."""

    gpus: int
    """GPUs of the rollout set."""
    first_gpu: int = 0
    """Index of its first GPU in its node group."""
    node_group: int = 0
    """Index in the job's ``cluster.node_groups`` of its group."""

    def __post_init__(self) -> None:
        check_location(self.gpus, self.first_gpu, self.node_group)

    def as_set(self) -> ColocatedSet:
        """The rollout set as a colocated set of the actor's generation (for the GPU range
        checks and the timeline)."""
        return ColocatedSet(roles=(ROLLOUT_LABEL,), gpus=self.gpus, first_gpu=self.first_gpu,
                            node_group=self.node_group)


ROLLOUT_LABEL = "rollout"
"""The rollout set's name on timelines and in reports."""

TRAINING_BACKENDS = ("torch", "megatron")


def megatron_installed() -> bool:
    """Whether megatron-core is importable here (what the executor's Megatron backend and
    the planner's ``--backend any`` need)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def torch_runs(par: ParallelConfig) -> bool:
    """Whether the executor's torch backend (FSDP2 / DTensor) runs this layout: no pipeline,
    FSDP or plain replicas, tensor parallelism without sequence parallelism."""
    return par.pp == 1 and par.vpp == 1 and par.sharding != "optimizer" and par.cp == 1 \
        and not (par.sequence_parallel and par.tp > 1)


def torch_family_backend(par: ParallelConfig) -> Literal["torch", "megatron"]:
    """The executor backend that stands for a layout of a torch-family engine (FSDP,
    DeepSpeed): megatron for a distributed optimizer (ZeRO-1/2) or a layout only Megatron runs,
    torch otherwise (context parallelism included, which neither backend executes)."""
    if par.sharding == "optimizer":
        return "megatron"
    return "torch" if torch_runs(par) or par.cp > 1 else "megatron"


def megatron_runs(par: ParallelConfig) -> bool:
    """Whether the Megatron-core backend runs this layout (it shards optimizer states with
    its distributed optimizer, never FSDP-style; its local layer spec has no context-parallel
    attention, which needs TransformerEngine)."""
    return par.sharding != "fsdp" and par.cp == 1


@dataclass(kw_only=True, slots=True, frozen=True)
class RolePlan:
    """One role's layouts: training/inference and, for the actor, generation."""

    parallel: ParallelConfig
    generation: GenerationConfig | None = None
    training_backend: str = ""
    """The executor backend that trains and runs inference for this role: torch (FSDP2 /
    DTensor) or megatron (Megatron-core). Left out, it is the torch backend when that can run
    the layout, else Megatron."""

    def __post_init__(self) -> None:
        if not self.training_backend:
            object.__setattr__(self, "training_backend",
                               "torch" if torch_runs(self.parallel) else "megatron")
        # A layout neither executor backend runs (a study of the simulator's) stays labelled
        # as Megatron's; Plan.validate does not reject it, ``execute`` does.
        elif self.training_backend not in TRAINING_BACKENDS:
            raise SpecError(f"unknown training backend {self.training_backend!r} (choose "
                            f"{' or '.join(TRAINING_BACKENDS)})", key="training_backend")

    def megatron_layout(self) -> tuple[int, int, int, int] | None:
        """(tp, pp, vpp, cp) when Megatron runs this role: Megatron's parallel state is one
        per process, so the Megatron roles of a colocated set must share it."""
        if self.training_backend != "megatron":
            return None
        return self.parallel.tp, self.parallel.pp, self.parallel.vpp, self.parallel.cp


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Plan:
    """A complete mapping of a job's roles onto a cluster."""

    algorithm: str
    sets: tuple[ColocatedSet, ...]
    roles: dict[str, RolePlan]
    format: str = PLAN_FORMAT
    version: int = PLAN_VERSION
    placement: str = ""
    """Derived from ``sets`` as 'actor,ref|critic,reward' (a value read from a file is
    ignored)."""
    strategy: str = ""
    """How the plan was made: colocate, standalone, split, searched, pinned, hand-written."""
    predicted: dict[str, Any] | None = None
    """The simulator's summary when the plan was written (informational)."""
    job: dict[str, Any] | None = None
    """The job the plan was made for (so ``execute plan.json`` needs no other file)."""
    mode: str = "sync"
    """sync, one_step_off or async (``simulator/specs/asynchrony.py``)."""
    max_staleness: int = 0
    """Updates a batch's generating policy may lag the trainer's (0 sync, 1 one_step_off,
    >= 1 async)."""
    partial_rollout: bool = False
    """async: a weight sync interrupts responses in flight instead of draining them."""
    rollout: RolloutSet | None = None
    """The generation-only GPUs of an asynchronous plan (None when synchronous: the actor
    generates on its own GPUs)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SpecError(f"unknown mode {self.mode!r} (choose {', '.join(MODES)})",
                            key="mode")
        if self.mode == "sync":
            if self.rollout is not None:
                raise SpecError("a synchronous plan generates on the actor's GPUs; remove "
                                "rollout or set mode: one_step_off / async", key="rollout")
        elif self.rollout is None:
            raise SpecError(f"mode {self.mode} generates on a rollout set of its own: give "
                            "rollout: {gpus, first_gpu}", key="rollout")
        expected = MODE_STALENESS.get(self.mode)
        if expected is not None and self.max_staleness != expected:
            raise SpecError(f"mode {self.mode} has staleness {expected}, got "
                            f"{self.max_staleness}", key="max_staleness")
        if self.mode == "async" and self.max_staleness < 1:
            raise SpecError("async needs max_staleness >= 1", key="max_staleness")
        if self.partial_rollout and self.mode != "async":
            raise SpecError("partial rollouts are part of the async mode", key="partial_rollout")
        if self.format != PLAN_FORMAT:
            raise SpecError(f"not a plan file (format must be {PLAN_FORMAT!r})", key="format")
        if self.version != PLAN_VERSION:
            raise SpecError(f"plan version {self.version} is not supported (this tool reads "
                            f"version {PLAN_VERSION})", key="version")
        # Always derived from the sets, so editing the sets is enough.
        object.__setattr__(self, "placement", placement_string(self.sets))

    # ----- queries -----

    def set_of(self, role: str) -> ColocatedSet:
        for s in self.sets:
            if role in s.roles:
                return s
        raise KeyError(role)

    def set_index(self, role: str) -> int:
        for i, s in enumerate(self.sets):
            if role in s.roles:
                return i
        raise KeyError(role)

    @property
    def total_gpus(self) -> int:
        return sum(s.gpus for s in self.sets)

    def describe(self, job: JobSpec | None = None) -> str:
        """'[16 GPUs] actor:... | [8 GPUs] critic:...'; with a mixed cluster's ``job`` each set
        names its device: '[16 x h20] ...'."""
        parts = []
        for s in self.sets:
            configs = []
            for role in s.roles:
                rp = self.roles[role]
                text = f"{role}:{rp.parallel.short()}"
                if rp.generation is not None:
                    text += f"/{rp.generation.short()}"
                configs.append(text)
            where = f"{s.gpus} GPUs"
            if job is not None and not job.cluster.is_homogeneous:
                where = f"{s.gpus} x {job.cluster.device_of(s.node_group)}"
            parts.append(f"[{where}] " + " ".join(configs))
        if self.rollout is not None:
            where = f"{self.rollout.gpus} GPUs"
            if job is not None and not job.cluster.is_homogeneous:
                where = f"{self.rollout.gpus} x {job.cluster.device_of(self.rollout.node_group)}"
            gen = self.roles["actor"].generation if "actor" in self.roles else None
            parts.append(f"[{where}] {ROLLOUT_LABEL}"
                         + (f":{gen.short()}" if gen is not None else "")
                         + f" ({self.mode_label()})")
        return " | ".join(parts)

    def mode_label(self) -> str:
        """'sync', 'one_step_off' or 'async (staleness 2, partial rollout)'."""
        if self.mode != "async":
            return self.mode
        extra = ", partial rollout" if self.partial_rollout else ""
        return f"async (staleness {self.max_staleness}{extra})"

    def located_sets(self) -> tuple[ColocatedSet, ...]:
        """The training sets and, for an asynchronous plan, the rollout set last (the
        locations of the simulator's timeline)."""
        if self.rollout is None:
            return self.sets
        return (*self.sets, self.rollout.as_set())

    # ----- validation against a job -----

    def validate(self, job: JobSpec) -> None:
        """Raise SpecError (naming the key) if the plan cannot run ``job`` on its cluster."""
        if self.algorithm != job.algorithm:
            raise SpecError(f"plan is for {self.algorithm!r} but the job runs "
                            f"{job.algorithm!r}", key="algorithm")
        self._check_sets_cover_the_roles(job)
        pool_of = self._check_sets_on_the_cluster(job)
        for role in job.gpu_roles:
            self._check_role(job, role, pool_of)
        for role in self.roles:
            if role not in job.gpu_roles:
                raise SpecError(f"{role!r} is not a GPU role of this job", key=f"roles.{role}")

    def _check_sets_cover_the_roles(self, job: JobSpec) -> None:
        """Every GPU role in exactly one set, and a placement the framework can run."""
        gpu_roles = job.gpu_roles
        seen: list[str] = []
        for i, s in enumerate(self.sets):
            for role in s.roles:
                if role not in gpu_roles:
                    hint = " (it is a rule)" if role in job.rule_roles else ""
                    raise SpecError(f"{role!r} is not a GPU role of this job{hint} "
                                    f"(roles: {', '.join(gpu_roles)})", key=f"sets[{i}].roles")
                if role in seen:
                    raise SpecError(f"{role!r} is in two colocated sets", key=f"sets[{i}].roles")
                seen.append(role)
        missing = [r for r in gpu_roles if r not in seen]
        if missing:
            raise SpecError(f"role {missing[0]!r} is in no colocated set", key="sets")
        if not job.placement_allowed(tuple(s.roles for s in self.sets)):
            raise SpecError(f"framework {job.framework!r} keeps the reference model's weights "
                            "in host memory and swaps them into the actor's model: 'ref' must "
                            "be in the actor's set", key="sets")

    def _check_sets_on_the_cluster(self, job: JobSpec) -> list[Pool]:
        """Each set (and the rollout set) on an existing node group, inside it, apart from the
        others, and inside one node or on whole nodes; the pool of each, in
        ``located_sets`` order."""
        cluster = job.cluster
        located = self.located_sets()

        def where_key(i: int) -> str:
            return f"sets[{i}]" if i < len(self.sets) else "rollout"

        pool_of: list[Pool] = []
        for i, s in enumerate(located):
            if s.node_group >= len(cluster.node_groups):
                raise SpecError(f"node group {s.node_group} does not exist (the cluster has "
                                f"{len(cluster.node_groups)}: 0-{len(cluster.node_groups) - 1})",
                                key=f"{where_key(i)}.node_group")
            pool_of.append(cluster.pool_of(s.node_group))
        for pool in {p.index: p for p in pool_of}.values():
            members = [i for i, p in enumerate(pool_of) if p.index == pool.index]
            used = sum(located[i].gpus for i in members)
            where = "the cluster" if cluster.is_homogeneous else f"node group {pool.index}"
            if used > pool.gpus:
                raise SpecError(f"the sets use {used} GPUs but {where} has {pool.gpus}",
                                key="sets")
            ranges = sorted((located[i].first_gpu, located[i].first_gpu + located[i].gpus,
                             i) for i in members)
            for (a0, a1, ia), (b0, _b1, ib) in itertools.pairwise(ranges):
                if b0 < a1:
                    raise SpecError(f"sets {ia} and {ib} overlap (GPUs {a0}-{a1 - 1} and from "
                                    f"{b0})", key=f"{where_key(ib)}.first_gpu")
            gpus_per_node = pool.group.gpus_per_node
            for i in members:
                s = located[i]
                if s.first_gpu + s.gpus > pool.gpus:
                    raise SpecError(f"GPUs {s.first_gpu}-{s.first_gpu + s.gpus - 1} are outside "
                                    f"{where}'s {pool.gpus}", key=f"{where_key(i)}.first_gpu")
                # The cost model prices a set as part of one node or as whole nodes.
                inside_one_node = s.first_gpu // gpus_per_node == \
                    (s.first_gpu + s.gpus - 1) // gpus_per_node
                whole_nodes = s.first_gpu % gpus_per_node == 0 and s.gpus % gpus_per_node == 0
                if not (inside_one_node or whole_nodes):
                    raise SpecError(f"GPUs {s.first_gpu}-{s.first_gpu + s.gpus - 1} cover part "
                                    f"of more than one node of {gpus_per_node} GPUs; a set lies "
                                    "inside one node or is whole nodes starting on a node "
                                    "boundary", key=f"{where_key(i)}.first_gpu")
        return pool_of

    def _check_role(self, job: JobSpec, role: str, pool_of: list[Pool]) -> None:
        """``role``'s layout fits its model and its set (``pool_of``: each set's pool); the
        actor's generation fits its training layout (or the rollout set); a frozen model
        shards no optimizer."""
        key = f"roles.{role}"
        if role not in self.roles:
            raise SpecError("missing parallel config", key=key)
        rp = self.roles[role]
        s = self.set_of(role)
        gpus_per_node = pool_of[self.set_index(role)].group.gpus_per_node
        model = job.model(role)
        par = rp.parallel
        par.check_model(model, gpus_per_node=gpus_per_node, key=f"{key}.parallel")
        if par.world_size != s.gpus:
            raise SpecError(f"pp*tp*dp = {par.world_size} but its set has {s.gpus} GPUs",
                            key=f"{key}.parallel")
        straddle = first_straddling_group(s.first_gpu, s.gpus, par.tp, gpus_per_node)
        if straddle is not None:
            raise SpecError(f"the tp={par.tp} group from GPU {straddle} would straddle two "
                            f"nodes of {gpus_per_node} GPUs (its set is GPUs {s.first_gpu}-"
                            f"{s.first_gpu + s.gpus - 1}); tensor parallelism stays inside "
                            "a node", key=f"{key}.parallel.tp")
        generates = "generate" in job.dataflow.operations_of(role)
        if generates:
            if rp.generation is None:
                raise SpecError("the actor needs a generation config", key=f"{key}.generation")
            if self.rollout is None:
                rp.generation.check(model, par, gpus_per_node=gpus_per_node,
                                    key=f"{key}.generation",
                                    nested=job.framework_profile.space.generation.nested)
            else:
                self._check_rollout(job, model, rp.generation, key=f"{key}.generation")
        elif rp.generation is not None:
            raise SpecError(f"{role} does not generate", key=f"{key}.generation")
        # Frozen models have no optimizer; FSDP-style parameter sharding is allowed.
        if "train" not in job.dataflow.operations_of(role) and par.sharding == "optimizer":
            raise SpecError(f"{role} is not trained: it has no optimizer to shard",
                            key=f"{key}.parallel.sharding")

    def _check_rollout(self, job: JobSpec, model: Any, gen: GenerationConfig, *,
                       key: str) -> None:
        """The rollout set holds whole generation replicas of the actor (no training shard
        to lie inside: the weights arrive by the sync after each update)."""
        assert self.rollout is not None
        gpus_per_node = job.cluster.pool_of(self.rollout.node_group).group.gpus_per_node
        gen.check_shape(model, gpus_per_node=gpus_per_node, key=key)
        gen.check_experts(model, self.rollout.gpus, key=key)
        if self.rollout.gpus % gen.model_parallel_size:
            raise SpecError(f"the rollout set's {self.rollout.gpus} GPUs do not hold whole "
                            f"replicas of tp*pp={gen.model_parallel_size}", key="rollout.gpus")
        straddle = first_straddling_group(self.rollout.first_gpu, self.rollout.gpus, gen.tp,
                                          gpus_per_node)
        if straddle is not None:
            raise SpecError(f"the generation tp={gen.tp} group from GPU {straddle} would "
                            "straddle two nodes", key=f"{key}.tp")

    def generation_replicas(self) -> int:
        """The actor's generation replicas: on the rollout set, or on its training GPUs."""
        actor = self.roles["actor"]
        assert actor.generation is not None
        if self.rollout is not None:
            return self.rollout.gpus // actor.generation.model_parallel_size
        return actor.generation.replicas(actor.parallel)

    def check_backends(self) -> None:
        """Raise SpecError if a role's training backend cannot run its layout, or if the
        Megatron roles of one set disagree on (tp, pp, vpp) (what ``execute`` needs beyond
        ``validate``: the simulator prices layouts no executor backend runs)."""
        for role, rp in self.roles.items():
            key = f"roles.{role}.training_backend"
            if rp.training_backend == "torch" and not torch_runs(rp.parallel):
                raise SpecError(f"the torch backend cannot run {rp.parallel.short()} "
                                "(pipeline, distributed optimizer or sequence parallelism need "
                                "megatron)", key=key)
            if rp.training_backend == "megatron" and not megatron_runs(rp.parallel):
                raise SpecError("the Megatron backend shards optimizer states (sharding: "
                                "optimizer), not FSDP-style, and runs no context parallelism "
                                "(its local layer spec has no context-parallel attention); "
                                "set cp: 1 to execute", key=key)
        for i, s in enumerate(self.sets):
            layouts = {role: self.roles[role].megatron_layout() for role in s.roles
                       if role in self.roles and self.roles[role].megatron_layout()}
            if len(set(layouts.values())) > 1:
                shown = ", ".join(f"{r} tp{t}-pp{p}-vpp{v}-cp{c}"
                                  for r, (t, p, v, c) in layouts.items())
                raise SpecError(f"Megatron roles of one colocated set share one (tp, pp, vpp, "
                                f"cp) "
                                f"layout (Megatron's parallel state is one per process); got "
                                f"{shown}", key=f"sets[{i}]")

    # ----- files -----

    def to_value(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "version": self.version,
            "algorithm": self.algorithm,
            "strategy": self.strategy,
            "placement": self.placement,
            "sets": [to_mapping(s) for s in self.sets],
            "roles": {r: {k: v for k, v in to_mapping(rp).items() if v is not None}
                      for r, rp in self.roles.items()},
        }
        if self.mode != "sync":
            out["mode"] = self.mode
            out["max_staleness"] = self.max_staleness
            out["partial_rollout"] = self.partial_rollout
            out["rollout"] = to_mapping(self.rollout)
        if self.predicted is not None:
            out["predicted"] = self.predicted
        if self.job is not None:
            out["job"] = self.job
        return out

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json_text(self.to_value()))


def job_as_planned(job: JobSpec, plan: Plan) -> JobSpec:
    """``job`` in ``plan``'s mode, so that its dataflow has the passes the framework runs in
    that mode (an ``auto`` job's one-step-off or async candidate); unchanged for a plan of the
    job's own mode and for a synchronous plan of an ``auto`` job."""
    if plan.mode == job.mode or (plan.mode == "sync" and job.mode == "auto"):
        return job
    return job.for_mode(plan.mode, plan.max_staleness, plan.partial_rollout)


def placement_string(sets: tuple[ColocatedSet, ...] | list[ColocatedSet]) -> str:
    """'actor,ref|critic,reward' for sets [actor, ref], [critic, reward]."""
    return "|".join(s.label() for s in sets)


def parse_placement(text: str, roles: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Parse 'actor,ref|critic,reward' into role groups, checking it partitions ``roles``."""
    groups = [tuple(r.strip() for r in part.split(",") if r.strip())
              for part in text.split("|")]
    flat = [r for g in groups for r in g]
    if any(not g for g in groups):
        raise SpecError(f"empty colocated set in {text!r}", key="placement")
    for role in flat:
        if role not in roles:
            raise SpecError(f"unknown role {role!r} (roles: {', '.join(roles)})",
                            key="placement")
    if len(set(flat)) != len(flat):
        raise SpecError(f"a role appears twice in {text!r}", key="placement")
    missing = [r for r in roles if r not in flat]
    if missing:
        raise SpecError(f"role {missing[0]!r} is missing from {text!r}", key="placement")
    return groups


def plan_from_mapping(data: dict[str, Any], source: str | None = None) -> Plan:
    return from_mapping(Plan, data, source=source)


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON (version-checked)."""
    return plan_from_mapping(read_mapping(path), source=str(path))
