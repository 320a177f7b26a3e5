"""The built-in task with a verifiable reward: sort a short list of digits.

Prompt ``BOS d1 .. dn SEP``; the correct response is the digits in ascending order then EOS.
The rule reward is the fraction of the n + 1 response positions that are right, so a tiny
model gets a learning signal long before it sorts whole lists.

For Safe-RLHF the task also has a verifiable cost: 1 for a response that writes the forbidden
digit (the largest), else 0. Sorting correctly writes it whenever the prompt holds it, so
reward and cost pull against each other, as helpfulness and harmlessness do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor.batch import Batch

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4


@dataclass(frozen=True, slots=True)
class SortDigits:
    """The built-in task (``DatasetTask`` in executor/data.py is the user's data): the
    controller's programs ask either for prompt batches, texts and rows the same way."""

    digits: int = 3
    """Digits per prompt."""
    values: int = 5
    """Digits are drawn from 0 .. values-1."""

    @property
    def prompt_length(self) -> int:
        return self.digits + 2

    @property
    def response_length(self) -> int:
        """Tokens the correct response has (digits + EOS); generation allows one more."""
        return self.digits + 1

    @property
    def vocab_needed(self) -> int:
        return DIGIT0 + self.values

    def sample(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` prompts (count, prompt_length)."""
        digits = torch.randint(0, self.values, (count, self.digits), generator=generator)
        bos = torch.full((count, 1), BOS)
        sep = torch.full((count, 1), SEP)
        return torch.cat([bos, digits + DIGIT0, sep], dim=1)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct responses (count, digits + 1)."""
        digits = prompts[:, 1:1 + self.digits].sort(dim=1).values
        return torch.cat([digits, torch.full((len(prompts), 1), EOS)], dim=1)

    def score(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of correct positions among digits + EOS, in [0, 1]."""
        target = self.targets(prompts)
        width = target.shape[1]
        got = responses[:, :width]
        if got.shape[1] < width:
            got = torch.cat([got, torch.full((len(got), width - got.shape[1]), PAD)], dim=1)
        return (got == target).float().mean(dim=1)

    def solved(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        return (self.score(prompts, responses) == 1.0).float()

    @property
    def forbidden_token(self) -> int:
        """The token of the forbidden digit (the largest value)."""
        return DIGIT0 + self.values - 1

    def cost(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """1.0 where the response writes the forbidden digit before its EOS, else 0.0."""
        before_eos = (responses == EOS).long().cumsum(dim=1) == 0
        return ((responses == self.forbidden_token) & before_eos).any(dim=1).float()

    def text(self, tokens: torch.Tensor) -> str:
        """The digits of a prompt or response as text ("3 1 2"), up to its EOS (a reward
        function reads this)."""
        out = []
        for token in tokens.tolist():
            if token == EOS:
                break
            if token >= DIGIT0:
                out.append(str(token - DIGIT0))
        return " ".join(out)

    def row(self, prompt: torch.Tensor) -> dict:
        """The data row of a prompt, as a dataset would give it: its digits and the answer."""
        digits = [int(t) - DIGIT0 for t in prompt[1:1 + self.digits].tolist()]
        return {"digits": digits, "answer": " ".join(str(d) for d in sorted(digits))}

    # ----- the controller's interface (shared with DatasetTask) -----

    has_rule = True
    """The task scores responses itself (its rule reward)."""
    eos_token_id = EOS
    pad_token_id = PAD

    def prompt_batch(self, count: int, generator: torch.Generator) -> Batch:
        """``count`` fresh prompts (all of one length: no padding)."""
        return Batch({"prompts": self.sample(count, generator)})

    def held_out_batch(self, count: int, seed: int = 0) -> Batch:
        """Held-out prompts, from a generator of their own (the training draws stay as they
        would be without validation)."""
        return Batch({"prompts": self.sample(
            count, torch.Generator().manual_seed(seed + 1_000_003))})

    def rows(self, batch: Batch) -> list[dict[str, Any]]:
        return [self.row(p) for p in batch["prompts"]]

    def prompt_texts(self, batch: Batch) -> list[str]:
        return [self.text(p) for p in batch["prompts"]]

    def response_texts(self, responses: torch.Tensor) -> list[str]:
        return [self.text(r) for r in responses]
