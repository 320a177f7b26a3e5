"""Generation memory and GPU-path costs (issue 11, points 5 and 9): the bucketed micro-DP
transition gives the per-parameter transition's shards and byte counts and frees them on the
way back; decode checks for the end of all sequences only now and then without changing any
output; a KV-cache budget splits a batch into waves."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from executor.generation import (  # noqa: E402
    GenerationEngine,
    SamplingParams,
    kv_cache_bytes,
    shard_for_generation,
    tp_shard_dim,
)
from executor.model import build_model  # noqa: E402
from simulator.specs.presets import MODEL_PRESETS  # noqa: E402
from tests.rank_pool import run_ranks  # noqa: E402

torch.set_num_threads(1)

LOG_PROB_ROUNDING = 1e-5
"""Log-probs of one sequence computed in batches of different sizes (seen: 5e-7 in fp32; the
generation shards and the fp32 log-softmax keep bf16 weights' results within it too)."""

# --- multi-rank transition (gloo, spawned processes) -----------------------------------------

CONFIGS = {
    # world size -> [(name, preset, tp, gen_tp, dp, sharding[, fsdp_size])]
    2: [("tp2-gen1", "tiny-4l", 2, 1, 1, "none"),
        ("gpt-tp2-gen1", "tiny-gpt-2l", 2, 1, 1, "none")],
    4: [("tp4-gen2", "tiny-4l", 4, 2, 1, "none"),
        ("tp4-gen1", "tiny-4l", 4, 1, 1, "none"),
        ("tp2-gen1-fsdp-dp2", "tiny-4l", 2, 1, 2, "fsdp")],
    8: [("tp4-gen2-fsdp-dp2", "tiny-4l", 4, 2, 2, "fsdp"),
        ("tp4-gen1-fsdp-dp2", "tiny-4l", 4, 1, 2, "fsdp"),
        # Hybrid sharding: two groups of two dp ranks (a (replicate, shard, tp) mesh).
        ("tp2-gen1-hsdp-2x2", "tiny-4l", 2, 1, 4, "fsdp", 2)],
}
BUCKETS = {"default": None, "one-byte": 1, "64KiB": 64 * 2**10}
"""Transition bucket sizes: the default (the tiny models fit one bucket), smaller than any
parameter (each parameter alone), and one that groups a few parameters."""



def _per_parameter_transition(hybrid) -> tuple[dict[str, torch.Tensor], int]:
    """The transition as it was before bucketing (one all-gather per parameter, then a cat),
    without aliasing: the reference the bucketed transition must reproduce bit for bit."""
    from torch.distributed.tensor import DTensor, Replicate

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    shards: dict[str, torch.Tensor] = {}
    received = 0
    for name, param in hybrid.trainer.model.named_parameters():
        # In the compute dtype: a trained FSDP model's fp32 master shards are cast first.
        param = param.detach().to(hybrid.trainer.dtype)
        local = param.to_local() if isinstance(param, DTensor) else param
        tp_chunk = local
        if isinstance(param, DTensor) and hybrid.trainer.fsdp:
            placements = [p if mesh_dim == "tp" else Replicate() for mesh_dim, p in
                          zip(param.device_mesh.mesh_dim_names or (), param.placements,
                              strict=True)]
            tp_chunk = param.redistribute(param.device_mesh, placements).to_local()
            received += size(tp_chunk) - size(local)
        dim = tp_shard_dim(name)
        if dim is None or hybrid.micro_dp == 1:
            shards[name] = tp_chunk.clone()
            continue
        parts = [torch.empty_like(tp_chunk) for _ in range(hybrid.micro_dp)]
        dist.all_gather(parts, tp_chunk.contiguous(), group=hybrid.micro_dp_group)
        received += size(tp_chunk) * (hybrid.micro_dp - 1)
        shards[name] = torch.cat(parts, dim=dim)
    return shards, received


def _tensor_attributes(obj: object) -> list[str]:
    """Attributes of ``obj`` that hold tensors (directly or in a list, tuple or dict)."""
    found = []
    for key, value in vars(obj).items():
        values = list(value.values()) if isinstance(value, dict) else \
            list(value) if isinstance(value, list | tuple) else [value]
        if any(isinstance(v, torch.Tensor) for v in values):
            found.append(key)
    return found


def _check_config(name: str, preset: str, tp: int, gen_tp: int, dp: int,
                  sharding: str, fsdp_size: int = 0) -> dict:
    """One layout on this rank: the bucketed transition against the per-parameter one for
    every bucket size, what stays referenced after ``to_training``, and waved generation."""
    from torch.distributed.tensor import DTensor

    from executor.hybrid_engine import HybridEngine
    from executor.trainer import Trainer
    from simulator.specs.parallel import GenerationConfig, ParallelConfig

    spec = MODEL_PRESETS[preset]
    par = ParallelConfig(tp=tp, dp=dp, sharding=sharding, sequence_parallel=False,
                         micro_batch_size=1, fsdp_size=fsdp_size)
    trainer = Trainer(spec, par, value_head=False, seed=0, trainable=True, dtype="bf16")

    def training_locals() -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if isinstance(p, DTensor) else p.detach())
                for n, p in trainer.model.named_parameters()}

    before = {n: t.clone() for n, t in training_locals().items()}
    result: dict = {"name": name, "buckets": {}}
    reference = None
    for label, bucket in BUCKETS.items():
        extra = {} if bucket is None else {"transition_bucket_bytes": bucket}
        hybrid = HybridEngine(trainer, GenerationConfig(tp=gen_tp), **extra)
        if reference is None:
            reference = _per_parameter_transition(hybrid)
        shards, expected_bytes = reference
        calls = []
        gather = dist.all_gather_single

        def counting(*args, calls=calls, gather=gather, **kwargs):
            calls.append(1)
            return gather(*args, **kwargs)

        dist.all_gather_single = counting
        try:
            record = hybrid.to_generation()
        finally:
            dist.all_gather_single = gather
        weights = hybrid.engine.weights
        # Whatever the training layout, a one-GPU generation engine holds whole tensors.
        whole = {n: tuple(p.shape) for n, p in build_model(spec).named_parameters()}
        result["whole_tensors"] = gen_tp > 1 or all(
            tuple(weights[n].shape) == whole[n] for n in whole)
        same = sorted(weights) == sorted(shards) and all(
            weights[n].dtype == shards[n].dtype and torch.equal(weights[n], shards[n])
            for n in shards)
        # The training shards still read their values while they are views.
        training_intact = all(torch.equal(t, before[n]) for n, t in training_locals().items())
        gathered = [n for n in weights if tp_shard_dim(n) is not None and hybrid.micro_dp > 1]
        refs = [weakref.ref(weights[n]) for n in gathered]
        storages = {weights[n].untyped_storage().data_ptr() for n in gathered}
        del weights
        hybrid.to_training()
        gc.collect()
        result["buckets"][label] = {
            "same_shards": same, "bytes": record.bytes_received_per_gpu,
            "expected_bytes": expected_bytes,
            "peak": record.peak_param_bytes_per_gpu,
            "generation": record.generation_param_bytes,
            "training": record.training_param_bytes,
            "training_intact": training_intact,
            "training_intact_after": all(torch.equal(t, before[n])
                                         for n, t in training_locals().items()),
            "gathered": len(gathered), "collectives": len(calls),
            "shards_alive": sum(r() is not None for r in refs),
            "storage_shared_after": sum(t.untyped_storage().data_ptr() in storages
                                        for t in training_locals().values()),
            "engine_tensors": _tensor_attributes(hybrid.engine),
            "hybrid_tensors": _tensor_attributes(hybrid),
        }
    # Generation across the generation tp group: waves of one sequence (a budget that fits one)
    # and a finish check every 16 steps give the greedy output of one wave checked every step.
    hybrid = HybridEngine(trainer, GenerationConfig(tp=gen_tp))
    hybrid.to_generation()
    prompts = torch.randint(4, 14, (3, 4), generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(max_new_tokens=6, eos_token_id=2, greedy=True)
    whole = hybrid.engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    hybrid.engine.kv_cache_budget_bytes = hybrid.engine.sequence_kv_cache_bytes(10)
    hybrid.engine.finish_check_interval_steps = 16
    waved = hybrid.engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    hybrid.to_training()
    result["waves_same"] = (torch.equal(whole.responses, waved.responses)
                            and torch.equal(whole.lengths, waved.lengths)
                            and torch.allclose(whole.log_probs, waved.log_probs, rtol=0,
                                               atol=LOG_PROB_ROUNDING))
    result["budget_threaded"] = HybridEngine(
        trainer, GenerationConfig(tp=gen_tp), kv_cache_budget_bytes=12345
    ).engine.kv_cache_budget_bytes == 12345
    return result


def transition_worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    """Every layout of ``CONFIGS[world]`` on this rank; rank 0 writes all ranks' results."""
    from executor.device import clear_meshes
    from tests.trainer_workers import join

    join(rank, world, rendezvous)
    results = [_check_config(*config) for config in CONFIGS[world]]
    rows: list = [None] * world
    dist.all_gather_object(rows, results)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()  # no rank leaves while a peer still talks to it
    clear_meshes()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_bucketed_transition_gives_the_per_parameter_shards_and_bytes(
        world: int, tmp_path: Path) -> None:
    """(tp, gen_tp) = (2, 1), (4, 2), (4, 1), with and without FSDP, every bucket size: the
    same generation shards bit for bit and the same bytes received as one all-gather per
    parameter; zero redundancy without FSDP; nothing of the generation side left after
    ``to_training``; waved generation over the generation tp group."""
    from simulator.costs.transition import transition_volume_bytes

    out = tmp_path / "result.json"
    from tests.trainer_workers import fresh_rendezvous

    run_ranks(transition_worker, (world, fresh_rendezvous(tmp_path), str(out)), world)
    rows = json.loads(out.read_text())
    for rank_results in rows:
        for config, result in zip(CONFIGS[world], rank_results, strict=True):
            name, preset, tp, gen_tp, _, sharding, *_ = config
            assert result["waves_same"], name
            assert result["whole_tensors"], name
            assert result["budget_threaded"], name
            counts = {label: got["collectives"] for label, got in result["buckets"].items()}
            # The tiny models fit one default bucket; one byte is one parameter per gather.
            assert counts["default"] == 1, name
            assert counts["one-byte"] == result["buckets"]["one-byte"]["gathered"], name
            assert 1 < counts["64KiB"] < counts["one-byte"], name
            for label, got in result["buckets"].items():
                where = f"{name}, bucket {label}"
                assert got["same_shards"], where
                assert got["bytes"] == got["expected_bytes"], where
                assert got["training_intact"] and got["training_intact_after"], where
                assert got["gathered"] > 0, where
                assert got["shards_alive"] == 0, where
                assert got["storage_shared_after"] == 0, where
                assert got["engine_tensors"] == [] and got["hybrid_tensors"] == [], where
                if sharding == "none":
                    # Zero redundancy: the training shards live inside the generation shards.
                    assert got["peak"] == got["generation"], where
                    model = build_model(MODEL_PRESETS[preset])
                    sharded = sum(p.numel() * 2 for n, p in model.named_parameters()
                                  if tp_shard_dim(n) is not None)
                    assert got["bytes"] == pytest.approx(transition_volume_bytes(
                        "micro_dp", sharded, train_shards=tp, gen_shards=gen_tp, world=tp))
                else:
                    assert got["peak"] == got["generation"] + got["training"], where


# --- decode: the finish check ----------------------------------------------------------------

def _engine(preset: str = "tiny-2l", seed: int = 1, **kwargs) -> GenerationEngine:
    spec = MODEL_PRESETS[preset]
    engine = GenerationEngine(spec, **kwargs)
    engine.load({n: p.detach() for n, p in build_model(spec, seed=seed).named_parameters()})
    return engine


def _early_eos(engine: GenerationEngine, prompts: torch.Tensor,
               params: SamplingParams) -> tuple[int, int, int]:
    """(EOS, seed, step): a token that, made the EOS, ends every sequence sampled with that
    generator seed by that step, well before the first periodic check (step 15)."""
    free = SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__},
                             "eos_token_id": -1})
    for seed in range(50):
        out = engine.generate(prompts, free, torch.Generator().manual_seed(seed))
        for token in range(engine.spec.vocab):
            hits = [(row == token).nonzero() for row in out.responses]
            if all(len(h) for h in hits) and max(int(h[0]) for h in hits) < 12:
                return token, seed, max(int(h[0]) for h in hits)
    raise AssertionError("no seed ends every sequence early: the test needs one")


