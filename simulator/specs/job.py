"""JobSpec: algorithm + models per role + cluster + workload, loaded from a job YAML."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

from profiles.datafile import SpecError, did_you_mean, from_mapping, read_mapping, require
from profiles.framework import (
    DEFAULT_FRAMEWORK,
    FixedCosts,
    FrameworkProfile,
    RolloutSettings,
    load_framework,
)
from simulator.specs.asynchrony import JobMode, Mode, allowed_modes, check_mode
from simulator.specs.cluster import ClusterSpec, Pool
from simulator.specs.data import DataSpec, parse_data
from simulator.specs.dataflow import (
    CONTROLLER,
    RULE_ROLES,
    Dataflow,
    Node,
    get_dataflow,
)
from simulator.specs.lengths import parse_lengths
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import Dispatcher, Recompute, Sharding, check_pipeline_stages
from simulator.specs.presets import load_model
from simulator.specs.workload import Workload

RULE = "rule"
"""Model value meaning 'this role is a rule on the controller' (``reward: rule``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RolePin:
    """Parallel settings a job fixes for one role (the rest is chosen by the planner or by
    the default plan). Every field is optional."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    sharding: Sharding | None = None
    recompute: Recompute | None = None
    micro_batch_size: int | None = None
    sequence_parallel: bool | None = None
    generation_tp: int | None = None
    """Actor only: generation tensor-parallel size."""
    generation_pp: int | None = None
    """Actor only: generation pipeline size."""
    max_num_seqs: int | None = None
    """Actor only: generation running-batch cap per replica."""
    gpu_memory_utilization: float | None = None
    """Actor only: fraction of GPU memory the rollout engine may fill (weights + KV cache)."""
    free_cache: bool | None = None
    """Actor only: whether the colocated rollout engine frees its KV cache between
    generations (verl's free_cache_engine)."""
    overlap_grad_reduce: bool | None = None
    """Overlap the gradient reduction with the backward pass (default: on when the
    framework allows it, since it is never slower)."""
    overlap_param_gather: bool | None = None
    """Overlap the distributed optimizer's / FSDP's parameter gathers with compute."""
    ep: int | None = None
    """MoE: expert parallel size."""
    etp: int | None = None
    """MoE: expert tensor parallel size."""
    moe_dispatcher: Dispatcher | None = None
    """MoE: token dispatcher, alltoall or flex (deduplicated per node)."""
    generation_ep: int | None = None
    """Actor only, MoE: expert-parallel serving over this many GPUs (vLLM's
    enable_expert_parallel; 1: none)."""
    ulysses: int | None = None
    """Ulysses sequence-parallel ranks (verl's ulysses_sequence_parallel_size)."""
    cp: int | None = None
    """Megatron context-parallel ranks (context_parallel_size)."""
    fsdp_size: int | None = None
    """FSDP hybrid sharding: ranks per sharding group (verl's fsdp_size); the data-parallel
    ranks, or leave it out, for plain FSDP."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise SpecError(f"must be a positive integer, got {value}", key=f.name)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise SpecError(f"must be in (0, 1], got {self.gpu_memory_utilization}",
                            key="gpu_memory_utilization")

    def set_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def _check_pin_layout(pin: RolePin, model: ModelSpec, *, key: str) -> None:
    """Reject pinned settings no layout of ``model`` can satisfy (checked when the job loads,
    so a bad pin is reported as such rather than as a plan that does not fit)."""
    for name in ("ep", "etp"):
        if getattr(pin, name) not in (None, 1) and model.moe is None:
            raise SpecError(f"{model.name} is dense: {name} needs a moe: model",
                            key=f"{key}.{name}")
    if pin.ep and model.moe is not None and model.moe.experts % pin.ep:
        raise SpecError(f"ep={pin.ep} does not divide the {model.moe.experts} experts of "
                        f"{model.name}", key=f"{key}.ep")
    if pin.pp or pin.vpp:
        check_pipeline_stages(model, pin.pp or 1, pin.vpp or 1, key=key)
    if pin.vpp and pin.vpp > 1 and pin.pp == 1:
        raise SpecError("virtual pipeline stages need pp > 1", key=f"{key}.vpp")
    if pin.sharding == "fsdp" and pin.pp and pin.pp > 1:
        raise SpecError("FSDP shards whole layers across data-parallel ranks and does not "
                        "combine with pipeline parallelism here; pin pp: 1 or another sharding",
                        key=f"{key}.sharding")
    if pin.fsdp_size is not None and pin.sharding not in (None, "fsdp"):
        raise SpecError(f"hybrid sharding groups belong to FSDP; pin sharding: fsdp or drop "
                        f"fsdp_size (sharding is {pin.sharding})", key=f"{key}.fsdp_size")
    if pin.fsdp_size == 1:
        raise SpecError("an FSDP group of one rank shards nothing: pin sharding: none for "
                        "whole replicas, or fsdp_size >= 2", key=f"{key}.fsdp_size")
    if pin.generation_pp and pin.generation_pp > model.layers:
        raise SpecError(f"generation_pp={pin.generation_pp} is more stages than the "
                        f"{model.layers} layers of {model.name}", key=f"{key}.generation_pp")
    # 3D-HybridEngine: without FSDP each GPU's training shard must lie inside its generation
    # shard, so the generation sizes divide the training ones (an MoE model with ep > 1 spans
    # the ep group too: GenerationConfig.check judges that once the layout is known).
    if pin.sharding not in (None, "fsdp") and (pin.ep or 1) == 1:
        for train_key, gen_key in (("tp", "generation_tp"), ("pp", "generation_pp")):
            train, gen = getattr(pin, train_key), getattr(pin, gen_key)
            if train is not None and gen is not None and train % gen:
                raise SpecError(f"{gen_key}={gen} must divide {train_key}={train} (each GPU's "
                                "training shard lies inside its generation shard)",
                                key=f"{key}.{gen_key}")


@dataclass(kw_only=True, slots=True, frozen=True)
class RoleBackends:
    """Which executor backends run a role."""

    training: Literal["", "torch", "megatron"] = ""
    """torch: FSDP2 + DTensor tensor parallelism; megatron: Megatron-core (3D, distributed
    optimizer); left out: the backend the plan names for the role."""
    generation: Literal["native", "vllm"] = "native"
    """Actor only: native batched sampler with a KV cache, or vLLM."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RewardFunction:
    """The user's reward function for ``reward: rule`` (the executor calls it; the planner
    prices it as a rule on the controller)."""

    path: str
    """A Python file (relative paths are relative to the job file)."""
    name: str = "compute_score"
    """The function in it: (prompt text, response text, data row) -> float, or a mapping
    with a ``score``."""

    def __post_init__(self) -> None:
        require(bool(self.path.strip()), "must name a Python file", "path")
        require(self.name.isidentifier(), f"{self.name!r} is not a function name", "name")


_POOL_VIEWS: dict[tuple[int, int], tuple[JobSpec, JobSpec]] = {}
"""(id(job), pool index) -> (job, its view on the pool); the job is kept so its id is not
reused while the entry lives."""


@dataclass(kw_only=True, slots=True, frozen=True)
class JobSpec:
    """An RLHF job: what runs (algorithm, models), where (cluster) and on what (workload)."""

    algorithm: str = "ppo"
    """ppo | remax | safe-rlhf | grpo | any registered dataflow."""
    models: dict[str, ModelSpec | Literal["rule"]]
    """Role -> model (preset, spec YAML, config.json, inline mapping) or 'rule'."""
    cluster: ClusterSpec
    workload: Workload = field(default_factory=Workload)
    parallel: dict[str, RolePin] = field(default_factory=dict)
    """Optional per-role parallel settings to keep fixed."""
    backends: dict[str, RoleBackends] = field(default_factory=dict)
    """Optional per-role executor backends (default torch + native)."""
    name: str = ""
    """Display name of the job."""
    framework: str = DEFAULT_FRAMEWORK
    """The RLHF framework that runs the job: a profile name (``profiles/frameworks/``: verl,
    nemo-rl, hybridflow) or a profile YAML. It decides which passes run, overlap defaults,
    the rollout engine's behaviour, offload and fixed costs."""
    rollout_engine: str | None = None
    """The framework's rollout engine the job generates with: one its profile lists (verl:
    vllm or sglang); left out, the framework's default (vllm)."""
    reward_function: RewardFunction | None = None
    """The user's reward function, for ``reward: rule`` (None: the task's own rule)."""
    data: DataSpec | None = None
    """Where ``hybridflow execute`` takes its prompts from (None: the built-in task)."""
    model_paths: dict[str, str] = field(default_factory=dict)
    """Role -> the Hugging Face checkpoint directory (or config.json) its model was read
    from, when it was given as a path: the executor starts the role from that checkpoint and
    takes the tokenizer from there."""
    mode: JobMode = "sync"
    """sync (default), one_step_off, async, or auto (the planner picks the fastest mode that
    ``max_staleness`` allows); see ``simulator/specs/asynchrony.py``."""
    max_staleness: int | None = None
    """The most updates a batch's generating policy may lag the one that trains on it (0:
    synchronous; async and auto default to 1)."""
    partial_rollout: bool = False
    """async: a weight sync interrupts the responses in flight, which continue with the new
    weights (verl's partial rollout) instead of draining before the sync."""
    kl: KlTerm | None = None
    """Where the KL divergence to the reference policy enters: ``reward`` (a penalty in the
    reward, PPO's and ReMax's default: verl use_kl_in_reward), ``loss`` (a term of the actor's
    loss, GRPO's default: verl use_kl_loss) or ``none`` (no KL: no reference model, no
    reference pass; DAPO and most 2025-26 GRPO recipes). Left out: the algorithm's default."""
    generation_elsewhere: bool = field(default=False, repr=False)
    """Internal, never read from a job file: the actor generates on a rollout set of its own,
    so the training GPUs hold no generation engine and do not reshard (the planner's view of
    an asynchronous plan's trainer side)."""
    framework_fixed_costs: FixedCosts | None = field(default=None, repr=False)
    """Internal, never read from a job file: fixed costs that replace the framework profile's
    (calibration's candidates while it fits a framework profile)."""

    def __post_init__(self) -> None:
        dataflow = get_dataflow(self.algorithm)
        if self.kl not in (None, *KL_TERMS):
            raise SpecError(f"must be one of {', '.join(KL_TERMS)}; got {self.kl!r}", key="kl")
        if self.kl == "none":
            if "ref" in self.models:
                raise SpecError("kl: none runs no reference pass and holds no reference model: "
                                "remove models.ref (or set kl: loss / reward)", key="models.ref")
            dataflow = without_reference(dataflow)
        check_mode(self.mode, self.max_staleness, self.partial_rollout)
        if self.mode != "sync" and "actor" not in dataflow.trained_roles:
            raise SpecError(f"{self.algorithm} trains no actor: nothing to run off-policy",
                            key="mode")
        if self.reward_function is not None and self.models.get("reward") != RULE:
            raise SpecError("a reward function scores in place of a reward model: give "
                            "models.reward: rule", key="reward_function")
        try:
            load_framework(self.framework)
        except SpecError as exc:
            if exc.source and exc.key:  # a problem inside the framework's own file
                raise
            raise SpecError(exc.problem, key="framework", source=exc.source) from None
        self.framework_profile.rollout_for(self.rollout_engine)
        for i, group in enumerate(self.cluster.node_groups):
            key = "cluster.device" if self.cluster.is_homogeneous else \
                f"cluster.node_groups[{i}].device"
            try:
                group.profile()
            except SpecError as exc:
                raise SpecError(exc.problem if exc.key == "device" else str(exc),
                                key=key) from None
        needed = dataflow.roles
        for role in needed:
            if role not in self.models:
                raise SpecError(f"missing: {self.algorithm} needs a model for each of "
                                f"{', '.join(needed)}", key=f"models.{role}")
        for role, model in self.models.items():
            if role not in needed:
                raise SpecError(f"{self.algorithm} has no role {role!r} (roles: "
                                f"{', '.join(needed)})", key=f"models.{role}")
            if model == RULE and role not in RULE_ROLES:
                raise SpecError(f"only {', '.join(RULE_ROLES)} can be a rule", key=f"models.{role}")
            if model == RULE and dataflow.operations_of(role) != {"infer"}:
                raise SpecError("a rule can only replace a model that is used for inference",
                                key=f"models.{role}")
        if self.workload.greedy_response_length is not None and not any(
                n.responses == "greedy" for n in dataflow.nodes):
            raise SpecError(f"{self.algorithm} generates no greedy responses (ReMax's baseline "
                            "does); remove this key", key="workload.greedy_response_length")
        if self.algorithm == "grpo" and self.workload.samples_per_prompt < 2:
            raise SpecError("grpo normalises rewards within a group: samples_per_prompt must be "
                            f">= 2, got {self.workload.samples_per_prompt}",
                            key="workload.samples_per_prompt")
        # A pin must fit the largest node of the cluster (on a mixed cluster the search keeps
        # the roles whose pins need bigger nodes off the smaller groups).
        gpus_per_node = max(g.gpus_per_node for g in self.cluster.node_groups)
        for role, pin in self.parallel.items():
            if role not in self.gpu_roles:
                raise SpecError(f"no model runs as {role!r} on GPUs (GPU roles: "
                                f"{', '.join(self.gpu_roles)})", key=f"parallel.{role}")
            for key in ("tp", "generation_tp"):
                value = getattr(pin, key)
                if value is not None and value > gpus_per_node:
                    raise SpecError(f"{key}={value} is larger than a node ({gpus_per_node} "
                                    "GPUs); tensor parallelism stays inside a node",
                                    key=f"parallel.{role}.{key}")
            model = self.model(role)
            for key in ("tp", "generation_tp"):
                value = getattr(pin, key)
                if value is not None and model.heads % value:
                    raise SpecError(f"{key}={value} does not divide the {model.heads} heads "
                                    f"of {model.name}", key=f"parallel.{role}.{key}")
            if role != "actor" and (pin.generation_tp or pin.generation_pp or
                                    pin.generation_ep or pin.max_num_seqs
                                    or pin.gpu_memory_utilization
                                    or pin.free_cache is not None):
                raise SpecError("only the actor generates", key=f"parallel.{role}")
            if pin.free_cache is False and "free_cache" not in \
                    self.framework_profile.space.searchable_rollout:
                raise SpecError(f"{self.framework}'s colocated rollout engine frees its KV "
                                "cache after every generation (the framework has no setting "
                                "that keeps it); drop free_cache, or use framework: verl",
                                key=f"parallel.{role}.free_cache")
            _check_pin_layout(pin, model, key=f"parallel.{role}")
        for role, chosen in self.backends.items():
            if role not in self.gpu_roles:
                raise SpecError(f"no model runs as {role!r} on GPUs (GPU roles: "
                                f"{', '.join(self.gpu_roles)})", key=f"backends.{role}")
            if chosen.generation != "native" and role != "actor":
                raise SpecError("only the actor generates", key=f"backends.{role}.generation")
        response = self.workload.response_length.max_tokens
        if self.workload.prompt_length + response <= 0:
            raise SpecError("prompt plus response must be positive", key="workload")

    # ----- queries -----

    @property
    def framework_profile(self) -> FrameworkProfile:
        return _framework_with_fixed_costs(self.framework, self.framework_fixed_costs)

    @property
    def rollout(self) -> RolloutSettings:
        """The settings of the job's rollout engine (``rollout_engine``) in its framework."""
        return self.framework_profile.rollout_for(self.rollout_engine)

    def overlap_for(self, role: str) -> tuple[bool, bool]:
        """(overlap_grad_reduce, overlap_param_gather) for ``role``: pinned, else on when the
        framework lets users turn it on (overlap is never slower), else its default."""
        pin = self.parallel.get(role)
        training = self.framework_profile.training
        grad = training.overlap_configurable or training.overlap_grad_reduce
        param = training.overlap_configurable or training.overlap_param_gather
        if pin is not None and pin.overlap_grad_reduce is not None:
            grad = pin.overlap_grad_reduce
        if pin is not None and pin.overlap_param_gather is not None:
            param = pin.overlap_param_gather
        return grad, param

    def rollout_defaults(self) -> tuple[int, float]:
        """(max_num_seqs, gpu_memory_utilization) of the actor's engine: pinned, else the
        framework's defaults."""
        pin = self.parallel.get("actor")
        rollout = self.rollout
        seqs = pin.max_num_seqs if pin and pin.max_num_seqs else rollout.max_num_seqs
        utilization = pin.gpu_memory_utilization if pin and pin.gpu_memory_utilization \
            else rollout.gpu_memory_utilization
        return seqs, utilization

    @property
    def dataflow(self) -> Dataflow:
        """The algorithm's dataflow with the passes the framework adds in the job's mode (an
        ``auto`` job's plans are priced with ``for_mode``: each with its own mode's passes)."""
        return dataflow_with_passes(self.algorithm, self.framework, self.mode,
                                    reference=self.kl != "none",
                                    filtered=self.workload.generates_more_than_it_trains)

    @property
    def kl_term(self) -> KlTerm:
        """Where the KL term enters (the job's ``kl``, else the algorithm's default)."""
        if self.kl is not None:
            return self.kl
        return "loss" if self.algorithm == "grpo" else "reward"

    @property
    def gpu_roles(self) -> tuple[str, ...]:
        """Roles served by a model on GPUs (not rules), in dataflow order."""
        return tuple(r for r in self.dataflow.roles if self.models.get(r) != RULE)

    @property
    def reference_on_host(self) -> bool:
        """The framework keeps the reference model's weights in host memory and swaps them into
        the actor's model for the reference pass, so the reference shares the actor's GPUs."""
        return (self.framework_profile.training.reference_weights == "host_swap"
                and "ref" in self.gpu_roles and "actor" in self.gpu_roles)

    def placement_allowed(self, groups: tuple[tuple[str, ...], ...]) -> bool:
        """Whether the framework can run a placement (a partition of the GPU roles)."""
        if not self.reference_on_host:
            return True
        return any("ref" in g and "actor" in g for g in groups)

    @property
    def rule_roles(self) -> tuple[str, ...]:
        return tuple(r for r in self.dataflow.roles if self.models.get(r) == RULE)

    def model(self, role: str) -> ModelSpec:
        model = self.models[role]
        if not isinstance(model, ModelSpec):
            raise SpecError(f"{role} is a rule, not a model", key=f"models.{role}")
        return model

    @property
    def allowed_modes(self) -> tuple[tuple[Mode, int], ...]:
        """(mode, staleness) pairs the planner may choose from."""
        return allowed_modes(self.mode, self.max_staleness)

    def for_mode(self, mode: str, max_staleness: int | None,
                 partial_rollout: bool = False) -> JobSpec:
        """The job as a plan of ``mode`` runs it (an ``auto`` job's candidate of one mode):
        the framework's passes are those of that mode."""
        if (mode, max_staleness, partial_rollout) == (self.mode, self.max_staleness,
                                                      self.partial_rollout):
            return self
        return replace(self, mode=mode, max_staleness=max_staleness,
                       partial_rollout=partial_rollout)

    def with_cluster(self, cluster: ClusterSpec) -> JobSpec:
        return replace(self, cluster=cluster)

    def on_pool(self, pool: Pool) -> JobSpec:
        """The job as a set on ``pool`` sees it: the cluster reduced to that pool (its device,
        node size and network). The job itself when the cluster is one group."""
        if self.cluster.is_homogeneous:
            return self
        key = (id(self), pool.index)
        cached = _POOL_VIEWS.get(key)
        if cached is None or cached[0] is not self:
            if len(_POOL_VIEWS) > 256:
                _POOL_VIEWS.clear()
            cached = (self, replace(self, cluster=self.cluster.pool_cluster(pool)))
            _POOL_VIEWS[key] = cached
        return cached[1]

    def on_set(self, node_group: int) -> JobSpec:
        """``on_pool`` for a set placed on the job's node group ``node_group``."""
        return self.on_pool(self.cluster.pool_of(node_group))

    def to_value(self) -> dict[str, Any]:
        """The job as a plain mapping (what a job YAML would hold; models inlined)."""
        from profiles.datafile import to_mapping
        from simulator.specs.presets import MODEL_PRESETS

        def model_value(model: ModelSpec | str) -> Any:
            if model == RULE:
                return RULE
            assert isinstance(model, ModelSpec)
            if MODEL_PRESETS.get(model.name) == model:
                return model.name
            return {f.name: to_mapping(getattr(model, f.name)) for f in fields(model)
                    if f.init and getattr(model, f.name) != f.default}

        workload = to_mapping(self.workload)
        workload["response_length"] = self.workload.response_length.to_value()
        greedy = self.workload.greedy_response_length
        if greedy is None:
            workload.pop("greedy_response_length", None)
        else:
            workload["greedy_response_length"] = greedy.to_value()
        return {
            "name": self.name,
            "algorithm": self.algorithm,
            "models": {role: self.model_paths.get(role) or model_value(m)
                       for role, m in self.models.items()},
            "cluster": self.cluster.to_value(),
            "workload": workload,
            "parallel": {r: p.set_fields() for r, p in self.parallel.items()},
            "backends": {r: to_mapping(b) for r, b in self.backends.items()},
            "framework": self.framework,
            **({"rollout_engine": self.rollout_engine} if self.rollout_engine is not None
               else {}),
            **({"reward_function": to_mapping(self.reward_function)}
               if self.reward_function is not None else {}),
            **({"data": to_mapping(self.data)} if self.data is not None else {}),
            **({"mode": self.mode} if self.mode != "sync" else {}),
            **({"max_staleness": self.max_staleness} if self.max_staleness is not None
               else {}),
            **({"partial_rollout": True} if self.partial_rollout else {}),
            **({"kl": self.kl} if self.kl is not None else {}),
        }


@cache
def _framework_with_fixed_costs(framework: str, fixed: FixedCosts | None) -> FrameworkProfile:
    # Cached on the name, not on the profile: hashing a whole profile (its search space
    # included) on every cost query took a fifth of a 128-GPU search.
    profile = load_framework(framework)
    return profile if fixed is None else replace(profile, fixed_costs=fixed)


OLD_LOG_PROB_NODE = "actor.old_log_prob"
"""The node a framework adds when it recomputes old log-probs with the training engine."""


KlTerm = Literal["reward", "loss", "none"]
KL_TERMS = ("reward", "loss", "none")


def without_reference(dataflow: Dataflow) -> Dataflow:
    """``dataflow`` without its reference model: no reference pass, and nothing waits for
    one (a job with no KL term)."""
    dropped = {n.name for n in dataflow.nodes if n.role == "ref"}
    if not dropped:
        return dataflow
    nodes = tuple(replace(n, after=tuple(a for a in n.after if a not in dropped))
                  for n in dataflow.nodes if n.name not in dropped)
    return replace(dataflow, nodes=nodes)


def filtered_after_reward(dataflow: Dataflow) -> Dataflow:
    """``dataflow`` with dynamic sampling (DAPO): the batch is filtered by its rewards before
    anything else reads it, so every other model's pass waits for the reward (and cost)
    scores."""
    scorers = tuple(n.name for n in dataflow.nodes if n.operation == "infer"
                    and n.role in RULE_ROLES)
    if not scorers:
        return dataflow
    waiting = [replace(n, after=tuple(dict.fromkeys((*n.after, *scorers))))
               if n.operation == "infer" and n.role not in RULE_ROLES else n
               for n in dataflow.nodes if n.name not in scorers]
    # The scorers read only the generations: they move right after the last one, before the
    # passes that now wait for them.
    last_generate = max(i for i, n in enumerate(waiting) if n.operation == "generate")
    moved = [n for n in dataflow.nodes if n.name in scorers]
    nodes = (*waiting[:last_generate + 1], *moved, *waiting[last_generate + 1:])
    return replace(dataflow, nodes=nodes)


@cache
def dataflow_with_passes(algorithm: str, framework: str, mode: str = "sync", *,
                         reference: bool = True, filtered: bool = False) -> Dataflow:
    """``algorithm``'s dataflow plus the passes ``framework`` runs in ``mode``: with the
    old-log-prob recompute, one more actor forward over the sampled sequences right after
    generation, which the controller's work (advantages) then waits for. Without a
    ``reference`` (no KL term) the reference pass is left out; ``filtered`` (dynamic sampling)
    makes every pass but the scoring wait for the scores."""
    base = get_dataflow(algorithm)
    if not reference:
        base = without_reference(base)
    passes = _with_old_log_prob(base, framework, mode)
    return filtered_after_reward(passes) if filtered else passes


def _with_old_log_prob(base: Dataflow, framework: str, mode: str) -> Dataflow:
    profile = load_framework(framework)
    if not profile.passes.old_log_prob_in(mode) or "actor" not in base.trained_roles:
        return base
    sampled = [n for n in base.nodes if n.role == "actor" and n.operation == "generate"
               and n.responses == "sampled"]
    if not sampled:
        return base
    pass_node = Node(role="actor", operation="infer", name=OLD_LOG_PROB_NODE,
                     after=(sampled[0].name,))
    consumers = [n.name for n in base.nodes if n.role == CONTROLLER] or \
        [n.name for n in base.nodes if n.role == "actor" and n.operation == "train"]
    nodes = []
    last_generate = max(i for i, n in enumerate(base.nodes)
                        if n.role == "actor" and n.operation == "generate")
    for i, node in enumerate(base.nodes):
        if node.name in consumers:
            node = replace(node, after=(*node.after, OLD_LOG_PROB_NODE))
        nodes.append(node)
        if i == last_generate:
            nodes.append(pass_node)
    return replace(base, nodes=tuple(nodes))


JOB_KEYS = ("name", "algorithm", "models", "cluster", "workload", "parallel", "backends",
             "framework", "rollout_engine", "reward_function", "data", "mode", "max_staleness",
             "partial_rollout", "kl")
"""The top-level keys a job file may have."""


def job_from_mapping(data: dict[str, Any], *, source: str | None = None,
                     base_dir: Path | None = None) -> JobSpec:
    """Build and validate a JobSpec from the mapping of a job file. The keys are read in a
    fixed order, so a file with several problems is always answered with the same one."""
    try:
        _check_job_keys(data)
        models, model_paths = _job_models(data["models"], base_dir)
        workload = _job_workload(data.get("workload") or {}, base_dir)
        parallel = _per_role(data, "parallel", RolePin, "settings")
        backends = _per_role(data, "backends", RoleBackends, "backends")
        algorithm = _job_string(data, "algorithm", "ppo", "a string")
        name = _job_string(data, "name", "", "a string")
        framework = _job_string(data, "framework", DEFAULT_FRAMEWORK,
                                "a framework name or profile path")
        if base_dir is not None and framework.endswith((".yaml", ".yml")):
            framework = str(base_dir / framework)
        reward_function = _job_reward_function(data.get("reward_function"), base_dir)
        data_spec = parse_data(data["data"], base_dir) if data.get("data") is not None \
            else None
        mode = _job_string(data, "mode", "sync", "one of sync, one_step_off, async, auto")
        partial_rollout = data.get("partial_rollout", False)
        if not isinstance(partial_rollout, bool):
            raise SpecError(f"expected true or false, got {partial_rollout!r}",
                            key="partial_rollout")
        kl = data.get("kl")
        if kl is not None and kl not in KL_TERMS:
            raise SpecError(f"must be one of {', '.join(KL_TERMS)}; got {kl!r}", key="kl")
        rollout_engine = data.get("rollout_engine")
        if rollout_engine is not None and not isinstance(rollout_engine, str):
            raise SpecError(f"expected a rollout engine's name (vllm, sglang), got "
                            f"{rollout_engine!r}", key="rollout_engine")
        return JobSpec(algorithm=algorithm, models=models, kl=kl,
                       rollout_engine=rollout_engine,
                       cluster=ClusterSpec.from_value(data["cluster"]), workload=workload,
                       parallel=parallel, backends=backends, name=name, framework=framework,
                       reward_function=reward_function, data=data_spec,
                       model_paths=model_paths, mode=mode,  # type: ignore[arg-type]
                       max_staleness=data.get("max_staleness"),
                       partial_rollout=partial_rollout)
    except SpecError as exc:
        raise exc.within(source=source) from None


def _check_job_keys(data: dict[str, Any]) -> None:
    """Only JOB_KEYS, and the two a job cannot do without."""
    unknown = [k for k in data if k not in JOB_KEYS]
    if unknown:
        raise SpecError(f"unknown key{did_you_mean(str(unknown[0]), JOB_KEYS)} (allowed: "
                        f"{', '.join(JOB_KEYS)})", key=unknown[0])
    for required in ("models", "cluster"):
        if required not in data:
            raise SpecError("missing required key", key=required)


def _job_models(raw: Any, base_dir: Path | None) -> tuple[dict[str, Any], dict[str, str]]:
    """(role -> ModelSpec or RULE, role -> checkpoint directory) of ``models``."""
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping of role -> model, got {raw!r}", key="models")
    models: dict[str, Any] = {}
    model_paths: dict[str, str] = {}
    for role, value in raw.items():
        models[role] = RULE if value == RULE else load_model(
            value, base_dir=base_dir, key=f"models.{role}")
        path = checkpoint_path(value, base_dir)
        if path is not None:
            model_paths[role] = path
    return models, model_paths


def _job_workload(raw: Any, base_dir: Path | None) -> Workload:
    """``workload``, its response lengths read as a distribution or a file of them."""
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping, got {raw!r}", key="workload")
    for key in ("response_length", "greedy_response_length"):
        if key in raw:
            raw = dict(raw)
            raw[key] = parse_lengths(raw[key], f"workload.{key}", base_dir)
    return from_mapping(Workload, raw, key_prefix="workload")


def _per_role(data: dict[str, Any], key: str, cls: type, what: str) -> dict[str, Any]:
    """``key`` (``parallel`` or ``backends``): role -> ``cls`` read from its mapping."""
    raw = data.get(key) or {}
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping of role -> {what}, got {raw!r}", key=key)
    return {role: from_mapping(cls, value or {}, key_prefix=f"{key}.{role}")
            for role, value in raw.items()}


def _job_string(data: dict[str, Any], key: str, default: str, expected: str) -> str:
    """The string at ``key`` (``default`` when absent); anything else is ``expected``."""
    value = data.get(key, default)
    if not isinstance(value, str):
        raise SpecError(f"expected {expected}, got {value!r}", key=key)
    return value


def _job_reward_function(raw: Any, base_dir: Path | None) -> RewardFunction | None:
    """``reward_function`` with its path made absolute (so a plan that embeds the job runs
    from anywhere), after checking the file is there; None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping {{path, name}}, got {raw!r}",
                        key="reward_function")
    reward_function = from_mapping(RewardFunction, raw, key_prefix="reward_function")
    path = Path(reward_function.path)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        what = "a directory, expected a Python file" if path.is_dir() else "file not found"
        raise SpecError(f"{what}: {path}", key="reward_function.path")
    return RewardFunction(path=str(path.resolve()), name=reward_function.name)


def checkpoint_path(value: Any, base_dir: Path | None) -> str | None:
    """The absolute directory of a model given as a Hugging Face checkpoint directory or its
    config.json (None for presets, spec files and inline mappings)."""
    from simulator.specs.presets import MODEL_PRESETS

    if not isinstance(value, str) or value in MODEL_PRESETS or value == RULE:
        return None
    path = Path(value)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.is_dir():
        return str(path.resolve())
    if path.suffix == ".json" and path.is_file():
        return str(path.resolve().parent)
    return None


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job YAML (relative model / CSV paths are relative to the file)."""
    path = Path(path)
    return job_from_mapping(read_mapping(path), source=str(path), base_dir=path.parent)


def default_job() -> JobSpec:
    """The HybridFlow paper's setting (§8.1): PPO, four Llama-2-7B models, 2 nodes x 8
    A100-80GB, 1024 prompts, prompt 1024 and response 1024 tokens, one PPO epoch of 8
    mini-batches."""
    from simulator.specs.presets import MODEL_PRESETS

    llama = MODEL_PRESETS["llama2-7b"]
    return JobSpec(
        name="hybridflow-paper-ppo-7b",
        algorithm="ppo",
        models={"actor": llama, "critic": llama, "ref": llama, "reward": llama},
        cluster=ClusterSpec.homogeneous(nodes=2, gpus_per_node=8, device="a100-80gb"),
        workload=Workload(prompts_per_iteration=1024, prompt_length=1024,
                          response_length=parse_lengths(1024, "response_length"),
                          ppo_epochs=1, mini_batches_per_epoch=8),
    )
