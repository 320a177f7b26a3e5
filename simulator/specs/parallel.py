"""ParallelConfig (training / inference layout) and GenerationConfig (the actor's rollout layout).

Training uses Megatron's p-t-d naming: ``pp`` pipeline stages, ``tp`` tensor shards, ``dp``
replicas; ``sharding`` says how much of the model state the ``dp`` replicas shard (none,
the optimizer states as Megatron's distributed optimizer / ZeRO-1, or everything as FSDP /
ZeRO-3). Generation uses ``tp_g``/``pp_g`` and the 3D-HybridEngine's micro-DP groups
``d_g = (pp * tp) / (pp_g * tp_g)`` (HybridFlow §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from profiles.datafile import SpecError, require
from simulator.specs.model import ModelSpec


def stage_layers(layers: int, stages: int) -> int:
    """Layers of the heaviest of ``stages`` pipeline stages: ceil(layers / stages). When the
    stages do not divide the layers the split is as even as it can be, which Megatron
    expresses with num_layers_in_first/last_pipeline_stage (``outer_stage_layers``) and vLLM
    with VLLM_PP_LAYER_PARTITION; the heaviest stage paces the pipeline and sets its
    memory."""
    return -(-layers // stages)


def outer_stage_layers(layers: int, pp: int) -> tuple[int, int] | None:
    """(first, last) stage layer counts that cut ``layers`` into ``pp`` stages whose middle
    ones hold ``stage_layers`` each, as Megatron's num_layers_in_first/last_pipeline_stage
    take them (the rest must split evenly over the middle stages); None when the stages are
    even, or when the outer stages would be left without a layer."""
    if pp == 1 or layers % pp == 0:
        return None
    middle = stage_layers(layers, pp)
    outer = layers - (pp - 2) * middle
    if outer < 2:
        return None
    first = min(middle, outer - 1)
    return first, outer - first

Sharding = Literal["none", "optimizer", "fsdp"]
Recompute = Literal["none", "selective", "full"]
Dispatcher = Literal["alltoall", "flex"]
"""How MoE tokens reach their experts: ``alltoall`` sends every routed copy to its expert's
rank (Megatron-core's alltoall token dispatcher); ``flex`` deduplicates, sending a token once
to each node that holds one of its experts and forwarding it inside that node over NVLink
(Megatron-core's flex dispatcher with DeepEP or HybridEP)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    """How one model is laid out over its GPUs for training or inference."""

    tp: int = 1
    """Tensor-parallel size (within a node)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int = 1
    """Data-parallel replicas (FSDP: the sharding group size)."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""
    sharding: Sharding = "none"
    """none: plain DP; optimizer: distributed optimizer (ZeRO-1); fsdp: FSDP / ZeRO-3."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism with TP (reduce-scatter/all-gather instead of all-reduce)."""
    recompute: Recompute = "selective"
    """Activation recomputation: none, selective (attention core only) or full (every layer)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    overlap_grad_reduce: bool = True
    """Overlap the gradient reduction with the backward pass of the last micro-batch."""
    overlap_param_gather: bool = True
    """FSDP: prefetch the next layer's parameters while computing this one."""
    ep: int = 1
    """Expert parallel size (MoE): each rank of an ep group holds experts / ep of every MoE
    layer's routed experts, and tokens go to their experts' ranks by all-to-all."""
    moe_dispatcher: Dispatcher = "alltoall"
    """MoE token dispatch (see ``Dispatcher``)."""
    etp: int = 1
    """Expert tensor parallel size (MoE): each expert's MLP split over etp ranks (Megatron's
    expert_tensor_parallel_size). ep * etp divides the tp * dp ranks of a pipeline stage,
    which Megatron regroups into expert-parallel groups."""
    ulysses: int = 1
    """DeepSpeed-Ulysses sequence-parallel ranks (verl's ulysses_sequence_parallel_size): each
    sequence's tokens are split over this many of the dp ranks and the attention heads
    exchanged by all-to-all around attention (``simulator/costs/ulysses.py``); the batch is
    split over dp / ulysses data shards. FSDP layouts only (pp 1)."""
    micro_batch_tokens: int = 0
    """Training micro-batches by a token budget per GPU instead of ``micro_batch_size``
    sequences (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu): each data-parallel
    rank's sequences are split into ceil(tokens / budget) micro-batches of balanced work
    (``simulator/packing.py token_budget_batch``). 0: by sequence count."""
    infer_micro_batch_tokens: int = 0
    """The same for the forward-only passes (log-probs, values: verl's
    log_prob_max_token_len_per_gpu / forward_max_token_len_per_gpu). 0: the workload's
    ``infer_micro_batch_size`` sequences."""
    offload_params: bool = False
    """The model's parameter shards live in host memory between its calls and are copied in
    for each call and back after it (verl's param_offload): no GPU memory between calls,
    two host-link copies per call."""
    offload_optimizer: bool = False
    """The same for the optimizer states (and fp32 master weights) around each update
    (verl's optimizer_offload)."""
    cp: int = 1
    """Context parallelism: each sequence's tokens are split over this many of the dp ranks,
    which exchange keys and values in every attention layer, as the framework's
    ``context_parallel_exchange`` says (``simulator/costs/context_parallel.py``): Megatron's
    context_parallel_size (a ring) or OpenRLHF's --ds.ring_attn_size (all-gathers, also under
    ZeRO-3). The batch is split over dp / cp data shards and gradients reduced over all dp
    ranks, as Megatron reduces them over its data x context-parallel group and DeepSpeed over
    its whole world. Not with hybrid sharding (fsdp_size)."""
    fsdp_size: int = 0
    """FSDP only: hybrid sharding (HSDP). Each parameter, gradient and optimizer state is
    split over groups of this many consecutive dp ranks and replicated over the dp /
    fsdp_size groups: weights are all-gathered and gradients reduce-scattered inside a
    group, then the gradient shards all-reduced across the groups (verl's fsdp_size; FSDP2's
    2-D (replicate, shard) mesh). 0: one group of every dp rank (plain FSDP)."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Precomputed: configs are cache keys of the cost models, hashed on every call.
        return self._hash

    def __post_init__(self) -> None:
        # The search builds tens of thousands of configs: a message is formatted only when
        # its check fails (``if ...: raise``, not ``require`` with an f-string).
        for key in ("tp", "pp", "dp", "vpp", "micro_batch_size", "ep", "etp", "ulysses", "cp"):
            value = getattr(self, key)
            if not value >= 1:
                raise SpecError(f"must be a positive integer, got {value}", key=key)
        for key in ("micro_batch_tokens", "infer_micro_batch_tokens"):
            value = getattr(self, key)
            if not value >= 0:
                raise SpecError(f"must be >= 0 (0: micro-batches by sequence count), got "
                                f"{value}", key=key)
        require(self.vpp == 1 or self.pp > 1, "virtual pipeline stages need pp > 1", "vpp")
        require(self.sharding != "fsdp" or self.pp == 1,
                "FSDP is not combined with pipeline parallelism here; use pp: 1", "pp")
        if self.dp % self.ulysses != 0:
            raise SpecError(f"ulysses={self.ulysses} must divide dp={self.dp} (its ranks are "
                            "data-parallel ranks that share sequences)", key="ulysses")
        require(self.ulysses == 1 or self.pp == 1,
                "Ulysses sequence parallelism runs without pipeline stages; use pp: 1", "ulysses")
        if self.dp % (self.ulysses * self.cp) != 0:
            raise SpecError(f"cp={self.cp} must divide dp={self.dp} (its ranks are "
                            "data-parallel ranks that share sequences)", key="cp")
        require(self.cp == 1 or self.ulysses == 1,
                "one kind of sequence parallelism per layout: Ulysses (FSDP engines) or "
                "context parallelism (Megatron)", "cp")
        require(self.cp == 1 or self.fsdp_size == 0,
                "context parallelism with hybrid sharding (fsdp_size) is not priced: no "
                "framework here runs them together", "cp")
        if not self.fsdp_size >= 0:
            raise SpecError(f"must be >= 0 (0: shard over every dp rank), got "
                            f"{self.fsdp_size}", key="fsdp_size")
        if self.fsdp_size:
            require(self.sharding == "fsdp", "hybrid sharding groups need sharding: fsdp "
                    "(drop fsdp_size for other layouts)", "fsdp_size")
            require(self.fsdp_size > 1, "a group of one rank shards nothing: use sharding: "
                    "none for whole replicas, or fsdp_size >= 2", "fsdp_size")
            require(self.dp % self.fsdp_size == 0,
                    f"fsdp_size={self.fsdp_size} must divide dp={self.dp} (whole groups of "
                    "ranks each hold one copy)", "fsdp_size")
            if self.fsdp_size == self.dp:
                object.__setattr__(self, "fsdp_size", 0)  # one group of all: plain FSDP
        object.__setattr__(self, "_hash", hash((
            self.tp, self.pp, self.dp, self.vpp, self.sharding, self.sequence_parallel,
            self.recompute, self.micro_batch_size, self.overlap_grad_reduce,
            self.overlap_param_gather, self.ep, self.etp, self.moe_dispatcher,
            self.offload_params, self.offload_optimizer, self.micro_batch_tokens,
            self.infer_micro_batch_tokens, self.ulysses, self.fsdp_size, self.cp)))

    @property
    def data_shards(self) -> int:
        """Ranks that take different sequences of a batch: dp / (ulysses x cp)."""
        return self.dp // (self.ulysses * self.cp)

    @property
    def world_size(self) -> int:
        """GPUs the layout occupies: pp * tp * dp."""
        return self.pp * self.tp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one copy of the model (training shard = 1 / this, without FSDP)."""
        return self.pp * self.tp

    @property
    def fsdp_shards(self) -> int:
        """Data-parallel ranks one FSDP group splits each tensor over (dp, or ``fsdp_size``
        under hybrid sharding); 1 without FSDP."""
        if self.sharding != "fsdp":
            return 1
        return self.fsdp_size or self.dp

    @property
    def fsdp_replicas(self) -> int:
        """FSDP groups that each hold a whole copy (hybrid sharding: dp / fsdp_size; 1 with
        plain FSDP or without FSDP)."""
        return self.dp // self.fsdp_shards if self.sharding == "fsdp" else 1

    @property
    def weight_shards(self) -> int:
        """GPUs one whole copy of the weights is split over: tp * pp, times the FSDP group."""
        return self.pp * self.tp * self.fsdp_shards

    def state_shards(self) -> int:
        """Number of pieces each parameter is split into for storage (FSDP also splits by its
        group of dp ranks)."""
        return self.weight_shards

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard (Megatron's expert data parallel size): the stage's
        tp * dp ranks over ep * etp."""
        return expert_replicas(tp=self.tp, dp=self.dp, ep=self.ep, etp=self.etp)

    def check_model(self, model: ModelSpec, *, gpus_per_node: int, key: str = "") -> None:
        """Raise SpecError if this layout cannot hold ``model`` on nodes of ``gpus_per_node``."""
        prefix = f"{key}." if key else ""
        if model.moe is None and (self.ep > 1 or self.etp > 1):
            raise SpecError(f"{model.name} is dense: expert parallelism needs a moe: model",
                            key=f"{prefix}{'ep' if self.ep > 1 else 'etp'}")
        if model.moe is not None:
            if model.moe.experts % self.ep:
                raise SpecError(f"ep={self.ep} does not divide the {model.moe.experts} experts "
                                f"of {model.name}", key=f"{prefix}ep")
            if model.moe.expert_ffn_hidden % self.etp:
                raise SpecError(f"etp={self.etp} does not divide expert_ffn_hidden="
                                f"{model.moe.expert_ffn_hidden} of {model.name}",
                                key=f"{prefix}etp")
            if (self.tp * self.dp) % (self.ep * self.etp):
                raise SpecError(f"ep*etp={self.ep * self.etp} does not divide the tp*dp="
                                f"{self.tp * self.dp} ranks of a pipeline stage (Megatron forms "
                                "the expert groups from them)", key=f"{prefix}ep")
            if self.tp > 1 and not self.sequence_parallel:
                raise SpecError("Megatron trains MoE layers with tp > 1 only with sequence "
                                "parallelism: set sequence_parallel: true or tp: 1",
                                key=f"{prefix}sequence_parallel")
            if self.sharding == "fsdp" and self.ep > 1:
                raise SpecError("expert parallelism runs with Megatron's layouts (sharding none "
                                "or optimizer), not FSDP", key=f"{prefix}ep")
        if self.tp > gpus_per_node:
            raise SpecError(f"tp={self.tp} is larger than a node ({gpus_per_node} GPUs); "
                            "tensor parallelism stays inside a node", key=f"{prefix}tp")
        if model.heads % self.tp:
            raise SpecError(f"tp={self.tp} does not divide the {model.heads} attention heads of "
                            f"{model.name}", key=f"{prefix}tp")
        if model.heads % (self.tp * self.ulysses):
            raise SpecError(f"tp x ulysses = {self.tp * self.ulysses} does not divide the "
                            f"{model.heads} attention heads of {model.name} (Ulysses gives each "
                            "rank whole heads)", key=f"{prefix}ulysses")
        check_pipeline_stages(model, self.pp, self.vpp, key=prefix.rstrip("."))

    def short(self) -> str:
        """A compact label like 'pp1-tp4-dp2' (with '-fsdp' / '-zero1')."""
        label = f"pp{self.pp}-tp{self.tp}-dp{self.dp}"
        if self.vpp > 1:
            label += f"-vpp{self.vpp}"
        if self.sharding == "fsdp":
            label += f"-hsdp{self.fsdp_size}" if self.fsdp_size else "-fsdp"
        elif self.sharding == "optimizer":
            label += "-zero1"
        if self.ep > 1:
            label += f"-ep{self.ep}"
        if self.etp > 1:
            label += f"-etp{self.etp}"
        if self.ulysses > 1:
            label += f"-sp{self.ulysses}"
        if self.cp > 1:
            label += f"-cp{self.cp}"
        if self.offload_params or self.offload_optimizer:
            label += "-offload" + ("" if self.offload_params and self.offload_optimizer else
                                   "-params" if self.offload_params else "-optimizer")
        return label


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationConfig:
    """The actor's generation layout inside its training GPUs (3D-HybridEngine)."""

    tp: int = 1
    """Generation tensor-parallel size t_g."""
    pp: int = 1
    """Generation pipeline size p_g."""
    max_num_seqs: int = 256
    """Running-batch cap of the engine per replica (vLLM's default max_num_seqs is 256,
    vllm EngineArgs)."""
    memory_utilization: float = 0.9
    """Fraction of device memory the generation engine may fill with weights and KV cache
    (vLLM's default gpu_memory_utilization is 0.9, vllm EngineArgs)."""
    free_cache: bool | None = None
    """Whether the engine frees its KV cache (and its weights) after generating and takes
    them back before the next generation (verl's free_cache_engine, vLLM's sleep mode): the
    sleep and wake cost time, while an engine that keeps them holds its whole allocation
    through training. None: the framework's default."""
    ep: int = 1
    """MoE: expert-parallel serving as vLLM runs it (enable_expert_parallel with
    data_parallel_size = ep / tp): the routed experts of ``ep`` GPUs (tp ranks of ep / tp
    replicas, which step together) are spread over them, experts / ep each, and tokens reach
    them by all-to-all; attention stays per replica. 1: every replica holds every expert,
    split over its tp ranks (vLLM's default)."""

    def __post_init__(self) -> None:
        # Built for every generation layout the search tries: messages formatted on failure.
        if not self.ep >= 1:
            raise SpecError(f"must be a positive integer, got {self.ep}", key="ep")
        if not (self.ep == 1 or self.ep % self.tp == 0):
            raise SpecError(f"ep={self.ep} must be a multiple of tp={self.tp} (vLLM spreads "
                            "the experts over tp x data-parallel ranks)", key="ep")
        for key in ("tp", "pp", "max_num_seqs"):
            value = getattr(self, key)
            if not value >= 1:
                raise SpecError(f"must be a positive integer, got {value}", key=key)
        require(0 < self.memory_utilization <= 1, "must be in (0, 1]", "memory_utilization")

    @property
    def model_parallel_size(self) -> int:
        return self.pp * self.tp

    def micro_dp(self, train: ParallelConfig) -> int:
        """d_g: generation replicas per training replica, (p*t)/(p_g*t_g); FSDP-trained actors
        regroup all the GPUs of their FSDP group."""
        return train.weight_shards // self.model_parallel_size

    def replicas(self, train: ParallelConfig) -> int:
        """Generation data-parallel replicas on the actor's GPUs."""
        return train.world_size // self.model_parallel_size

    def check(self, model: ModelSpec, train: ParallelConfig, *, gpus_per_node: int,
              key: str = "generation", nested: bool = True) -> None:
        """Raise SpecError if the generation layout does not fit the training layout: with
        ``nested`` (the 3D-HybridEngine) each GPU's training shard must lie inside its
        generation shard; otherwise (an engine with its own copy of the weights, vLLM) the
        generation replicas must tile the actor's GPUs."""
        self.check_shape(model, gpus_per_node=gpus_per_node, key=key)
        self.check_experts(model, train.world_size, key=key)
        if not nested:
            if train.world_size % self.model_parallel_size:
                raise SpecError(f"generation tp*pp={self.model_parallel_size} must divide the "
                                f"actor's {train.world_size} GPUs (whole engine replicas)",
                                key=f"{key}.tp")
            return
        shards = train.weight_shards
        if train.ep * train.etp > train.tp and train.sharding != "fsdp":
            # One copy of an MoE model spans its ep x etp group when that is wider than tp
            # (the experts are spread over it): the generation shard gathers its experts
            # from that group.
            shards = train.ep * train.etp * train.pp
        if shards % self.model_parallel_size:
            raise SpecError(
                f"generation tp*pp={self.model_parallel_size} must divide the training "
                f"{'FSDP group x tp' if train.sharding == 'fsdp' else 'tp*pp'}={shards} "
                "(3D-HybridEngine: each GPU's training shard lies inside its generation shard)",
                key=f"{key}.tp")
        if train.sharding != "fsdp" and train.ep == 1 and (train.tp % self.tp
                                                            or train.pp % self.pp):
            raise SpecError(f"generation tp={self.tp}, pp={self.pp} must divide training "
                            f"tp={train.tp}, pp={train.pp}", key=f"{key}.tp")

    def check_experts(self, model: ModelSpec, gpus: int, *, key: str = "generation") -> None:
        """Raise SpecError if ``ep`` cannot spread ``model``'s experts over ``gpus``
        generation GPUs."""
        if self.ep == 1:
            return
        if model.moe is None:
            raise SpecError(f"{model.name} is dense: expert parallelism needs a moe: model",
                            key=f"{key}.ep")
        if model.moe.experts % self.ep:
            raise SpecError(f"ep={self.ep} does not divide the {model.moe.experts} experts of "
                            f"{model.name}", key=f"{key}.ep")
        if gpus % (self.ep * self.pp):
            raise SpecError(f"ep={self.ep} (x pp {self.pp}) does not divide the {gpus} "
                            "generation GPUs", key=f"{key}.ep")

    def check_shape(self, model: ModelSpec, *, gpus_per_node: int,
                    key: str = "generation") -> None:
        """Raise SpecError if ``model`` cannot be cut into this layout on nodes of
        ``gpus_per_node`` (tensor parallelism within a node, dividing the heads; pipeline
        stages dividing the layers)."""
        if self.tp > gpus_per_node:
            raise SpecError(f"tp={self.tp} is larger than a node ({gpus_per_node} GPUs)",
                            key=f"{key}.tp")
        if model.heads % self.tp:
            raise SpecError(f"tp={self.tp} does not divide the {model.heads} attention heads",
                            key=f"{key}.tp")
        check_pipeline_stages(model, self.pp, 1, key=key)

    def short(self) -> str:
        return (f"gen-pp{self.pp}-tp{self.tp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
                + ("-keepcache" if self.free_cache is False else ""))


def check_pipeline_stages(model: ModelSpec, pp: int, vpp: int, *, key: str) -> None:
    """Raise SpecError unless ``model``'s layers can be cut into ``pp`` stages (of
    ``vpp`` interleaved chunks each): at least one layer per stage; stages of unequal
    layer counts only without interleaving (the interleaved schedule runs equal chunks)."""
    prefix = f"{key}." if key else ""
    if pp > model.layers:
        raise SpecError(f"pp={pp} is more stages than the {model.layers} layers of "
                        f"{model.name}", key=f"{prefix}pp")
    if vpp > 1 and model.layers % (pp * vpp):
        raise SpecError(f"pp*vpp={pp * vpp} does not divide the {model.layers} layers of "
                        f"{model.name} (interleaved stages hold equal chunks)",
                        key=f"{prefix}vpp")


def expert_replicas(*, tp: int, dp: int, ep: int, etp: int) -> int:
    """Replicas of each expert shard (``ParallelConfig.expert_dp``) from the layout's shape."""
    return max(1, tp * dp // (ep * etp))