@pytest.mark.parametrize(("greedy", "batch"), [(False, 3), (True, 1)])
def test_checking_for_the_end_every_few_steps_changes_no_output(greedy: bool,
                                                                batch: int) -> None:
    prompts = torch.randint(4, 14, (batch, 5), generator=torch.Generator().manual_seed(0))
    base = SamplingParams(max_new_tokens=40, eos_token_id=-1, greedy=greedy)
    eos, seed, ended_by = _early_eos(_engine(), prompts, base)
    params = SamplingParams(max_new_tokens=40, eos_token_id=eos, greedy=greedy)
    every_step = _engine(finish_check_interval_steps=1).generate(
        prompts, params, torch.Generator().manual_seed(seed))
    assert every_step.lengths.max() == ended_by + 1
    for interval in (3, 5, 16, 64):
        out = _engine(finish_check_interval_steps=interval).generate(
            prompts, params, torch.Generator().manual_seed(seed))
        assert torch.equal(out.responses, every_step.responses), interval
        assert torch.equal(out.log_probs, every_step.log_probs), interval
        assert torch.equal(out.lengths, every_step.lengths), interval


def test_the_cpu_checks_every_step_and_accelerators_every_sixteenth() -> None:
    """The default interval: None, resolved by the weights' device when generating."""
    from executor.generation import FINISH_CHECK_INTERVAL_STEPS

    assert FINISH_CHECK_INTERVAL_STEPS == 16
    assert _engine().finish_check_interval_steps is None
    with pytest.raises(ValueError, match="finish_check_interval_steps=0"):
        GenerationEngine(MODEL_PRESETS["tiny-2l"], finish_check_interval_steps=0)


