"""Process bodies of the Megatron-core tests (module level, so that spawn can import them).
Each process installs the test-only CPU shims, joins a gloo group, builds its stage of the
model with the plan's layout and writes what it computed to a JSON file for the test."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def setup(rank: int, world: int, port: int, tp: int, pp: int, vpp: int = 1) -> None:
    from tests.compat.megatron_cpu import install

    install()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)


def log_probs_and_round_trip(rank: int, world: int, port: int, tp: int, pp: int,
                             out: str, preset: str = "tiny-4l") -> None:
    """Forward log-probs of a batch through the pipeline schedule, and the weights exported
    back to Hugging Face names, against the torch model they were imported from."""
    setup(rank, world, port, tp, pp)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from executor.backends.megatron import build_gpt, export_local, gather_hf, import_hf
    from executor.model import build_model
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    spec = MODEL_PRESETS[preset]
    reference = build_model(spec, seed=0)
    # Random (not unit / zero) norms and biases, so that a misplaced one shows.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for name, param in reference.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    hf = {k: v.detach() for k, v in reference.state_dict().items()}
    par = ParallelConfig(tp=tp, pp=pp, dp=world // (tp * pp), sequence_parallel=False)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    model = build_gpt(spec, par, value_head=False, pp_rank=pp_rank)
    import_hf(model, hf, spec, par, tp_rank=tp_rank, pp_rank=pp_rank)
    ids = torch.randint(0, spec.vocab, (4, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    computed: list[torch.Tensor] = []

    def forward_step(data, model):
        batch = next(data)
        output = model(batch, positions, attention_mask=None)

        def loss(output_tensor: torch.Tensor):
            if ps.is_pipeline_last_stage():
                logits = output_tensor[:, :-1].transpose(0, 1).contiguous().float()
                targets = batch[:, 1:].transpose(0, 1).contiguous()
                computed.append(-vocab_parallel_cross_entropy(logits, targets).transpose(0, 1))
            return output_tensor.sum() * 0, {}
        return output, loss

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step,
                                    data_iterator=iter([ids[:2], ids[2:]]), model=[model],
                                    num_microbatches=2, seq_length=12, micro_batch_size=2,
                                    forward_only=True)
    shards = [None] * world
    dist.all_gather_object(shards, export_local(model, spec, par, pp_rank=pp_rank))
    if rank == world - 1:
        expected = torch.log_softmax(reference(ids)[:, :-1].float(), -1).gather(
            -1, ids[:, 1:, None]).squeeze(-1)
        back = gather_hf(shards[:tp * pp], spec, par)
        keys = [k for k in hf if not (spec.tied_embeddings and k == "lm_head.weight")]
        Path(out).write_text(json.dumps({
            "max_log_prob_error": float((torch.cat(computed) - expected).abs().max()),
            "round_trip_exact": all(torch.equal(back[k], hf[k]) for k in keys),
            "missing": sorted(set(keys) - set(back))}))
    dist.destroy_process_group()


def left_padded_log_probs(rank: int, world: int, port: int, tp: int, pp: int, out: str,
                          value_head: bool = False) -> None:
    """Log-probs (or values) of left-padded rows through MegatronTrainer, with sequence
    parallelism, against the torch model's on the same weights and padding mask; one
    micro-batch of 3 rows (the schedule pads the sequence to a multiple of tp)."""
    setup(rank, world, port, tp, pp)
    from executor.backends.megatron import MegatronTrainer
    from executor.model import build_model
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    spec = MODEL_PRESETS["tiny-4l"]
    par = ParallelConfig(tp=tp, pp=pp, dp=world // (tp * pp), sequence_parallel=tp > 1)
    trainer = MegatronTrainer(spec, par, value_head=value_head, seed=0, trainable=False)
    ids = torch.randint(1, spec.vocab, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 4, 7)):
        ids[row, :pads] = 0
        mask[row, :pads] = 0
    computed = trainer.infer(ids, 3, values=value_head, attention_mask=mask)
    if rank == world - 1:
        reference = build_model(spec, value_head=value_head, seed=0)
        with torch.no_grad():
            if value_head:
                expected = reference(ids, mask).float()
                real = mask.bool()
            else:
                expected = torch.log_softmax(reference(ids, mask)[:, :-1].float(), -1).gather(
                    -1, ids[:, 1:, None]).squeeze(-1)
                # Positions predicting a real token from a real one (the first real token
                # has no prediction: what a pad position computes is masked everywhere).
                real = (mask[:, 1:] * mask[:, :-1]).bool()
        Path(out).write_text(json.dumps({
            "max_error": float((computed - expected)[real].abs().max()),
            "shape_equal": list(computed.shape) == list(expected.shape),
            "pads_zero": bool((computed[~real] == 0).all())}))
    dist.barrier()
    dist.destroy_process_group()


def training_losses(rank: int, world: int, port: int, tp: int, pp: int, vpp: int,
                    sharding: str, out: str, sequence_parallel: bool = False,
                    recompute: str = "selective") -> None:
    """Three optimizer steps of a token log-likelihood loss on a fixed global batch (each
    data-parallel rank takes its share, 2 micro-batches each), with the plan's activation
    ``recompute``; the losses and the final weights (Hugging Face names) from the last
    rank."""
    setup(rank, world, port, tp, pp, vpp)
    from megatron.core import parallel_state as ps

    from executor.backends.megatron import MegatronTrainer
    from executor.trainer import OptimConfig
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    spec = MODEL_PRESETS["tiny-4l"]
    dp = world // (tp * pp)
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp, sharding=sharding,
                         sequence_parallel=sequence_parallel, overlap_grad_reduce=False,
                         overlap_param_gather=False, recompute=recompute)
    trainer = MegatronTrainer(spec, par, value_head=False, seed=0, trainable=True,
                              optim=OptimConfig(lr=1e-3))
    config = trainer.config
    if rank == 0:
        # The layout's recompute reaches Megatron's config (checked in the test).
        Path(out + ".recompute").write_text(json.dumps(
            [config.recompute_granularity, config.recompute_method, config.recompute_modules]))

    def loss_fn(model, batch):
        log_probs = model.token_log_probs(batch["input_ids"])
        loss = -log_probs.mean()
        return loss, {"loss": loss.detach()}

    losses, grad_norms = [], []
    for step in range(3):
        # A new batch each step (the optimizer must see every rank's shard of each).
        # 11 tokens: sequence parallelism pads them to a multiple of tp.
        ids = torch.randint(0, spec.vocab, (8, 11),
                            generator=torch.Generator().manual_seed(2 + step))
        mine = ids.chunk(dp)[ps.get_data_parallel_rank()]
        micro = [{"input_ids": part} for part in mine.chunk(2)]
        stats = trainer.step(micro, loss_fn)
        # The mean over data-parallel ranks of their micro-batch means: the global mean.
        value = torch.tensor([stats["loss"]])
        dist.all_reduce(value)
        losses.append(float(value) / world)
        grad_norms.append(stats["grad_norm"])
    weights = trainer.hf_state()
    if rank == world - 1:
        torch.save(weights, out + ".pt")
        Path(out).write_text(json.dumps({"losses": losses, "grad_norms": grad_norms}))
    dist.barrier()
    dist.destroy_process_group()


def moe_training_losses(rank: int, world: int, port: int, ep: int, out: str,
                        preset: str = "tiny-moe-2l", moe: dict | None = None, tp: int = 1,
                        etp: int = 1, steps: int = 3) -> None:
    """``training_losses`` for a mixture-of-experts model (``preset`` with its ``moe`` fields
    replaced by ``moe``) with ``ep``-way expert parallelism, each expert cut over ``etp``
    ranks, over ``world`` ranks (pp = 1;
    tp > 1 with sequence parallelism, which Megatron's MoE layer needs): the trainer lays out
    Megatron's parallel state itself (expert groups included). The losses, gradient norms and
    the weights
    exported in Hugging Face names (before and after) from the last rank; every rank's
    (expert-parallel rank, experts it holds per layer)."""
    from tests.compat.megatron_cpu import install

    install()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from executor.backends.megatron import MegatronTrainer
    from executor.trainer import OptimConfig
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    spec = MODEL_PRESETS[preset]
    if moe:
        spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, **moe))
    dp = world // tp
    par = ParallelConfig(tp=tp, pp=1, dp=dp, ep=ep, etp=etp, sequence_parallel=tp > 1,
                         overlap_grad_reduce=False, overlap_param_gather=False)
    par.check_model(spec, gpus_per_node=8)
    trainer = MegatronTrainer(spec, par, value_head=False, seed=0, trainable=True,
                              optim=OptimConfig(lr=1e-3))
    initial = trainer.hf_state()

    def loss_fn(model, batch):
        log_probs = model.token_log_probs(batch["input_ids"])
        loss = -log_probs.mean()
        return loss, {"loss": loss.detach()}

    losses, grad_norms = [], []
    for step in range(steps):
        ids = torch.randint(0, spec.vocab, (8, 12),
                            generator=torch.Generator().manual_seed(2 + step))
        mine = ids.chunk(dp)[ps.get_data_parallel_rank()]
        stats = trainer.step([{"input_ids": part} for part in mine.chunk(2)], loss_fn)
        value = torch.tensor([stats["loss"]])
        dist.all_reduce(value)
        losses.append(float(value) / world)
        grad_norms.append(stats["grad_norm"])
    weights = trainer.hf_state()
    held = [None] * world
    last = f"layers.{spec.layers - 1}.mlp.experts.local_experts."
    local = sum(1 for name in trainer.local_parameters()
                if last in name and name.endswith("fc1.weight"))
    dist.all_gather_object(held, [trainer.ep_rank, local])
    if rank == world - 1:
        torch.save({"initial": initial, "final": weights}, out + ".pt")
        Path(out).write_text(json.dumps({"losses": losses, "grad_norms": grad_norms,
                                         "experts_by_rank": held}))
    dist.barrier()
    dist.destroy_process_group()
