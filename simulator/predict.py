"""How long each (role, operation) node of a job takes under a plan, and what it holds in
memory: the predictors the event simulator schedules (Vidur's split between what is simulated
and how long it takes). Pure arithmetic over the cached cost models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from profiles.datafile import SpecError
from profiles.device import DTYPE_BYTES, HOST_PAGE_BYTES, DeviceProfile
from profiles.framework import HostCopy, TrainingSettings
from simulator.costs.generation import (
    ReplicaBatch,
    generate,
    generation_weight_bytes,
    workspace_bytes,
)
from simulator.costs.inference import forward_pass
from simulator.costs.memory import GIB, MemoryBreakdown, does_not_fit_message
from simulator.costs.training import (
    FP32_LOGITS_AND_GRADIENT_BYTES,
    MAIN_GRAD_BYTES,
    optimizer_memory,
    train_step,
)
from simulator.costs.transfer import controller_dispatch_seconds, transfer_seconds
from simulator.costs.transition import Scheme, TransitionCost, compare_schemes
from simulator.costs.weight_sync import WeightSyncCost, weight_sync
from simulator.packing import (
    PackedBatch,
    bin_capacity_tokens,
    pack_stratified_batch,
    token_budget_batch,
)
from simulator.plan import ColocatedSet, Plan, RolePlan, job_as_planned
from simulator.specs.cluster import Pool
from simulator.specs.dataflow import CONTROLLER, RULE_ROLES, Node
from simulator.specs.job import JobSpec
from simulator.specs.lengths import LengthDistribution
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig
from simulator.specs.workload import Workload

VALUE_HEAD_ROLES = ("critic", "reward", "cost")
"""Roles whose model ends in a scalar value head instead of the language-model head."""

CONTROLLER_LOCATION = -1
"""Location index of the single controller (sets are 0..n-1)."""


@dataclass(frozen=True, slots=True)
class NodeEstimate:
    """Predicted cost of one node of one iteration."""

    name: str
    role: str
    operation: str
    location: int
    """Index of the colocated set that runs it, or CONTROLLER_LOCATION."""
    seconds: float
    sequences: float
    tokens: float
    """Tokens processed (prompt + response for every sequence)."""
    transient: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Per-GPU memory the operation needs on top of the set's resident state."""
    detail: dict[str, float] = field(default_factory=dict)
    feasible: bool = True
    reason: str = ""
    offloaded: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Per-GPU resident state of the set that the framework keeps in host memory while this
    node runs (trained models' states around generation)."""


@dataclass(frozen=True, slots=True)
class SetMemory:
    """Per-GPU memory of one colocated set at its peak."""

    index: int
    label: str
    gpus: int
    resident: MemoryBreakdown
    """Weights, gradients and optimizer states of every model in the set."""
    peak: MemoryBreakdown
    """Resident state plus the largest transient need of any of the set's operations."""
    peak_node: str
    available_bytes: float
    device: str = ""
    """The device profile of the set's node group."""

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.available_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.available_bytes - self.peak.total

    def message(self) -> str:
        return does_not_fit_message(f"set {self.index} ({self.label}) on {self.gpus} GPUs "
                                    f"during {self.peak_node}", self.peak, self.available_bytes)


@dataclass(frozen=True, slots=True)
class PlanEstimate:
    """Everything the simulator needs about one plan of one job."""

    nodes: dict[str, NodeEstimate]
    transition: TransitionCost | None
    """The actor's train -> generate transition under the chosen scheme."""
    transition_schemes: dict[str, TransitionCost]
    """All three schemes, for comparison."""
    transfers: dict[tuple[str, str], float]
    """Seconds from a producer's end to its consumer's start along each dataflow edge (the
    controller's call overhead and the batch's way through the controller)."""
    memory: tuple[SetMemory, ...]
    tokens_per_iteration: float
    reasons: tuple[str, ...]
    """Why the plan is infeasible (empty when it is feasible)."""
    weight_sync: WeightSyncCost | None = None
    """Asynchronous plans: one sync of the actor's weights from the trainer to the rollout
    set (after every update)."""

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def peak_memory_bytes_per_gpu(self) -> float:
        return max((m.peak.total for m in self.memory), default=0.0)


def node_sequences(job: JobSpec, node: Node) -> float:
    """Sequences a node processes per iteration: generation and scoring (reward, cost) see
    every generated prompt, the passes after dynamic sampling's filter only the trained
    ones."""
    work = job.workload
    scores = node.operation == "generate" or node.role in RULE_ROLES
    prompts = work.generated_prompts if scores else work.prompts_per_iteration
    if node.operation == "generate" and node.responses == "greedy":
        return float(prompts)
    return prompts * work.samples_per_prompt * node.sequences_per_response


def generation_lengths(job: JobSpec, node: Node, replicas: int) -> ReplicaBatch:
    """Responses of the replica holding the longest response, for a generate node (greedy
    nodes use ``greedy_response_length`` when the workload gives one). A ReplicaBatch: the list
    of lengths up to EXACT_SEQUENCES responses, a description the cost models price without
    listing it above (use its ``sequences``, ``longest`` and ``mean_tokens``)."""
    work = job.workload
    distribution = work.response_length
    if node.responses == "greedy" and work.greedy_response_length is not None:
        distribution = work.greedy_response_length
    return ReplicaBatch(distribution, int(node_sequences(job, node)), replicas)


def grad_bytes_per_param(job: JobSpec, par: ParallelConfig) -> int:
    """Bytes per element of a trained role's gradient buffer: fp32 main gradients, or the
    training dtype for a Megatron-style layout of a framework that reduces in it."""
    if par.sharding == "fsdp" or job.framework_profile.training.grad_reduce_in_fp32:
        return MAIN_GRAD_BYTES
    return DTYPE_BYTES[job.workload.dtype]


def full_role_state(job: JobSpec, role: str, par: ParallelConfig) -> MemoryBreakdown:
    """A role's per-GPU state (weights; for trained roles also gradients and Adam states),
    wherever it lives between calls."""
    return optimizer_memory(job.model(role), par, value_head=role in VALUE_HEAD_ROLES,
                            trainable=role in job.dataflow.trained_roles,
                            dtype=job.workload.dtype, grad_bytes=grad_bytes_per_param(job, par))


def between_calls_on_host(job: JobSpec, role: str, par: ParallelConfig) -> MemoryBreakdown:
    """The states the layout keeps in host memory between the role's calls (its
    ``offload_params`` / ``offload_optimizer``), per GPU."""
    if not (par.offload_params or par.offload_optimizer):
        return MemoryBreakdown()
    state = full_role_state(job, role, par)
    return MemoryBreakdown(params=state.params if par.offload_params else 0.0,
                           optimizer=state.optimizer if par.offload_optimizer else 0.0)


def call_offload_seconds(job: JobSpec, role: str, par: ParallelConfig,
                         operation: str) -> tuple[MemoryBreakdown, float]:
    """What one call of ``operation`` brings from host memory (the states it needs that the
    layout keeps there between calls) and the seconds of copying them in and back out: the
    parameters for any call (a generation's weight sync included), the optimizer states for
    an update. verl's offload_fsdp_model_to_cpu / load_fsdp_model_to_gpu and
    offload_fsdp_optimizer copy with ``.to(device, non_blocking=True)`` (verl 0.9.1
    verl/utils/fsdp_utils.py:169-261); the framework's ``params_to`` / ``optimizer_to`` say
    how (see HostCopy)."""
    kept = between_calls_on_host(job, role, par)
    needed = MemoryBreakdown(params=kept.params,
                             optimizer=kept.optimizer if operation == "train" else 0.0)
    if needed.total <= 0:
        return MemoryBreakdown(), 0.0
    offload = job.framework_profile.offload
    profile = job.cluster.profile()
    seconds = 0.0
    for nbytes, how, what in ((needed.params, offload.params_to, "parameters"),
                              (needed.optimizer, offload.optimizer_to, "optimizer states")):
        out, back = host_copy_seconds(profile, how if how != "freed" else "pinned_buffer",
                                      nbytes, what)
        seconds += out + back
    return needed, seconds


def role_state(job: JobSpec, role: str, par: ParallelConfig) -> tuple[MemoryBreakdown, float]:
    """A role's resident per-GPU state (weights; for trained roles also gradients and Adam
    states, less what its layout keeps in host memory between calls) and the gradient bytes
    that exist only while it trains (FSDP frees its gradients after the optimizer step;
    Megatron keeps its contiguous gradient buffer). A reference the framework keeps in host
    memory holds nothing on the GPU."""
    if role == "ref" and job.reference_on_host:
        return MemoryBreakdown(), 0.0
    state = full_role_state(job, role, par) - between_calls_on_host(job, role, par)
    if par.sharding == "fsdp":
        return replace(state, grads=0.0), state.grads
    return state, 0.0


def host_copy_seconds(profile: DeviceProfile, how: HostCopy, nbytes: float,
                      what: str) -> tuple[float, float]:
    """Seconds to park ``nbytes`` per GPU in host memory the way ``how`` says, and to bring them
    back: (out, back)."""
    if how == "freed" or nbytes <= 0:
        return 0.0, 0.0
    link = profile.host_link
    if link is None:
        raise SpecError(f"the framework moves {what} to host memory, but device profile "
                        f"{profile.name} has no host_link (copy rates to host memory)",
                        key="host_link")
    if how == "pinned_buffer":
        return nbytes / link.pinned_bytes_per_s, nbytes / link.pinned_bytes_per_s
    # new_pageable: every page of the new host memory is mapped on first touch.
    faults = nbytes / HOST_PAGE_BYTES * link.page_fault_seconds
    return nbytes / link.pageable_bytes_per_s + faults, nbytes / link.pageable_bytes_per_s


def offload_copy_seconds(job: JobSpec, role: str,
                         par: ParallelConfig) -> tuple[MemoryBreakdown, float, float]:
    """What the framework moves to host memory of a trained ``role`` while the rollout engine
    runs on its GPUs, per GPU, and the seconds of moving it out and of bringing it back
    (nothing when the actor generates elsewhere)."""
    offload = job.framework_profile.offload
    if job.generation_elsewhere:
        return MemoryBreakdown(), 0.0, 0.0
    # The actor's own parameters kept in host memory come in for the weight sync and go back.
    _, sync_copies = call_offload_seconds(job, role, par, "generate") \
        if "generate" in job.dataflow.operations_of(role) else (None, 0.0)
    if not offload.any or role not in job.dataflow.trained_roles:
        return MemoryBreakdown(), sync_copies / 2, sync_copies / 2
    state, _ = role_state(job, role, par)
    moved = MemoryBreakdown(params=state.params if offload.params else 0.0,
                            grads=state.grads if offload.grads else 0.0,
                            optimizer=state.optimizer if offload.optimizer else 0.0)
    profile = job.cluster.profile()
    out = back = 0.0
    for nbytes, how, what in ((moved.params, offload.params_to, "parameters"),
                              (moved.grads, offload.grads_to, "gradients"),
                              (moved.optimizer, offload.optimizer_to, "optimizer states")):
        one_out, one_back = host_copy_seconds(profile, how, nbytes, what)
        out += one_out
        back += one_back
    return moved, out + sync_copies / 2, back + sync_copies / 2


def offload_state(job: JobSpec, role: str, par: ParallelConfig) -> tuple[MemoryBreakdown, float]:
    """What the framework moves to host memory of a trained ``role`` while the rollout engine
    runs on its GPUs, per GPU, and the seconds of moving it out and back."""
    moved, out, back = offload_copy_seconds(job, role, par)
    return moved, out + back


def reference_swap_seconds(job: JobSpec, par: ParallelConfig) -> float:
    """The reference pass of a framework that keeps the reference in host memory: the actor's
    weights are copied to host, the reference's copied in, and the actor's copied back, all
    through pinned host memory (``tensor.to("cpu", non_blocking=True)`` allocates a pinned
    destination, which PyTorch's caching host allocator reuses from one iteration to the
    next). Three copies of the per-GPU weights over the host link."""
    profile = job.cluster.profile()
    model = job.model("ref")
    weights = optimizer_memory(model, par, value_head=False, trainable=False,
                               dtype=job.workload.dtype).params
    link = profile.host_link
    if link is None:
        raise SpecError(f"the framework swaps the reference model in from host memory, but "
                        f"device profile {profile.name} has no host_link", key="host_link")
    return 3 * weights / link.pinned_bytes_per_s


def extra_generation_weights(job: JobSpec, engine_weights: float,
                             training_params: float) -> float:
    """Per-GPU weight bytes generation adds to the GPU: with the 3D-HybridEngine only what
    the training shard lacks; a separate engine (vLLM) its whole copy; and the whole copy
    too when the framework offloaded the training parameters."""
    framework = job.framework_profile
    if job.rollout.weights_alias_training and not framework.offload.params:
        return max(0.0, engine_weights - training_params)
    return engine_weights


def kv_budget_bytes(job: JobSpec, gen: GenerationConfig, *, engine_weights: float,
                    workspace: float, resident_during: float, extra_weights: float) -> float:
    """Per-GPU bytes left for the KV cache: the engine's own limit (gpu_memory_utilization of
    the device, minus its weights and workspace; vLLM applies it per instance) and what the
    GPU has left beside the set's resident state, whichever is smaller."""
    profile = job.cluster.profile()
    engine = gen.memory_utilization * profile.memory_bytes - engine_weights - (
        workspace if job.rollout.workspace_in_memory_fraction else 0.0)
    device = profile.usable_memory_bytes - resident_during - extra_weights - workspace
    return min(engine, device)


def frees_cache(job: JobSpec, gen: GenerationConfig) -> bool:
    """Whether the colocated engine frees its KV cache between generations: the plan's
    choice, else the framework's default."""
    if gen.free_cache is not None:
        return gen.free_cache
    return job.rollout.free_kv_cache


def held_engine_bytes(job: JobSpec, gen: GenerationConfig, *, extra_weights: float,
                      kv_budget_bytes: float, workspace: float) -> float:
    """Per-GPU bytes a colocated engine that keeps its cache holds while the set's other
    operations run: its own weights, the KV cache it allocated up front (vLLM takes its
    whole budget at start-up) and its workspace; 0 for an engine that frees them."""
    if frees_cache(job, gen):
        return 0.0
    return extra_weights + max(0.0, kv_budget_bytes) + workspace


def generation_sleep_wake_seconds(job: JobSpec, model: ModelSpec,
                                  gen: GenerationConfig, *,
                                  dedicated: bool = False) -> tuple[float, float]:
    """Per generation call, (sleep, wake): the rollout engine's sleep after generating and wake
    before it when the framework frees the KV cache between iterations, with the copy of its
    weights to host and back at sleep level 1. A ``dedicated`` rollout set (asynchronous
    modes) shares its GPUs with no training and never sleeps."""
    rollout = job.rollout
    if not frees_cache(job, gen) or dedicated:
        return 0.0, 0.0
    sleep, wake = rollout.sleep_seconds, rollout.wake_seconds
    weights = generation_weight_bytes(model, gen, job.workload.dtype)
    if rollout.weight_backup_bytes_per_s > 0:
        sleep += weights / rollout.weight_backup_bytes_per_s
    if rollout.weight_restore_bytes_per_s > 0:
        wake += weights / rollout.weight_restore_bytes_per_s
    if rollout.weight_backup_on_host_link:
        link = job.cluster.profile().host_link
        if link is None:
            raise SpecError(f"the {job.rollout_engine} engine backs its weights up to host "
                            f"memory, but device profile {job.cluster.profile().name} has no "
                            "host_link", key="host_link")
        sleep += weights / link.pinned_bytes_per_s
        wake += weights / link.pinned_bytes_per_s
    return sleep, wake


def generation_fixed_seconds(job: JobSpec, model: ModelSpec, gen: GenerationConfig) -> float:
    """Per generation call: the host's fixed work per operation, and the rollout engine's sleep
    and wake (``generation_sleep_wake_seconds``)."""
    sleep, wake = generation_sleep_wake_seconds(job, model, gen)
    return job.cluster.profile().overheads.operation_seconds + sleep + wake


def controller_node(job: JobSpec, node: Node) -> NodeEstimate:
    """Work on the single controller: advantages, or a rule standing in for a model."""
    work = job.workload
    sequences = node_sequences(job, node)
    per_sample = (work.controller_seconds_per_sample if node.role == CONTROLLER
                  else work.rule_reward_seconds_per_sample)
    seconds = sequences * per_sample
    if node.name == next((n.name for n in job.dataflow.nodes if n.role == CONTROLLER), None):
        seconds += job.framework_profile.fixed_costs.iteration_seconds
    return NodeEstimate(name=node.name, role=node.role, operation=node.operation,
                        location=CONTROLLER_LOCATION, seconds=seconds,
                        sequences=sequences, tokens=sequences * work.mean_sequence_tokens())


def host_slowdown(job: JobSpec, set_gpus: int) -> float:
    """Factor on the operations of a set of ``set_gpus`` worker processes: CPU profiles run
    processes of a multi-process set on shared cores (``shared_host_slowdown``)."""
    profile = job.cluster.profile()
    if profile.kind != "cpu" or set_gpus <= 1:
        return 1.0
    return profile.overheads.shared_host_slowdown


def model_node(job: JobSpec, node: Node, role_plan: RolePlan, *, location: int,
               set_resident_bytes: float = 0.0, resident: MemoryBreakdown | None = None,
               freed_grads: float = 0.0, set_offload: MemoryBreakdown | None = None,
               set_offload_seconds: float = 0.0,
               set_offload_out_seconds: float = 0.0, dedicated: bool = False,
               stream: bool = False) -> NodeEstimate:
    """Predict one node of a model role laid out as ``role_plan``.

    ``dedicated``: the node generates on a rollout set of its own (no sleep and wake, no
    training state beside it). ``stream``: responses stream through the engine without
    draining (asynchronous mode with partial rollouts: a weight sync interrupts the responses
    in flight and they resume after it), so the running batch stays full and a batch costs
    what responses of the mean length cost; otherwise the batch's longest responses finish
    alone at the end (the tail).

    Generation needs the colocated set's resident bytes per GPU (``set_resident_bytes``, all
    roles of the set) and the role's own resident state, because the KV cache gets what is left;
    ``set_offload`` is what the framework moves to host memory meanwhile (and
    ``set_offload_seconds`` what moving it out and back costs, charged to the first
    generation of the iteration).
    """
    sequences = node_sequences(job, node)
    tokens = sequences * job.workload.mean_sequence_tokens()
    if node.operation == "generate" and job.generation_elsewhere:
        return NodeEstimate(name=node.name, role=node.role, operation="generate",
                            location=location, seconds=0.0, sequences=sequences, tokens=tokens)
    if node.operation == "generate":
        return _generate_node(job, node, role_plan, location=location,
                              set_resident_bytes=set_resident_bytes, resident=resident,
                              set_offload=set_offload, set_offload_seconds=set_offload_seconds,
                              set_offload_out_seconds=set_offload_out_seconds,
                              dedicated=dedicated, stream=stream)
    if node.operation == "infer":
        return _infer_node(job, node, role_plan, location=location)
    return _train_node(job, node, role_plan, location=location, freed_grads=freed_grads)


def _generate_node(job: JobSpec, node: Node, role_plan: RolePlan, *, location: int,
                   set_resident_bytes: float, resident: MemoryBreakdown | None,
                   set_offload: MemoryBreakdown | None, set_offload_seconds: float,
                   set_offload_out_seconds: float, dedicated: bool,
                   stream: bool) -> NodeEstimate:
    """``model_node`` of a generate node: the engine's decode under the KV cache the set's
    memory leaves, and its sleep / wake cycle."""
    profile = job.cluster.profile()
    work = job.workload
    dtype = work.dtype
    sequences = node_sequences(job, node)
    tokens = sequences * work.mean_sequence_tokens()
    role = node.role
    model = job.model(role)
    par = role_plan.parallel
    gen = role_plan.generation
    if gen is None:
        raise SpecError("the actor needs a generation config", key=f"roles.{role}")
    own = resident if resident is not None else role_state(job, role, par)[0]
    offloaded = set_offload or MemoryBreakdown()
    first = node.name == first_generate_node(job)
    if not first:
        set_offload_seconds = 0.0
    replicas = gen.replicas(par)
    lengths = generation_lengths(job, node, replicas)
    if stream:
        lengths = ReplicaBatch(
            LengthDistribution.fixed(max(1, round(lengths.distribution.mean_tokens()))),
            lengths.total_sequences, replicas)
    engine_weights = generation_weight_bytes(model, gen, dtype)
    extra_weights = extra_generation_weights(job, engine_weights, own.params)
    workspace = workspace_bytes(model, gen, dtype)
    budget = kv_budget_bytes(job, gen, engine_weights=engine_weights, workspace=workspace,
                             resident_during=set_resident_bytes - offloaded.total,
                             extra_weights=extra_weights)
    rollout = job.rollout
    cost = generate(model, profile, gen, lengths=lengths, prompt_len=work.prompt_length,
                    kv_budget_bytes=budget, dtype=dtype, gpus_per_node=job.cluster.gpus_per_node,
                    cuda_graphs=rollout.cuda_graphs,
                    host_seconds_per_sequence=rollout.decode_host_seconds_per_sequence)
    sleep, wake = generation_sleep_wake_seconds(job, model, gen, dedicated=dedicated)
    cycle = profile.overheads.operation_seconds + sleep + wake
    slowdown = host_slowdown(job, par.world_size)
    return NodeEstimate(
        name=node.name, role=role, operation="generate", location=location,
        seconds=(cost.seconds + cycle) * slowdown + set_offload_seconds,
        sequences=sequences,
        tokens=tokens,
        transient=MemoryBreakdown(params=extra_weights, kv_cache=cost.memory.kv_cache,
                                  activations=cost.memory.activations),
        detail={"prefill_seconds": cost.prefill_seconds,
                "decode_seconds": cost.decode_seconds,
                "fixed_seconds": cycle,
                "sleep_seconds": sleep,
                "wake_seconds": wake,
                "offload_seconds": set_offload_seconds,
                "offload_out_seconds": set_offload_out_seconds if first else 0.0,
                "decode_steps": float(cost.decode_steps),
                "max_running": float(cost.max_running),
                "kv_capacity_tokens": cost.kv_capacity_tokens,
                "kv_budget_bytes": budget,
                "held_engine_bytes": held_engine_bytes(
                    job, gen, extra_weights=extra_weights, kv_budget_bytes=budget,
                    workspace=workspace),
                "replicas": float(replicas),
                "generated_tokens_per_replica": float(cost.generated_tokens)},
        feasible=cost.feasible, reason=cost.reason, offloaded=offloaded)


@dataclass(frozen=True, slots=True)
class _ModelPass:
    """What a forward or training pass of one node needs to know about its job and layout."""

    profile: DeviceProfile
    gpus_per_node: int
    work: Workload
    sequences: float
    """Sequences the node processes (``node_sequences``)."""
    role: str
    model: ModelSpec
    par: ParallelConfig
    value_head: bool
    training: TrainingSettings

    @classmethod
    def of(cls, job: JobSpec, node: Node, role_plan: RolePlan) -> _ModelPass:
        return cls(profile=job.cluster.profile(), gpus_per_node=job.cluster.gpus_per_node,
                   work=job.workload, sequences=node_sequences(job, node), role=node.role,
                   model=job.model(node.role), par=role_plan.parallel,
                   value_head=node.role in VALUE_HEAD_ROLES,
                   training=job.framework_profile.training)

    @property
    def dtype(self) -> str:
        return self.work.dtype

    @property
    def mean_tokens(self) -> float:
        return self.work.mean_sequence_tokens()

    @property
    def max_tokens(self) -> float:
        return float(self.work.max_sequence_tokens)

    @property
    def tokens(self) -> float:
        return self.sequences * self.mean_tokens


def _infer_node(job: JobSpec, node: Node, role_plan: RolePlan, *,
                location: int) -> NodeEstimate:
    """``model_node`` of a forward-only pass (log-probs, values, scores)."""
    run = _ModelPass.of(job, node, role_plan)
    packed = packed_batch(job, run.par, sequences=math.ceil(run.sequences),
                          micro_batch_size=run.work.infer_micro_batch_size,
                          budget_tokens=run.par.infer_micro_batch_tokens)
    logits_bytes = forward_logits_bytes(run.training, role_plan, entropy=run.role == "actor")
    cost = forward_pass(run.model, run.profile, run.par, sequences=math.ceil(run.sequences),
                        seq_len=run.mean_tokens, micro_batch=run.work.infer_micro_batch_size,
                        dtype=run.dtype, value_head=run.value_head,
                        gpus_per_node=run.gpus_per_node, packed=packed,
                        logprob_bytes=run.training.logprob_forward_bytes_per_vocab_entry,
                        logits_bytes_per_entry=logits_bytes,
                        cp_exchange=run.training.context_parallel_exchange)
    activations = cost.activations_bytes
    if run.max_tokens != run.mean_tokens or packed is not None:
        activations = forward_pass(
            run.model, run.profile, run.par, sequences=math.ceil(run.sequences),
            seq_len=run.max_tokens, micro_batch=run.work.infer_micro_batch_size,
            dtype=run.dtype, value_head=run.value_head, gpus_per_node=run.gpus_per_node,
            packed=full_bin(packed),
            logits_bytes_per_entry=logits_bytes).activations_bytes
    fixed = (job.framework_profile.fixed_costs.micro_batch_seconds * cost.micro_batches
             + run.profile.overheads.operation_seconds)
    swap = reference_swap_seconds(job, run.par) if (
        run.role == "ref" and job.reference_on_host) else 0.0
    loaded, copies = call_offload_seconds(job, run.role, run.par, "infer")
    dispatch = dispatch_seconds(job, node, run.par, run.sequences)
    # A swapped-in reference takes the place of the actor's weights (which wait in host
    # memory): the set's resident state already counts one set of weights.
    return NodeEstimate(
        name=node.name, role=run.role, operation="infer", location=location,
        seconds=(cost.seconds + fixed) * host_slowdown(job, run.par.world_size) + swap
        + dispatch + copies,
        sequences=run.sequences, tokens=run.tokens,
        transient=MemoryBreakdown(activations=activations) + loaded,
        detail={"micro_batches": float(cost.micro_batches), "compute_seconds": cost.seconds,
                "swap_seconds": swap, "dispatch_seconds": dispatch,
                "offload_copy_seconds": copies})


def _train_node(job: JobSpec, node: Node, role_plan: RolePlan, *, location: int,
                freed_grads: float) -> NodeEstimate:
    """``model_node`` of an update: every optimizer step of the node's epochs and
    mini-batches."""
    run = _ModelPass.of(job, node, role_plan)
    steps = run.work.ppo_epochs * run.work.mini_batches_per_epoch
    batch = math.ceil(run.sequences / run.work.mini_batches_per_epoch)
    if node.pretrain_loss:
        batch *= 2  # as many pretraining (ptx) sequences as RL sequences
    grad_bytes = grad_bytes_per_param(job, run.par)
    packed = packed_batch(job, run.par, sequences=batch,
                          micro_batch_size=run.par.micro_batch_size,
                          budget_tokens=run.par.micro_batch_tokens)
    logits_bytes = training_logits_bytes(run.training, role_plan)
    step = train_step(run.model, run.profile, run.par, global_batch=batch,
                      seq_len=run.mean_tokens, dtype=run.dtype, value_head=run.value_head,
                      gpus_per_node=run.gpus_per_node, grad_bytes=grad_bytes, packed=packed,
                      logprob_bytes=loss_bytes_per_vocab_entry(run.training, packed),
                      logits_bytes_per_entry=logits_bytes,
                      cp_exchange=run.training.context_parallel_exchange)
    activations = step.memory.activations
    if run.max_tokens != run.mean_tokens or packed is not None:
        activations = train_step(
            run.model, run.profile, run.par, global_batch=batch, seq_len=run.max_tokens,
            dtype=run.dtype, value_head=run.value_head, gpus_per_node=run.gpus_per_node,
            grad_bytes=grad_bytes, packed=full_bin(packed),
            logits_bytes_per_entry=logits_bytes).memory.activations
    fixed_costs = job.framework_profile.fixed_costs
    step_seconds = (step.seconds + fixed_costs.optimizer_step_seconds
                    + fixed_costs.micro_batch_seconds * step.micro_batches)
    detail = {f"{k}_seconds": steps * v for k, v in step.breakdown.items()}
    detail["optimizer_steps"] = float(steps)
    detail["seconds_per_step"] = step_seconds
    dispatch = dispatch_seconds(job, node, run.par, run.sequences)
    detail["dispatch_seconds"] = dispatch
    loaded, copies = call_offload_seconds(job, run.role, run.par, "train")
    detail["offload_copy_seconds"] = copies
    return NodeEstimate(
        name=node.name, role=run.role, operation="train", location=location,
        seconds=(steps * step_seconds + run.profile.overheads.operation_seconds)
        * host_slowdown(job, run.par.world_size) + dispatch + copies,
        sequences=run.sequences * run.work.ppo_epochs,
        tokens=run.tokens * run.work.ppo_epochs,
        transient=MemoryBreakdown(grads=freed_grads, activations=activations) + loaded,
        detail=detail)


def dispatch_seconds(job: JobSpec, node: Node, par: ParallelConfig, sequences: float) -> float:
    """The driver's serialization of one model call's batch and results (the framework's
    ``controller`` settings), the batch padded to its longest sequence: the prompt plus the
    longest response of a stratified batch of ``sequences``. (Most frameworks do not price it:
    the search's hot path then skips the padded length.)"""
    controller = job.framework_profile.controller
    if not controller.priced:
        return 0.0
    work = job.workload
    count = max(1, math.ceil(sequences))
    padded_tokens = work.prompt_length + work.response_length.length_at(count - 1, count)
    return controller_dispatch_seconds(
        controller, operation=node.operation, sequences=sequences,
        padded_tokens=padded_tokens, data_parallel=par.data_shards,
        workers_per_shard=par.model_parallel_size)


def shard_budget_tokens(per_gpu_tokens: int, par: ParallelConfig,
                        training: TrainingSettings) -> int:
    """The tokens a data shard's micro-batch may hold under a per-GPU budget: verl multiplies
    it by the ranks that split each sequence, Ulysses sp or context-parallel cp (verl 0.9.1
    verl/workers/engine/utils.py:104-111); OpenRLHF by ring_attn_size x tensor_parallel_size
    (OpenRLHF 0.11.2 openrlhf/utils/seqlen_balancing.py:234-237)."""
    ranks = par.ulysses * par.cp * (par.tp if training.token_budget_per_tensor_rank else 1)
    return per_gpu_tokens * ranks


def packed_batch(job: JobSpec, par: ParallelConfig, *, sequences: int,
                 micro_batch_size: int, budget_tokens: int = 0) -> PackedBatch | None:
    """The busiest data-parallel rank's micro-batches when the layout sets a token budget
    (``budget_tokens``: verl's dynamic batch size) or the framework packs sequences
    (``sequence_packing``: the batch's stratified prompt + response lengths packed into bins
    of the longest sequence x ``micro_batch_size`` tokens); None when neither."""
    work = job.workload
    if budget_tokens:
        return token_budget_batch(sequences, work.mean_sequence_tokens(),
                                  work.max_sequence_tokens,
                                  budget_tokens=shard_budget_tokens(
                                      budget_tokens, par, job.framework_profile.training),
                                  data_parallel=par.data_shards)
    if not job.framework_profile.training.sequence_packing:
        return None
    return pack_stratified_batch(
        work.response_length, sequences, work.prompt_length,
        capacity_tokens=bin_capacity_tokens(work.max_sequence_tokens, micro_batch_size),
        data_parallel=par.data_shards, pad_to_longest_bin=par.pp > 1)


def loss_bytes_per_vocab_entry(training: TrainingSettings,
                               packed: PackedBatch | None) -> tuple[float, float]:
    """(forward, backward) memory traffic of the training loss's log-probs per token and
    vocabulary entry: the framework's, plus in the backward the per-sequence logit slices of a
    packed bin when its loss runs sequence by sequence."""
    backward = training.logprob_backward_bytes_per_vocab_entry
    if packed is not None and training.loss_per_packed_sequence:
        backward += 16 * packed.sequences_per_micro_batch - 4
    return training.logprob_forward_bytes_per_vocab_entry, backward


def training_logits_bytes(training: TrainingSettings, role_plan: RolePlan) -> float:
    """Bytes a trained model's loss holds per token and vocabulary entry: the framework's
    figure for its FSDP (torch-family) engine, fp32 logits and gradient under Megatron."""
    if role_plan.training_backend == "torch":
        return training.fsdp_logits_bytes_per_vocab_entry
    return FP32_LOGITS_AND_GRADIENT_BYTES


def forward_logits_bytes(training: TrainingSettings, role_plan: RolePlan, *,
                         entropy: bool) -> float:
    """The same in a forward-only log-prob pass; ``entropy``: the pass also computes the
    policy's entropy (the actor's recompute of the old log-probs)."""
    if role_plan.training_backend != "torch":
        return FP32_LOGITS_AND_GRADIENT_BYTES
    return training.fsdp_forward_logits_bytes_per_vocab_entry + (
        training.fsdp_entropy_bytes_per_vocab_entry if entropy else 0.0)


def full_bin(packed: PackedBatch | None) -> PackedBatch | None:
    """The largest micro-batch a packed run meets, for its memory: its fullest bin (as one
    sequence: attention memory does not grow with it under flash attention)."""
    if packed is None:
        return None
    return replace(packed, sequences_per_micro_batch=1.0,
                   tokens_per_sequence=float(packed.largest_bin_tokens))


def edge_seconds(job: JobSpec, producer: Node, producer_location: int,
                 consumer_location: int, set_pools: tuple[Pool, ...] | None = None) -> float:
    """Seconds between a producer ending and its consumer starting: the controller collects
    the result and dispatches the next call (``call_seconds``), and the batch crosses the
    controller's link on each leg between a worker and the controller. ``set_pools`` gives
    each set's pool on a mixed cluster: a batch between sets on different pools crosses the
    link between them (``ClusterSpec.link_between``) on both legs."""
    legs = (producer_location != CONTROLLER_LOCATION) + (consumer_location != CONTROLLER_LOCATION)
    profile = link_profile(job, producer_location, consumer_location, set_pools)
    call = profile.overheads.call_seconds + job.framework_profile.fixed_costs.call_seconds
    return call + transfer_seconds(
        profile, sequences=node_sequences(job, producer),
        tokens_per_sequence=job.workload.mean_sequence_tokens(), operation=producer.operation,
        legs=legs)


def link_profile(job: JobSpec, location_a: int, location_b: int,
                 set_pools: tuple[Pool, ...] | None) -> DeviceProfile:
    """The device profile whose links carry a batch between two locations (sets or the
    controller): the cluster's on one group, else the link between the sets' pools."""
    if set_pools is None or job.cluster.is_homogeneous:
        return job.cluster.profile()
    pools = [set_pools[loc] for loc in (location_a, location_b) if loc != CONTROLLER_LOCATION]
    if not pools:
        return set_pools[0].group.profile()
    return job.cluster.link_between(pools[0], pools[-1])


def first_generate_node(job: JobSpec) -> str:
    return next(n.name for n in job.dataflow.nodes
                if n.role == "actor" and n.operation == "generate")


def transition_scheme_of(job: JobSpec, actor: RolePlan) -> Scheme:
    """The resharding scheme the job's framework uses for the actor's training layout."""
    return job.framework_profile.transition_scheme(actor.parallel.sharding)


@dataclass(slots=True)
class _SetStates:
    """Per role and per set of one plan: the states it holds and moves (``estimate_plan``)."""

    resident: dict[str, MemoryBreakdown]
    freed_grads: dict[str, float]
    set_resident: list[MemoryBreakdown]
    set_offload: list[MemoryBreakdown]
    set_offload_seconds: list[float]
    set_offload_out_seconds: list[float]


def estimate_plan(job: JobSpec, plan: Plan, *,
                  transition_scheme: Scheme | None = None) -> PlanEstimate:
    """Predict every node of ``job``'s dataflow under ``plan`` (one iteration).
    ``transition_scheme`` overrides the framework's resharding scheme (to compare). On a
    mixed cluster each set is priced on its own group's device and network. An asynchronous
    plan generates on its rollout set (the location after the training sets), and its
    trainer's GPUs neither reshard the actor nor hold a generation engine."""
    if job_as_planned(job, plan) is not job:
        raise ValueError(f"a {plan.mode} plan is priced with the job in its mode: pass "
                         "job_as_planned(job, plan)")
    located = plan.located_sets()
    set_pools = tuple(job.cluster.pool_of(s.node_group) for s in located)
    views = [job.on_pool(pool) for pool in set_pools]
    rollout_location = len(plan.sets) if plan.rollout is not None else None
    view_of = {r: views[i] for i, s in enumerate(plan.sets) for r in s.roles}
    reasons: list[str] = []
    states = _set_states(job, plan, view_of, asynchronous=rollout_location is not None)
    nodes = _node_estimates(job, plan, located, views, states, rollout_location, reasons)
    memory = _set_memories(located, views, nodes, states.set_resident, reasons)
    chosen, schemes, sync = _actor_transition(job, plan, view_of, rollout_location,
                                              transition_scheme)
    return PlanEstimate(nodes=nodes, transition=chosen, transition_schemes=schemes,
                        transfers=_transfers(job, nodes, set_pools), memory=memory,
                        tokens_per_iteration=job.workload.tokens_per_iteration(),
                        reasons=tuple(reasons), weight_sync=sync)


def _set_states(job: JobSpec, plan: Plan, view_of: dict[str, JobSpec], *,
                asynchronous: bool) -> _SetStates:
    """Each model's resident state and each set's sums, with what the framework offloads
    around a colocated generation (nothing on an asynchronous plan's trainer)."""
    resident: dict[str, MemoryBreakdown] = {}
    freed_grads: dict[str, float] = {}
    for role in job.gpu_roles:
        resident[role], freed_grads[role] = role_state(job, role, plan.roles[role].parallel)
    offloads = {r: offload_state(view_of[r], r, plan.roles[r].parallel)
                if not asynchronous else (MemoryBreakdown(), 0.0) for r in job.gpu_roles}
    return _SetStates(
        resident=resident, freed_grads=freed_grads,
        set_resident=[sum((resident[r] for r in s.roles), MemoryBreakdown())
                      for s in plan.sets],
        set_offload=[sum((offloads[r][0] for r in s.roles), MemoryBreakdown())
                     for s in plan.sets],
        set_offload_seconds=[sum(offloads[r][1] for r in s.roles) for s in plan.sets],
        set_offload_out_seconds=[
            sum(offload_copy_seconds(view_of[r], r, plan.roles[r].parallel)[1]
                for r in s.roles) if not asynchronous else 0.0
            for s in plan.sets])


def _node_estimates(job: JobSpec, plan: Plan, located: tuple[ColocatedSet, ...],
                    views: list[JobSpec], states: _SetStates, rollout_location: int | None,
                    reasons: list[str]) -> dict[str, NodeEstimate]:
    """Every node's estimate in dataflow order; why one does not fit goes to ``reasons``."""
    nodes: dict[str, NodeEstimate] = {}
    for node in job.dataflow.nodes:
        if node.role == CONTROLLER or node.role in job.rule_roles:
            nodes[node.name] = controller_node(job, node)
            continue
        if rollout_location is not None and node.operation == "generate":
            estimate = rollout_node(views[rollout_location], node, plan,
                                    location=rollout_location)
            if not estimate.feasible:
                reasons.append(f"{node.name}: {estimate.reason} (the rollout set of "
                               f"{located[rollout_location].gpus} GPUs)")
            nodes[node.name] = estimate
            continue
        location = plan.set_index(node.role)
        estimate = model_node(views[location], node, plan.roles[node.role], location=location,
                              set_resident_bytes=states.set_resident[location].total,
                              resident=states.resident[node.role],
                              freed_grads=states.freed_grads[node.role],
                              set_offload=states.set_offload[location],
                              set_offload_seconds=states.set_offload_seconds[location],
                              set_offload_out_seconds=states.set_offload_out_seconds[location])
        if not estimate.feasible:
            s = plan.sets[location]
            reasons.append(f"{node.name}: {estimate.reason} (set {location}: {s.label()} on "
                           f"{s.gpus} GPUs holds {states.set_resident[location].total / GIB:.1f} "
                           "GiB of model state)")
        nodes[node.name] = estimate
    return nodes


def _set_memories(located: tuple[ColocatedSet, ...], views: list[JobSpec],
                  nodes: dict[str, NodeEstimate], set_resident: list[MemoryBreakdown],
                  reasons: list[str]) -> tuple[SetMemory, ...]:
    """Each set's memory: resident state + the largest transient need (a rollout set holds no
    training state); a set that does not fit adds its message to ``reasons``."""
    memory: list[SetMemory] = []
    resident = set_resident + [MemoryBreakdown() for _ in located[len(set_resident):]]
    for i, s in enumerate(located):
        # A colocated engine that keeps its cache holds it through the set's other operations.
        held = max((n.detail.get("held_engine_bytes", 0.0) for n in nodes.values()
                    if n.location == i and n.operation == "generate"), default=0.0)

        def need(n: NodeEstimate, held: float = held) -> MemoryBreakdown:
            engine = MemoryBreakdown(kv_cache=held) if n.operation != "generate" \
                else MemoryBreakdown()
            return n.transient - n.offloaded + engine

        worst = max((n for n in nodes.values() if n.location == i),
                    key=lambda n: need(n).total, default=None)
        peak = resident[i] + (need(worst) if worst else MemoryBreakdown())
        sm = SetMemory(index=i, label=s.label(), gpus=s.gpus, resident=resident[i],
                       peak=peak, peak_node=worst.name if worst else "",
                       available_bytes=views[i].cluster.profile().usable_memory_bytes,
                       device=views[i].cluster.profile().name)
        memory.append(sm)
        if not sm.fits:
            reasons.append(sm.message())
    return tuple(memory)


def _actor_transition(job: JobSpec, plan: Plan, view_of: dict[str, JobSpec],
                      rollout_location: int | None, transition_scheme: Scheme | None,
                      ) -> tuple[TransitionCost | None, dict[str, TransitionCost],
                                 WeightSyncCost | None]:
    """(the chosen resharding, every scheme's, the weight sync): the actor's way between its
    training and generation layouts, or to an asynchronous plan's rollout set."""
    actor_plan = plan.roles.get("actor")
    if actor_plan is not None and rollout_location is not None:
        return None, {}, weight_sync_cost(job, plan)
    if actor_plan is not None and actor_plan.generation is not None \
            and not job.generation_elsewhere:
        actor_view = view_of["actor"]
        training = job.framework_profile.training
        schemes = compare_schemes(job.model("actor"), actor_view.cluster.profile(),
                                  actor_plan.parallel, actor_plan.generation,
                                  dtype=job.workload.dtype,
                                  gpus_per_node=actor_view.cluster.gpus_per_node,
                                  fsdp_gather=training.transition_fsdp_gather,
                                  megatron_gather=training.transition_megatron_gather)
        return schemes[transition_scheme or transition_scheme_of(job, actor_plan)], schemes, None
    return None, {}, None


def _transfers(job: JobSpec, nodes: dict[str, NodeEstimate],
               set_pools: tuple[Pool, ...]) -> dict[tuple[str, str], float]:
    """Seconds along every dataflow edge (each goes through the controller)."""
    dataflow = job.dataflow
    transfers: dict[tuple[str, str], float] = {}
    for node in dataflow.nodes:
        for dep in node.after:
            seconds = edge_seconds(job, dataflow.node(dep), nodes[dep].location,
                                   nodes[node.name].location, set_pools)
            if seconds > 0:
                transfers[(dep, node.name)] = seconds
    return transfers


def rollout_plan(plan: Plan) -> RolePlan:
    """The actor's generation replicas on an asynchronous plan's rollout set, as a layout: each
    replica a tensor x pipeline group of the generation config, no training state."""
    assert plan.rollout is not None
    gen = plan.roles["actor"].generation
    assert gen is not None
    return RolePlan(parallel=ParallelConfig(tp=gen.tp, pp=gen.pp,
                                            dp=plan.rollout.gpus // gen.model_parallel_size),
                    generation=gen)


def rollout_node(view: JobSpec, node: Node, plan: Plan, *, location: int) -> NodeEstimate:
    """A generate node on the rollout set: a dedicated engine holding its whole weights;
    responses stream without draining in async mode with partial rollouts."""
    return model_node(view, node, rollout_plan(plan), location=location,
                      resident=MemoryBreakdown(), dedicated=True,
                      stream=plan.mode == "async" and plan.partial_rollout)


def weight_sync_cost(job: JobSpec, plan: Plan) -> WeightSyncCost:
    """One sync of the actor's weights from its training set to the rollout set, over the
    link between them (NVLink when both lie in one node, else the inter-node network)."""
    assert plan.rollout is not None
    actor_set = plan.set_of("actor")
    trainer_pool = job.cluster.pool_of(actor_set.node_group)
    rollout_pool = job.cluster.pool_of(plan.rollout.node_group)
    trainer_profile = job.on_pool(trainer_pool).cluster.profile()
    gpn = trainer_pool.group.gpus_per_node
    same_node = (trainer_pool.index == rollout_pool.index
                 and actor_set.node_range(gpn) == plan.rollout.as_set().node_range(gpn)
                 and actor_set.node_range(gpn)[0] == actor_set.node_range(gpn)[1])
    link = trainer_profile if trainer_pool.index == rollout_pool.index else \
        job.cluster.link_between(trainer_pool, rollout_pool)
    return weight_sync(job.model("actor"), trainer_profile, link,
                       plan.roles["actor"].parallel, rollout_gpus=plan.rollout.gpus,
                       dtype=job.workload.dtype, crosses_nodes=not same_node,
                       gpus_per_node=gpn)