# --- KV-cache budget ---------------------------------------------------------------------------

def test_kv_cache_bytes_is_k_and_v_of_every_layer_and_local_head() -> None:
    spec = MODEL_PRESETS["tiny-2l"]  # 2 layers, 2 kv heads of 16 dimensions
    assert spec.head_dim_value == 16 and spec.kv_heads == 2
    # By hand: 2 layers x (K, V) x 3 sequences x 2 heads x 10 tokens x 16 x 4 bytes (fp32).
    assert kv_cache_bytes(layers=2, sequences=3, kv_heads=2, tokens=10, head_dim=16,
                          element_bytes=4) == 2 * 2 * 3 * 2 * 10 * 16 * 4 == 15360
    engine = _engine()
    assert engine.sequence_kv_cache_bytes(10) == 5120
    # The simulator's count per token, unsharded, in the same dtype.
    assert engine.sequence_kv_cache_bytes(10) == 10 * spec.kv_cache_bytes_per_token(4)
    # A tp 2 shard holds one of the two kv heads.
    weights = {n: p.detach() for n, p in build_model(spec).named_parameters()}
    half = GenerationEngine(spec, tp_size=2, tp_rank=1)
    half.load(shard_for_generation(weights, 2, 1))
    assert half.sequence_kv_cache_bytes(10) == 2560


