"""RL numerics in one place, independent of any backend: advantages (GAE, group-normalised,
greedy baseline), the clipped policy loss, the clipped value loss and KL estimates.

Token tensors are (batch, response_tokens) over the response positions only; ``mask`` is 1 on
real response tokens (up to and including EOS) and 0 on padding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from profiles.datafile import require


@dataclass(frozen=True, slots=True)
class RLConfig:
    """Hyper-parameters of the built-in algorithms (defaults suit the tiny CPU task)."""

    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 0.95
    """GAE's lambda."""
    clip_ratio: float = 0.2
    """PPO's policy clipping epsilon."""
    value_clip: float = 0.2
    """Clipping of the value prediction around the old value (PPO)."""
    kl_coef: float = 0.02
    """Weight of the KL penalty against the reference policy."""
    kl_mode: Literal["reward", "loss"] | None = None
    """'reward': subtract coef * KL from the per-token reward; 'loss': add coef * KL (k3
    estimator) to the policy loss; None: the algorithm's own choice (loss for GRPO, reward
    for the others)."""
    group_eps: float = 1e-6
    """Added to the group's reward std in GRPO."""
    cost_threshold: float = 0.2
    """Safe-RLHF: the largest mean episode cost the policy may have (d)."""
    lambda_init: float = 1.0
    """Safe-RLHF: the Lagrange multiplier's initial value."""
    lambda_lr: float = 0.5
    """Safe-RLHF: step size of the multiplier's update in log space."""
    lambda_max: float = 10.0
    """Safe-RLHF: upper bound of the multiplier (Safe-RLHF clamps ln(lambda) likewise); keeps
    the update finite when the cost stays above the threshold."""
    ptx_coef: float = 0.1
    """Safe-RLHF: weight of the actor's pretraining (language-modelling) loss."""

    def __post_init__(self) -> None:
        for key in ("gamma", "lam"):
            require(0.0 <= getattr(self, key) <= 1.0, "must be in [0, 1]", key)
        for key in ("clip_ratio", "value_clip", "group_eps"):
            require(getattr(self, key) > 0, "must be positive", key)
        for key in ("kl_coef", "cost_threshold", "lambda_init", "lambda_lr",
                    "ptx_coef"):
            require(getattr(self, key) >= 0, "must be zero or positive", key)
        require(self.lambda_max > 0, "must be positive", "lambda_max")
        require(self.lambda_init <= self.lambda_max, "must be at most lambda_max",
                "lambda_init")

    def resolved(self, algorithm: str) -> RLConfig:
        """This config with the algorithm's defaults filled in (where the KL term goes)."""
        if self.kl_mode is not None:
            return self
        mode = "loss" if algorithm == "grpo" else "reward"
        return dataclasses.replace(self, kl_mode=mode)

    @property
    def kl_in_reward(self) -> float:
        """The KL coefficient applied in the reward (0 when the KL is a loss term)."""
        return self.kl_coef if self.kl_mode != "loss" else 0.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_penalty_rewards(scores: torch.Tensor, log_probs: torch.Tensor,
                       ref_log_probs: torch.Tensor, mask: torch.Tensor,
                       kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -coef * (log pi - log pi_ref) everywhere, plus the sequence score on
    the last real token."""
    rewards = -kl_coef * (log_probs - ref_log_probs) * mask
    last = mask.sum(-1).long().clamp(min=1) - 1
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens: (advantages, returns). The value
    after the last real token is 0 (episode ends)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], device=rewards.device)
    steps = rewards.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < steps else torch.zeros_like(
            running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running * (mask[:, t + 1] if t + 1 < steps else 0.0)
        advantages[:, t] = running * mask[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def group_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's score normalised within its prompt's group (consecutive rows),
    spread over its tokens."""
    grouped = scores.view(-1, group_size)
    normalised = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True)
                                                               + eps)
    return normalised.view(-1, 1) * mask


def baseline_advantages(scores: torch.Tensor, baseline_scores: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """ReMax: the sampled response's score minus its greedy response's score."""
    return (scores - baseline_scores).view(-1, 1) * mask


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (to minimise) and the fraction of clipped tokens."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    clip_fraction = masked_mean((unclipped > clipped).float(), mask)
    return loss, {"clip_fraction": float(clip_fraction)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float) -> torch.Tensor:
    """Clipped value loss: max of the squared errors of the new and the clipped prediction."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2),
                             mask)


def update_lagrange(multiplier: float, mean_cost: float, threshold: float, lr: float,
                    maximum: float = math.inf) -> float:
    """Safe-RLHF's multiplier step (Dai et al. 2023, arXiv 2310.12773): gradient ascent on
    ln(lambda) of lambda * (J_C - d), so lambda grows while the mean cost exceeds the threshold,
    shrinks while it is below, and stays positive; clamped to ``maximum``."""
    if multiplier <= 0.0:
        return 0.0
    log_step = lr * multiplier * (mean_cost - threshold)
    if math.log(maximum) - math.log(multiplier) <= log_step:
        return maximum
    return multiplier * math.exp(log_step)


def safe_scores(scores: torch.Tensor, costs: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The sequence score the policy maximises under the constraint: (r - lambda c) / (1 +
    lambda) (Safe-RLHF's normalisation, which keeps the scale of the reward)."""
    return (scores - multiplier * costs) / (1.0 + multiplier)


def language_model_loss(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens (the pretraining / ptx loss)."""
    return -masked_mean(log_probs, mask)


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(r) - r - 1 with r = log ref - log pi (>= 0)."""
    r = ref_log_probs - log_probs
    return torch.exp(r) - r - 1
