"""The backend interface every training and generation engine implements, and the registry
a job's ``backends:`` section chooses from (per role)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from executor.generation import GenerationEngine, GenerationOutput, SamplingParams
from executor.trainer import Trainer
from profiles.datafile import SpecError


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


@runtime_checkable
class GenerationBackend(Protocol):
    """Imports weight shards and generates responses with per-token log-probs."""

    def load(self, weights: dict[str, torch.Tensor]) -> None: ...

    def unload(self) -> None: ...

    def generate(self, prompts: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator) -> GenerationOutput: ...


TRAINING_BACKENDS: dict[str, type] = {"torch": Trainer}
GENERATION_BACKENDS: dict[str, type] = {"native": GenerationEngine}
PLANNED = {"megatron": "Megatron-core training", "vllm": "vLLM generation"}


def check_available(role: str, training: str, generation: str) -> None:
    """Raise SpecError naming the role if it asks for a backend this build does not have."""
    for kind, name, registry in (("training", training, TRAINING_BACKENDS),
                                 ("generation", generation, GENERATION_BACKENDS)):
        if name not in registry:
            what = PLANNED.get(name, name)
            raise SpecError(f"{what} is not available in this version of the executor "
                            f"(available: {', '.join(registry)})",
                            key=f"backends.{role}.{kind}")
