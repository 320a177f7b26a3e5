"""Worker-side roles: what the actor, critic, reference, reward and cost models do, each
operation declaring its transfer protocol where it is defined.

A batch carries ``input_ids`` (prompt + response: prompts left-padded to the batch's longest,
responses right-padded), ``attention_mask`` (0 on the prompts' left padding; absent when every
prompt has the batch's length), ``response_mask`` over the response positions, and whatever
earlier stages added (``old_log_probs``, ``ref_log_probs``,
``values``, ``advantages``, ``returns``, ...). Every role sees only its data-parallel share.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from executor import algorithms as rl
from executor.batch import Batch
from executor.generation import SamplingParams
from executor.hybrid_engine import HybridEngine, TransitionMode
from executor.protocols import Protocol, protocol
from executor.trainer import OptimConfig, Trainer
from executor.weight_sync import (
    SyncGroup,
    open_store,
    receive,
    send,
    weight_manifest,
    whole_tensors,
)
from simulator.specs.model import ModelSpec
from simulator.specs.parallel import GenerationConfig, ParallelConfig


@dataclass(frozen=True)
class RoleConfig:
    """Everything a worker needs to build one role (sent once, one-to-all)."""

    role: str
    spec: ModelSpec
    parallel: ParallelConfig
    trainable: bool
    value_head: bool
    seed: int
    algorithm: str
    generation: GenerationConfig | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    rl: rl.RLConfig = field(default_factory=rl.RLConfig)
    sampling: SamplingParams | None = None
    ppo_epochs: int = 1
    mini_batches: int = 1
    infer_micro_batch: int = 8
    """Sequences per forward in inference (the workload's infer_micro_batch_size)."""
    transition: TransitionMode = "micro_dp"
    checkpoint: str | None = None
    generation_backend: str = "native"
    """Actor only: native (this project's sampler) or vllm."""
    training_backend: str = "torch"
    """torch (FSDP2 / DTensor) or megatron (Megatron-core)."""
    dtype: str = "fp32"
    """The workload's compute dtype (bf16 or fp32); optimizer states and log-prob math stay
    fp32."""
    offload_optimizer: bool = False
    """Move the optimizer's states to host memory while the set generates (the framework
    profile's ``offload``)."""
    offload_grads: bool = False
    """Move resident gradients to host memory while the set generates."""
    kv_cache_budget_bytes: int | None = None
    """Actor only: the KV-cache bytes per GPU the plan leaves generation (the simulator's
    budget); None: the engine's own default."""
    max_model_tokens: int | None = None
    """Actor only: the longest sequence it generates (prompt + response tokens), the vLLM
    engine's ``max_model_len``; None: the model's context window."""
    rollout: bool = False
    """Actor only: the plan generates on a rollout set of its own (``one_step_off``): the
    trainer's actor has no generation engine and sends its weights to the rollout set after
    every update (``executor.weight_sync``); the ``rollout`` role is that set's generator."""


def build_trainer(config: RoleConfig) -> Any:
    """The role's training backend, built on every rank of the worker group."""
    if config.training_backend == "megatron":
        from executor.backends.megatron import MegatronTrainer

        return MegatronTrainer(config.spec, config.parallel, value_head=config.value_head,
                               seed=config.seed, trainable=config.trainable,
                               optim=config.optim, checkpoint=config.checkpoint,
                               dtype=config.dtype)
    return Trainer(config.spec, config.parallel, value_head=config.value_head,
                   seed=config.seed, trainable=config.trainable, optim=config.optim,
                   checkpoint=config.checkpoint, dtype=config.dtype)


class Role:
    """A model on this worker (one of the set's fused roles)."""

    def __init__(self, config: RoleConfig):
        self.config = config
        self.trainer = build_trainer(config)
        self.last_transition = None

    @property
    def micro(self) -> int:
        """Sequences per training micro-batch (the plan's micro_batch_size)."""
        return self.config.parallel.micro_batch_size

    @property
    def infer_micro(self) -> int:
        return self.config.infer_micro_batch

    def prompt_length(self, batch: Batch) -> int:
        return int(batch.meta["prompt_length"])

    @staticmethod
    def mask(batch: Batch | dict) -> torch.Tensor | None:
        """The batch's attention mask (None: no prompt is padded)."""
        return batch.get("attention_mask", None)

    def _update(self, batch: Batch, loss) -> Batch:
        """PPO epochs x mini-batches optimizer steps over this rank's share."""
        totals: dict[str, float] = {}
        steps = 0
        names = list(batch.keys())
        for _ in range(self.config.ppo_epochs):
            for mini in batch.split(self.config.mini_batches):
                micro = [{n: m[n] for n in names} for m in mini.chunks(self.micro)]
                for key, value in self.trainer.step(micro, loss).items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        return Batch(meta={k: v / max(steps, 1) for k, v in totals.items()})

    def state_bytes(self) -> dict[str, int]:
        return self.trainer.state_bytes()

    @protocol(Protocol.ONE_TO_ALL)
    def save_hf(self, batch: Batch) -> Batch:
        """Write the model as a Hugging Face checkpoint to ``batch.meta["directory"]``: every
        rank takes part in gathering the whole tensors, the group's first rank writes."""
        import torch.distributed as dist

        from executor.model import write_hf_checkpoint
        from executor.trainer import compute_dtype

        state = self.trainer.hf_state()
        if dist.get_rank() == 0:
            write_hf_checkpoint(batch.meta["directory"], self.config.spec, state,
                                compute_dtype(self.config.dtype),
                                value_head=self.config.value_head,
                                extra_files=batch.meta.get("files"))
        return Batch(meta={"written": float(dist.get_rank() == 0)})

    @protocol(Protocol.ONE_TO_ALL)
    def save_checkpoint(self, batch: Batch) -> Batch:
        """Write this role's training state (weights, master weights, optimizer states) to
        ``batch.meta["directory"]`` with torch distributed checkpointing; every rank writes
        its own pieces."""
        from executor import checkpoint

        written = checkpoint.save(self.trainer, batch.meta["directory"])
        return Batch(meta={"bytes": float(written)})

    @protocol(Protocol.ONE_TO_ALL)
    def load_checkpoint(self, batch: Batch) -> Batch:
        """Fill this role's training state from ``batch.meta["directory"]``."""
        from executor import checkpoint

        checkpoint.load(self.trainer, batch.meta["directory"])
        self.after_load()
        return Batch(meta={"loaded": 1.0})

    def after_load(self) -> None:
        """What a role refreshes after its weights changed outside an update."""

    @protocol(Protocol.DP)
    def echo(self, batch: Batch) -> Batch:
        """Return the input: measures what a call costs besides compute."""
        return batch


class ActorRole(Role):
    def __init__(self, config: RoleConfig):
        super().__init__(config)
        assert config.generation is not None and config.sampling is not None
        self.sync: SyncGroup | None = None
        self._sync_store: Any = None
        if config.rollout:
            self.hybrid: Any = None  # generation runs on the rollout set
        elif config.training_backend == "megatron":
            from executor.backends.megatron_hybrid import MegatronHybridEngine

            self.hybrid = MegatronHybridEngine(
                self.trainer, config.generation, backend=config.generation_backend,
                seed=config.seed, kv_cache_budget_bytes=config.kv_cache_budget_bytes,
                max_model_tokens=config.max_model_tokens)
        else:
            self.hybrid = HybridEngine(self.trainer, config.generation, config.transition,
                                       backend=config.generation_backend, seed=config.seed,
                                       kv_cache_budget_bytes=config.kv_cache_budget_bytes,
                                       max_model_tokens=config.max_model_tokens)

    @protocol(Protocol.MICRO_DP)
    def generate(self, batch: Batch) -> Batch:
        """Responses for this replica's prompts: train -> generate transition, sampling,
        back to training."""
        if self.hybrid is None:
            raise RuntimeError("this plan generates on its rollout set (call the rollout "
                               "role's generate)")
        record = self.hybrid.to_generation()
        try:
            out = sample(self.hybrid.engine, self.config, self.hybrid.replica, batch)
        finally:
            self.hybrid.to_training()
        self.last_transition = record
        return out

    # ----- weight sync to a rollout set (one_step_off) -----

    def open_weight_sync(self, batch: Batch) -> Batch:
        """Rank 0: open the sync group's rendezvous store (``batch.meta``: host, members);
        returns its port."""
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return Batch(meta={"port": 0})
        self._sync_store, port = open_store(batch.meta["host"], int(batch.meta["members"]))
        return Batch(meta={"port": port})

    def join_weight_sync(self, batch: Batch) -> Batch:
        """Rank 0 joins the sync group as its sender (sync rank 0); the other ranks only
        help gather the tensors it sends."""
        import torch.distributed as dist

        if dist.get_rank() == 0:
            self.sync = SyncGroup(batch.meta["address"], 0, int(batch.meta["members"]),
                                  store=self._sync_store)
        return Batch(meta={"joined": float(self.sync is not None)})

    @protocol(Protocol.ONE_TO_ALL)
    def send_weights(self, batch: Batch) -> Batch:
        """Every rank gathers the actor's tensors whole, one at a time; rank 0 broadcasts each
        to the rollout set (``executor.weight_sync``)."""
        return Batch(meta=send(self.trainer, weight_manifest(self.config.spec), self.sync))

    def whole_weights(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Every rank: the actor's whole tensors in the compute dtype (what a sync sends)."""
        return {name: whole.cpu() for name, whole in
                whole_tensors(self.trainer, weight_manifest(self.config.spec))}

    @protocol(Protocol.THREE_D)
    def log_probs(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        lp = self.trainer.infer(batch["input_ids"], self.infer_micro, values=False,
                                attention_mask=self.mask(batch))[:, p - 1:]
        return Batch({"old_log_probs": lp * batch["response_mask"]})

    @protocol(Protocol.THREE_D)
    def update(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        cfg = self.config.rl
        use_kl_loss = cfg.kl_mode == "loss" and "ref_log_probs" in batch
        use_ptx = "ptx_input_ids" in batch

        def loss(trainer: Trainer, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            lp = trainer.token_log_probs(mb["input_ids"], self.mask(mb))[:, p - 1:]
            mask = mb["response_mask"]
            value, stats = rl.policy_loss(lp, mb["old_log_probs"], mb["advantages"], mask,
                                          cfg.clip_ratio)
            if use_kl_loss:
                kl = rl.masked_mean(rl.kl_k3(lp, mb["ref_log_probs"]), mask)
                value = value + cfg.kl_coef * kl
                stats["kl"] = float(kl)
            stats["policy_loss"] = float(value)
            if use_ptx:
                # Safe-RLHF keeps the actor close to its pretraining data (PPO-ptx).
                ptx_lp = trainer.token_log_probs(mb["ptx_input_ids"])[:, p - 1:]
                ptx = rl.language_model_loss(ptx_lp, mb["ptx_mask"])
                value = value + cfg.ptx_coef * ptx
                stats["ptx_loss"] = float(ptx)
            return value, stats

        return self._update(batch, loss)


class CriticRole(Role):
    @protocol(Protocol.THREE_D)
    def values(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        values = self.trainer.infer(batch["input_ids"], self.infer_micro, values=True,
                                    attention_mask=self.mask(batch))[:, p - 1:-1]
        return Batch({"values": values * batch["response_mask"]})

    @protocol(Protocol.THREE_D)
    def update(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        clip = self.config.rl.value_clip

        def loss(trainer: Trainer, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            values = trainer.token_values(mb["input_ids"], self.mask(mb))[:, p - 1:-1]
            value = rl.value_loss(values, mb["values"], mb["returns"], mb["response_mask"],
                                  clip)
            return value, {"value_loss": float(value)}

        return self._update(batch, loss)


class ReferenceRole(Role):
    @protocol(Protocol.THREE_D)
    def log_probs(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        lp = self.trainer.infer(batch["input_ids"], self.infer_micro, values=False,
                                attention_mask=self.mask(batch))[:, p - 1:]
        return Batch({"ref_log_probs": lp * batch["response_mask"]})


class RewardRole(Role):
    """A reward (or cost) model: the value head's output at the last response token."""

    @protocol(Protocol.THREE_D)
    def scores(self, batch: Batch) -> Batch:
        p = self.prompt_length(batch)
        values = self.trainer.infer(batch["input_ids"], self.infer_micro, values=True,
                                    attention_mask=self.mask(batch))
        last = p - 1 + batch["response_mask"].sum(-1).long()
        column = "cost_scores" if self.config.role == "cost" else "model_scores"
        return Batch({column: values[torch.arange(len(values), device=values.device), last]})


    @protocol(Protocol.THREE_D)
    def fit(self, batch: Batch) -> Batch:
        """Regress the score at the last response token onto ``targets`` (fitting a reward
        model to a verifiable rule before reinforcement learning)."""
        p = self.prompt_length(batch)

        def loss(trainer: Trainer, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            values = trainer.token_values(mb["input_ids"], self.mask(mb))
            last = p - 1 + mb["response_mask"].sum(-1).long()
            error = values[torch.arange(len(values), device=values.device), last] - mb["targets"]
            value = (error ** 2).mean()
            return value, {"fit_loss": float(value)}

        return self._update(batch, loss)


def sample(engine: Any, config: RoleConfig, replica: int, batch: Batch) -> Batch:
    """Responses of ``engine`` (its weights loaded) to this replica's prompts: the sampled
    tokens, their log-probabilities under the generating weights (``old_log_probs``), and the
    masks. Seeded per (role seed, iteration, replica, greedy): the same draws wherever the
    replica runs."""
    assert config.sampling is not None
    sampling = config.sampling
    if batch.meta.get("greedy"):
        sampling = SamplingParams(**{**_fields(sampling), "greedy": True})
    seed = hash((config.seed, int(batch.meta.get("iteration", 0)), replica,
                 bool(batch.meta.get("greedy")))) % (2**63)
    generator = torch.Generator(device=batch["prompts"].device).manual_seed(seed)
    prompt_mask = batch.get("prompt_mask", None)
    out = engine.generate(batch["prompts"], sampling, generator, prompt_mask=prompt_mask)
    prompts = batch["prompts"]
    # Responses come padded to max_new_tokens; every later pass runs on the replica's longest
    # one (issue 31 defect 9). Under the causal mask the cut columns changed nothing before
    # them, and Batch.concat pads replicas of different widths back to one.
    steps = max(1, int(out.lengths.max()))
    out = replace(out, responses=out.responses[:, :steps], log_probs=out.log_probs[:, :steps])
    mask = (torch.arange(steps, device=out.lengths.device)[None]
            < out.lengths[:, None]).float()
    tensors = {"prompts": prompts, "responses": out.responses,
               "input_ids": torch.cat([prompts, out.responses], dim=1),
               "response_mask": mask, "old_log_probs": out.log_probs}
    if prompt_mask is not None:
        tensors["prompt_mask"] = prompt_mask
        tensors["attention_mask"] = torch.cat(
            [prompt_mask, torch.ones_like(out.responses, dtype=prompt_mask.dtype)], dim=1)
    if "prompt_index" in batch:
        tensors["prompt_index"] = batch["prompt_index"]
    return Batch(tensors, {"prompt_length": prompts.shape[1]})


class RolloutRole:
    """The actor's generation replicas on a rollout set of their own (``one_step_off``):
    a generation engine and nothing to train. Its ranks form replicas of the actor's
    generation tp (consecutive ranks); the weights arrive from the trainer's actor by the
    weight sync after every update (``receive_weights``), each rank keeping its generation
    shard, and stay loaded between generations."""

    def __init__(self, config: RoleConfig):
        import torch.distributed as dist

        from executor.device import shared_mesh
        from executor.hybrid_engine import make_engine
        from executor.trainer import compute_dtype

        assert config.generation is not None and config.sampling is not None
        self.config = config
        self.tp = config.generation.tp
        mesh = shared_mesh((dist.get_world_size() // self.tp, self.tp), ("replica", "gen_tp"))
        self.tp_rank = mesh.get_local_rank("gen_tp")
        self.replica = mesh.get_local_rank("replica")
        self.dtype = compute_dtype(config.dtype)
        self.engine = make_engine(config.spec, config.generation, config.generation_backend,
                                  seed=config.seed, tp_group=mesh.get_group("gen_tp"),
                                  tp_rank=self.tp_rank,
                                  kv_cache_budget_bytes=config.kv_cache_budget_bytes,
                                  dtype=self.dtype, max_model_tokens=config.max_model_tokens)
        self.sync: SyncGroup | None = None
        self.last_transition = None
        self.syncs = 0
        """Weight syncs received (0: no weights yet)."""

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.engine.weight_bytes() if self.syncs else 0}

    def join_weight_sync(self, batch: Batch) -> Batch:
        """Join the sync group as a receiver (sync rank 1 + this rank)."""
        import torch.distributed as dist

        self.sync = SyncGroup(batch.meta["address"], 1 + dist.get_rank(),
                              int(batch.meta["members"]))
        return Batch(meta={"joined": 1.0})

    @protocol(Protocol.ONE_TO_ALL)
    def receive_weights(self, batch: Batch) -> Batch:
        """Receive the trainer's tensors, keep this rank's generation shards, load them."""
        from executor.generation import tp_shard_dim

        assert self.sync is not None, "the sync group is not formed"

        def keep(name: str, whole: torch.Tensor) -> torch.Tensor:
            dim = tp_shard_dim(name)
            if dim is None or self.tp == 1:
                return whole
            return whole.chunk(self.tp, dim=dim)[self.tp_rank].clone()

        weights, stats = receive(weight_manifest(self.config.spec), self.sync, self.dtype,
                                 keep)
        self.engine.load(weights)
        self.syncs += 1
        return Batch(meta=stats)

    @protocol(Protocol.MICRO_DP)
    def generate(self, batch: Batch) -> Batch:
        """Responses for this replica's prompts with the weights of the last sync."""
        if not self.syncs:
            raise RuntimeError("the rollout set has no weights yet (no sync received)")
        return sample(self.engine, self.config, self.replica, batch)

    def whole_weights(self, batch: Batch) -> dict[str, torch.Tensor]:
        """This rank's generation weights as loaded (whole tensors at generation tp 1)."""
        return {name: w.cpu() for name, w in self.engine.weights.items()}


ROLE_CLASSES: dict[str, type[Role] | type[RolloutRole]] = {
    "actor": ActorRole, "critic": CriticRole, "ref": ReferenceRole, "reward": RewardRole,
    "cost": RewardRole, "rollout": RolloutRole,
}


def _fields(obj: object) -> dict:
    from dataclasses import fields

    return {f.name: getattr(obj, f.name) for f in fields(obj)}  # type: ignore[arg-type]
