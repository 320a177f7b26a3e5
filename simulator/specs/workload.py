"""Workload: how much data one RLHF iteration processes, and in which precision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from profiles.datafile import require
from simulator.specs.lengths import LengthDistribution, parse_lengths

MAX_SEQUENCES_PER_ITERATION = 16_777_216
"""Most responses one iteration may generate (prompts x samples per prompt), 2^24. Above 8,192
responses per generation replica the decode is priced by a fluid model whose cost does not
grow with the batch (``simulator/costs/generation.py``), so the limit only keeps token counts
in a sane range: PPO 4 x 70B on 128 GPUs with 1,000,000 responses plans in seconds (``make
bench``). Published RLHF recipes stay far below it (verl's DAPO example: 512 prompts x 16
samples = 8,192)."""

MAX_SEQUENCE_TOKENS = 2**24
"""Longest prompt + response one sequence may have, in tokens (16,777,216): above the longest
context window a released model has (Llama 4 Scout, 10M tokens: Meta, "The Llama 4 herd",
April 2025), so a larger number is a typo, not a workload."""

DEFAULT_TRAIN_MICRO_BATCH_SIZE = 2
"""Sequences per GPU per training micro-batch of a plan built without a search (``simulate``
with no plan) when the workload gives none: the HybridFlow paper's PPO setting's value."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    """One iteration's data. Token counts are per sequence; batch counts are per iteration."""

    prompts_per_iteration: int = 1024
    """Prompts drawn per iteration (the paper's 'global batch' of prompts)."""
    prompt_length: int = 1024
    """Prompt length in tokens (prompts are padded/truncated to it)."""
    response_length: LengthDistribution = field(
        default_factory=lambda: LengthDistribution.fixed(1024),
        metadata={"parse": parse_lengths},
    )
    """Response length in tokens: an integer, or a distribution mapping (see docs/job-file.md)."""
    greedy_response_length: LengthDistribution | None = field(
        default=None, metadata={"parse": parse_lengths})
    """Lengths of greedy responses (ReMax's baseline), if they differ from
    ``response_length`` (default: the same distribution)."""
    generated_prompts_per_iteration: int | None = None
    """Prompts generated (and scored) per iteration when more are generated than trained on:
    dynamic sampling (DAPO's group filtering, verl's algorithm.filter_groups, OpenRLHF's
    dynamic filtering) drops the groups whose rewards do not differ and generates more until
    ``prompts_per_iteration`` groups remain; give the average it generates per step (e.g.
    prompts_per_iteration / the fraction kept). Left out: as ``prompts_per_iteration``."""
    samples_per_prompt: int = 1
    """Responses generated per prompt (GRPO's group size; 1 for PPO)."""
    ppo_epochs: int = 1
    """Passes over the iteration's experience in training."""
    mini_batches_per_epoch: int = 8
    """Optimizer steps per epoch (the experience is split into this many mini-batches)."""
    train_micro_batch_size: int | None = None
    """Sequences per GPU per forward/backward in training. Given, every trained role trains at
    it (``parallel.ROLE.micro_batch_size`` overrides it for one role) and the search does not
    change it; absent (null), the search chooses (1, 2, 4 sequences, or a token budget where
    the framework forms micro-batches by tokens) and a plan built without a search uses
    ``DEFAULT_TRAIN_MICRO_BATCH_SIZE``."""
    infer_micro_batch_size: int = 8
    """Sequences per GPU per forward in inference (critic values, reference, reward)."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Compute and weight precision; training keeps fp32 master weights and Adam states
    (fp32: everything in single precision, as the executor runs on CPUs)."""
    controller_seconds_per_sample: float = 1e-5
    """Controller CPU time per sequence for advantage computation (assumed; GAE over a few
    thousand tokens is microseconds of vectorised work)."""
    rule_reward_seconds_per_sample: float = 1e-3
    """Controller CPU time per sequence for a rule-based reward (assumed; a regex/parse check).
    Set it from a measurement of your own rule."""

    def __post_init__(self) -> None:
        for key in ("prompts_per_iteration", "prompt_length", "samples_per_prompt",
                    "ppo_epochs", "mini_batches_per_epoch", "train_micro_batch_size",
                    "infer_micro_batch_size"):
            value = getattr(self, key)
            if value is None and key == "train_micro_batch_size":
                continue
            require(value > 0, f"must be a positive integer, got {value}", key)
        require(self.controller_seconds_per_sample >= 0, "must be >= 0",
                "controller_seconds_per_sample")
        require(self.rule_reward_seconds_per_sample >= 0, "must be >= 0",
                "rule_reward_seconds_per_sample")
        for key, tokens in (("prompt_length", self.prompt_length),
                            ("response_length", self.response_length.max_tokens)):
            require(tokens <= MAX_SEQUENCE_TOKENS,
                    f"{tokens} tokens is above the planner's limit of {MAX_SEQUENCE_TOKENS} "
                    "per sequence (longer than any model's context window)", key)
        require(self.max_sequence_tokens <= MAX_SEQUENCE_TOKENS,
                f"prompt and response together are {self.max_sequence_tokens} tokens, above "
                f"the planner's limit of {MAX_SEQUENCE_TOKENS} per sequence", "response_length")
        sequences = self.prompts_per_iteration * self.samples_per_prompt
        require(sequences <= MAX_SEQUENCES_PER_ITERATION,
                f"{self.prompts_per_iteration} prompts x {self.samples_per_prompt} sample(s) = "
                f"{sequences} sequences per iteration is above the planner's limit of "
                f"{MAX_SEQUENCES_PER_ITERATION}; "
                "plan a smaller batch",
                "prompts_per_iteration")
        if self.generated_prompts_per_iteration is not None:
            require(self.generated_prompts_per_iteration >= self.prompts_per_iteration,
                    f"must be at least prompts_per_iteration ({self.prompts_per_iteration}): "
                    "the trained prompts are among the generated ones, got "
                    f"{self.generated_prompts_per_iteration}", "generated_prompts_per_iteration")
            require(self.generated_prompts_per_iteration * self.samples_per_prompt
                    <= MAX_SEQUENCES_PER_ITERATION,
                    f"above the planner's limit of {MAX_SEQUENCES_PER_ITERATION} sequences per "
                    "iteration", "generated_prompts_per_iteration")
        require(sequences >= self.mini_batches_per_epoch,
                f"{sequences} sequences per iteration cannot be split into "
                f"{self.mini_batches_per_epoch} mini-batches", "mini_batches_per_epoch")

    @property
    def sequences_per_iteration(self) -> int:
        """Responses generated per iteration (prompts x samples per prompt)."""
        return self.prompts_per_iteration * self.samples_per_prompt

    @property
    def generated_prompts(self) -> int:
        """Prompts generated and scored per iteration (dynamic sampling: more than trained)."""
        return self.generated_prompts_per_iteration or self.prompts_per_iteration

    @property
    def generates_more_than_it_trains(self) -> bool:
        """Dynamic sampling: the scores filter the batch before the other passes read it."""
        return self.generated_prompts > self.prompts_per_iteration

    @property
    def max_sequence_tokens(self) -> int:
        """Longest prompt + response, in tokens."""
        return self.prompt_length + self.response_length.max_tokens

    def mean_sequence_tokens(self) -> float:
        """Mean prompt + response length, in tokens."""
        return self.prompt_length + self.response_length.mean_tokens()

    def tokens_per_iteration(self) -> float:
        """Prompt + response tokens of all sequences of one iteration (the paper's throughput
        numerator)."""
        return self.sequences_per_iteration * self.mean_sequence_tokens()