def _record_waves(engine: GenerationEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    inner = engine._generate_wave

    def recording(prompts, params, generator, prompt_mask=None):
        sizes.append(prompts.shape[0])
        return inner(prompts, params, generator, prompt_mask)

    monkeypatch.setattr(engine, "_generate_wave", recording)
    return sizes


@pytest.mark.parametrize("preset", ["tiny-2l", "tiny-gpt-2l"])
def test_waves_under_a_kv_budget_give_one_waves_greedy_output(
        preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = torch.randint(4, 14, (5, 6), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_new_tokens=8, eos_token_id=2, greedy=True)
    whole = _engine(preset).generate(prompts, params, torch.Generator().manual_seed(0))
    engine = _engine(preset)
    one = engine.sequence_kv_cache_bytes(14)
    engine.kv_cache_budget_bytes = 2 * one + one // 2  # room for two sequences, not three
    sizes = _record_waves(engine, monkeypatch)
    waved = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert sizes == [2, 2, 1]
    assert torch.equal(waved.responses, whole.responses)
    assert torch.equal(waved.lengths, whole.lengths)
    # Matrix kernels may sum in another order for another batch size: last-bit differences.
    assert torch.allclose(waved.log_probs, whole.log_probs, rtol=0, atol=LOG_PROB_ROUNDING)
    # A budget that holds the batch is one wave; exactly one sequence's bytes is waves of 1.
    engine.kv_cache_budget_bytes = 5 * one
    engine.generate(prompts, params, torch.Generator().manual_seed(0))
    engine.kv_cache_budget_bytes = one
    engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert sizes == [2, 2, 1, 5, 1, 1, 1, 1, 1]


def test_sampled_waves_are_one_wave_each_seeded_from_the_generator() -> None:
    """Sampled outputs under a budget: each wave draws from its own generator, seeded by one
    draw per wave from the caller's, so a wave is what that wave alone gives with its seed."""
    prompts = torch.randint(4, 14, (5, 6), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_new_tokens=8, eos_token_id=2, temperature=1.0, top_p=0.9)
    engine = _engine()
    engine.kv_cache_budget_bytes = 2 * engine.sequence_kv_cache_bytes(14)
    waved = engine.generate(prompts, params, torch.Generator().manual_seed(7))
    again = engine.generate(prompts, params, torch.Generator().manual_seed(7))
    assert torch.equal(waved.responses, again.responses)
    seeds = torch.randint(0, 2**62, (3,), generator=torch.Generator().manual_seed(7)).tolist()
    alone = _engine()
    for index, seed in enumerate(seeds):
        rows = slice(2 * index, 2 * index + 2)
        expected = alone.generate(prompts[rows], params, torch.Generator().manual_seed(seed))
        assert torch.equal(waved.responses[rows], expected.responses)
        assert torch.equal(waved.log_probs[rows], expected.log_probs)
        assert torch.equal(waved.lengths[rows], expected.lengths)


def test_a_budget_smaller_than_one_sequence_names_both_numbers() -> None:
    engine = _engine()
    one = engine.sequence_kv_cache_bytes(6 + 8)
    engine.kv_cache_budget_bytes = one - 1
    prompts = torch.randint(4, 14, (2, 6))
    with pytest.raises(ValueError, match=rf"kv_cache_budget_bytes={one - 1} .*: {one} bytes"):
        engine.generate(prompts, SamplingParams(max_new_tokens=8, eos_token_id=2),
                        torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="kv_cache_budget_bytes=-1 is negative"):
        GenerationEngine(MODEL_PRESETS["tiny-2l"], kv_cache_budget_bytes=-1)


def test_make_engine_threads_the_budget_to_both_backends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.backends.vllm import CPU_KV_CACHE_BYTES
    from executor.hybrid_engine import make_engine
    from simulator.specs.parallel import GenerationConfig

    # VLLMEngine sets process environment variables: keep them out of this process's.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    spec = MODEL_PRESETS["tiny-2l-hd32"]
    gen = GenerationConfig(tp=1)
    native = make_engine(spec, gen, "native", seed=0, tp_group=None, tp_rank=0,
                         kv_cache_budget_bytes=4096)
    assert isinstance(native, GenerationEngine) and native.kv_cache_budget_bytes == 4096
    default = make_engine(spec, gen, "native", seed=0, tp_group=None, tp_rank=0)
    assert default.kv_cache_budget_bytes is None
    pytest.importorskip("vllm")
    import executor.hybrid_engine as hybrid_engine

    # On GPUs the plan's budget is vLLM's KV-cache size.
    monkeypatch.setattr(hybrid_engine, "has_gpu", lambda: True)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    planned = make_engine(spec, gen, "vllm", seed=0, tp_group=None, tp_rank=0,
                          kv_cache_budget_bytes=8 * 2**20)
    assert planned.settings["kv_cache_memory_bytes"] == 8 * 2**20
    if not torch.cuda.is_available():
        # vLLM's CPU platform would replace the budget by this legacy variable's GiB.
        assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    # Without a GPU the budget is a GPU profile's and all virtual GPUs share this host:
    # vLLM keeps its CPU sizing.
    monkeypatch.setattr(hybrid_engine, "has_gpu", lambda: False)
    on_cpu = make_engine(spec, gen, "vllm", seed=0, tp_group=None, tp_rank=0,
                         kv_cache_budget_bytes=8 * 2**20)
    unplanned = make_engine(spec, gen, "vllm", seed=0, tp_group=None, tp_rank=0)
    if not torch.cuda.is_available():
        assert on_cpu.settings["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
        assert unplanned.settings["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    else:
        assert "kv_cache_memory_bytes" not in unplanned.settings
