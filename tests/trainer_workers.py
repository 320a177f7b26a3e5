"""Process bodies of the torch-backend trainer tests (module level, so that spawn can import
them; ``tests.rank_pool.run_ranks`` runs them): each process joins a gloo group, builds one
role with the plan's layout and dtype and writes what it holds or computed to a JSON file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def fresh_rendezvous(directory: Path) -> str:
    """A new file for one process group's rendezvous (a file store: no port to race for)."""
    directory.mkdir(parents=True, exist_ok=True)
    return str(Path(tempfile.mkdtemp(dir=directory)) / "rendezvous")


def join(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)


def finish(rank: int, world: int, result: dict, out: str) -> None:
    """Every rank's ``result`` into ``out`` (a JSON list by rank), then leave together."""
    rows = [None] * world
    dist.all_gather_object(rows, result)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(rows, handle)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def train_and_measure(rank: int, world: int, rendezvous: str, layout: dict,
                      out: str) -> None:
    """One role on ``world`` ranks: its state bytes after building and after two steps, the
    dtypes its weights and outputs have, and the losses and log-probs it computed."""
    from executor.trainer import OptimConfig, Trainer
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    join(rank, world, rendezvous)
    spec = MODEL_PRESETS[layout["preset"]]
    par = ParallelConfig(tp=layout["tp"], dp=layout["dp"], sharding=layout["sharding"],
                         sequence_parallel=False, micro_batch_size=2,
                         fsdp_size=layout.get("fsdp_size", 0))
    value_head = layout["value_head"]
    trainer = Trainer(spec, par, value_head=value_head, seed=0, trainable=layout["trainable"],
                      optim=OptimConfig(lr=1e-3), dtype=layout["dtype"])
    built = trainer.state_bytes()
    ids = torch.randint(0, spec.vocab, (2 * max(2, par.dp), 9),
                        generator=torch.Generator().manual_seed(1))
    mine = ids[trainer.dp_rank * 2:(trainer.dp_rank + 1) * 2]

    def loss_fn(model: Trainer, batch: dict) -> tuple[torch.Tensor, dict]:
        out = (model.token_values(batch["input_ids"]) if value_head
               else model.token_log_probs(batch["input_ids"]))
        assert out.dtype == torch.float32, "log-prob / value math must run in fp32"
        loss = out.pow(2).mean() if value_head else -out.mean()
        return loss, {"loss": loss.detach()}

    losses = []
    offloaded_bytes = None
    if layout["trainable"]:
        for step in range(2):
            losses.append(trainer.step([{"input_ids": mine[:1]}, {"input_ids": mine[1:]}],
                                       loss_fn)["loss"])
            if step == 0 and layout.get("offload"):
                # As around a generation: training states to host memory and back.
                before = trainer.state_bytes()
                offloaded_bytes = {"moved": trainer.offload(optimizer=True, grads=True),
                                   "expected": before["optimizer"] + before["grads"]}
                trainer.reload()
    inferred = trainer.infer(ids, 2, values=value_head)
    weight_dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    result = {"built": built, "trained": trainer.state_bytes(), "losses": losses,
              "offloaded": offloaded_bytes,
              "weight_dtypes": weight_dtypes, "output_dtype": str(inferred.dtype),
              "inferred": inferred.tolist()}
    finish(rank, world, result, out)


def build_and_report(rank: int, world: int, rendezvous: str, layout: dict,
                     out: str) -> None:
    """Build one role (optionally from a checkpoint) and report how: the device its modules
    were created on, how many whole tensors were alive at once on the host, the rank's
    shard of every parameter, and its state bytes."""
    import weakref
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from executor import model as model_module
    from executor.trainer import Trainer
    from simulator.specs.parallel import ParallelConfig
    from simulator.specs.presets import MODEL_PRESETS

    join(rank, world, rendezvous)
    created_on: list[str] = []
    alive: list[weakref.ref] = []
    most_alive = [0]
    original_init = model_module.CausalLM.__init__
    original_get = model_module.InitialWeights.__getitem__

    def recording_init(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        created_on.append(next(self.parameters()).device.type)

    def recording_get(self, name: str) -> torch.Tensor:
        whole = original_get(self, name)
        alive[:] = [ref for ref in alive if ref() is not None]
        alive.append(weakref.ref(whole))
        most_alive[0] = max(most_alive[0], len(alive))
        return whole

    # Patched for this body only: the process runs the next test's body too (tests.rank_pool).
    with mock.patch.object(model_module.CausalLM, "__init__", recording_init), \
            mock.patch.object(model_module.InitialWeights, "__getitem__", recording_get):
        spec = MODEL_PRESETS[layout["preset"]]
        par = ParallelConfig(tp=layout["tp"], dp=layout["dp"], sharding=layout["sharding"],
                             sequence_parallel=False)
        trainer = Trainer(spec, par, value_head=False, seed=0, trainable=False,
                          checkpoint=layout.get("checkpoint"), dtype="fp32")
        # Reassembled from every rank's shard, each tensor must be the checkpoint's (or the
        # seeded initial) tensor.
        reference = model_module.InitialWeights(spec, seed=0, checkpoint=layout.get("checkpoint"))
        errors = {}
        for name, param in trainer.model.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            errors[name] = float((whole.detach() - original_get(reference, name)).abs().max())
        finish(rank, world, {"created_on": created_on, "most_whole_tensors_alive": most_alive[0],
                             "state": trainer.state_bytes(), "errors": errors}, out)
