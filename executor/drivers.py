"""The single-controller programs of PPO, GRPO, ReMax and Safe-RLHF (HybridFlow §4: a few
lines each).

Each iteration reads like the dataflow: generate, score / evaluate, advantages on the
controller, update. Calls on different colocated sets overlap because handles return
``Pending`` results that are collected only when needed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from executor import algorithms as rl
from executor.batch import Batch
from executor.controller import CallRecord, Pending, RoleHandle
from executor.reward_function import score_texts
from executor.task import SortDigits
from simulator.predict import CONTROLLER_LOCATION


@dataclass
class Context:
    """What a driver needs: role handles, the task, the knobs and a place for records."""

    handles: dict[str, RoleHandle]
    task: SortDigits | Any
    """The built-in task, or the user's data (``executor.data.DatasetTask``)."""
    rl: rl.RLConfig
    prompts_per_iteration: int
    samples_per_prompt: int
    reward_from_model: bool
    generator: torch.Generator
    cost_from_model: bool = False
    """Safe-RLHF: a cost model scores responses (else the task's cost rule, on the controller)."""
    multiplier: float = 1.0
    """Safe-RLHF: the current Lagrange multiplier (updated every iteration)."""
    reward_function: Callable[..., Any] | None = None
    """The user's reward function (``reward: rule`` with ``reward_function`` in the job):
    called on the controller with (prompt text, response text, data row)."""
    records: list[CallRecord] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)

    def __getattr__(self, role: str) -> RoleHandle:
        handles = self.__dict__.get("handles", {})
        if role in handles:
            return handles[role]
        raise AttributeError(role)

    def on_controller(self, node: str, role: str, fn: Callable[[], Any],
                      sequences: int = 0) -> Any:
        """Run controller work and record it like a stage."""
        start = time.time()
        value = fn()
        end = time.time()
        self.records.append(CallRecord(
            node=node, role=role, operation="compute" if role == "controller" else "infer",
            location=CONTROLLER_LOCATION, dispatch_start=start, collected=end,
            infos=[{"rank": 0, "start": start, "end": end, "compute_seconds": end - start}],
            sequences=sequences))
        return value


def _scores(ctx: Context, batch: Batch, node: str = "reward.infer") -> tuple[Pending | None,
                                                                          Callable[[], Batch]]:
    """Start scoring ``batch``; returns the pending model call (if any) and a function that
    finishes it into a Batch with ``scores`` (model or rule) and ``rule_scores``."""
    pending = ctx.reward.scores(batch, node=node) if ctx.reward_from_model else None

    def finish() -> Batch:
        # The user's data has no rule of its own: its "rule score" is the reward itself.
        rule = ctx.task.score(batch["prompts"], batch["responses"]) if ctx.task.has_rule \
            else None
        if pending is not None:
            model = pending.result()["model_scores"]
            return Batch({"scores": model, "rule_scores": model if rule is None else rule})
        scored = ctx.on_controller(node, "reward", lambda: _rule_scores(ctx, batch, rule, node),
                                   len(batch))
        return Batch({"scores": scored, "rule_scores": scored if rule is None else rule})

    return pending, finish


def _rule_scores(ctx: Context, batch: Batch, rule: torch.Tensor | None,
                 node: str) -> torch.Tensor:
    """The rule's scores: the user's reward function on the decoded texts when the job
    names one, else the task's own rule."""
    if ctx.reward_function is None:
        assert rule is not None, "a task without a rule needs a reward function or model"
        return rule
    prompts = ctx.task.prompt_texts(batch)
    responses = ctx.task.response_texts(batch["responses"])
    rows = ctx.task.rows(batch)
    return score_texts(ctx.reward_function, prompts, responses, rows, node)


def _costs(ctx: Context, batch: Batch) -> Callable[[], Batch]:
    """Start evaluating the cost of ``batch``; the returned function finishes it into a Batch
    with ``costs`` (model or rule) and ``rule_costs``."""
    pending = ctx.cost.scores(batch, node="cost.infer") if ctx.cost_from_model else None

    def finish() -> Batch:
        rule = ctx.task.cost(batch["prompts"], batch["responses"])
        if pending is not None:
            return Batch({"costs": pending.result()["cost_scores"], "rule_costs": rule})
        costed = ctx.on_controller("cost.infer", "cost", lambda: rule, len(batch))
        return Batch({"costs": costed, "rule_costs": rule})

    return finish


def _pretraining_rows(ctx: Context, count: int) -> Batch:
    """``count`` rows of pretraining data for the actor's ptx loss: prompts with their
    correct responses (the task's 'corpus')."""
    prompts = ctx.task.sample(count, ctx.generator)
    targets = ctx.task.targets(prompts)
    return Batch({"ptx_input_ids": torch.cat([prompts, targets], dim=1),
                  "ptx_mask": torch.ones(targets.shape)})


def _prompts(ctx: Context, iteration: int, repeat: int = 1) -> Batch:
    prompts = ctx.task.prompt_batch(ctx.prompts_per_iteration, ctx.generator)
    return Batch(prompts.tensors, {"iteration": iteration}).repeat(repeat)


def _summary(batch: Batch, extra: dict[str, Any], eos_token_id: int) -> dict[str, Any]:
    """The iteration's metrics: scores and their spread, response lengths (mean, max, the
    share cut off at the length cap), the sampled tokens' entropy estimate and the KL to the
    reference, and what the updates reported (``extra``)."""
    mask = batch["response_mask"]
    lengths = mask.sum(-1).long().tolist()
    counts = {str(n): lengths.count(n) for n in sorted(set(lengths))}
    scores = batch["scores"].float()
    cap = batch["responses"].shape[1]
    # Cut off: it used every allowed token and did not end with EOS.
    ended = batch["responses"].gather(1, (mask.sum(-1).long() - 1).clamp(min=0)[:, None])
    clipped = (mask.sum(-1) == cap) & (ended.squeeze(1) != eos_token_id)
    tokens = mask.sum().clamp(min=1)
    prompt_tokens = batch["prompt_mask"].sum(-1).float() if "prompt_mask" in batch else \
        torch.full((len(batch),), float(batch["prompts"].shape[1]))
    metrics = {"score": float(scores.mean()), "score_std": float(scores.std(unbiased=False)),
               "score_min": float(scores.min()), "score_max": float(scores.max()),
               "rule_score": float(batch["rule_scores"].mean()),
               "solved": float((batch["rule_scores"] == 1.0).float().mean()),
               "prompt_tokens": float(prompt_tokens.mean()),
               "prompt_tokens_max": float(prompt_tokens.max()),
               "response_tokens": float(mask.sum(-1).mean()),
               "response_tokens_max": float(mask.sum(-1).max()),
               "response_clip_ratio": float(clipped.float().mean()),
               # E[-log p(sampled token)] estimates the policy's per-token entropy.
               "entropy_estimate": float(-(batch["old_log_probs"] * mask).sum() / tokens),
               "response_length_counts": json.dumps(counts)}
    if "ref_log_probs" in batch:
        # k1 estimate of KL(actor || reference) per token, on the sampled tokens.
        kl = (batch["old_log_probs"] - batch["ref_log_probs"]) * mask
        metrics["kl_to_reference"] = float(kl.sum() / tokens)
    return {**metrics, **extra}


def ppo_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    batch = ctx.actor.generate(_prompts(ctx, iteration)).result()
    values = ctx.critic.values(batch)      # the three run in parallel where the roles are
    ref = ctx.ref.log_probs(batch)         # on different sets, one after another (in this
    _, finish_scores = _scores(ctx, batch)  # order) where they share GPUs
    batch = batch | ref.result() | values.result() | finish_scores()

    def advantages() -> Batch:
        rewards = rl.kl_penalty_rewards(batch["scores"], batch["old_log_probs"],
                                        batch["ref_log_probs"], batch["response_mask"],
                                        ctx.rl.kl_in_reward)
        adv, returns = rl.gae(rewards, batch["values"], batch["response_mask"],
                              ctx.rl.gamma, ctx.rl.lam)
        return Batch({"advantages": rl.whiten(adv, batch["response_mask"]),
                      "returns": returns})

    batch = batch | ctx.on_controller("advantage", "controller", advantages, len(batch))
    actor, critic = ctx.actor.update(batch), ctx.critic.update(batch)
    return _summary(batch, {**_prefixed("actor", actor.result().meta),
                            **_prefixed("critic", critic.result().meta)}, ctx.task.eos_token_id)


def safe_rlhf_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    """PPO-Lagrangian with a cost model (Safe-RLHF) and the actor's pretraining loss. One
    critic learns the value of the combined score, as in HybridFlow's five-model dataflow
    (Safe-RLHF itself also trains a cost critic)."""
    batch = ctx.actor.generate(_prompts(ctx, iteration)).result()
    values = ctx.critic.values(batch)
    ref = ctx.ref.log_probs(batch)
    _, finish_scores = _scores(ctx, batch)
    finish_costs = _costs(ctx, batch)
    batch = batch | ref.result() | values.result() | finish_scores() | finish_costs()
    multiplier_used = ctx.multiplier

    def advantages() -> Batch:
        ctx.multiplier = rl.update_lagrange(ctx.multiplier, float(batch["costs"].mean()),
                                            ctx.rl.cost_threshold, ctx.rl.lambda_lr,
                                            ctx.rl.lambda_max)
        scores = rl.safe_scores(batch["scores"], batch["costs"], ctx.multiplier)
        rewards = rl.kl_penalty_rewards(scores, batch["old_log_probs"], batch["ref_log_probs"],
                                        batch["response_mask"], ctx.rl.kl_in_reward)
        adv, returns = rl.gae(rewards, batch["values"], batch["response_mask"],
                              ctx.rl.gamma, ctx.rl.lam)
        return Batch({"advantages": rl.whiten(adv, batch["response_mask"]),
                      "returns": returns})

    batch = batch | ctx.on_controller("advantage", "controller", advantages, len(batch))
    actor = ctx.actor.update(batch | _pretraining_rows(ctx, len(batch)))
    critic = ctx.critic.update(batch)
    return _summary(batch, {"cost": float(batch["costs"].mean()),
                            "rule_cost": float(batch["rule_costs"].mean()),
                            "lambda_before": multiplier_used, "lambda": ctx.multiplier,
                            **_prefixed("actor", actor.result().meta),
                            **_prefixed("critic", critic.result().meta)}, ctx.task.eos_token_id)


def grpo_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    batch = ctx.actor.generate(_prompts(ctx, iteration, ctx.samples_per_prompt)).result()
    ref = ctx.ref.log_probs(batch)
    _, finish_scores = _scores(ctx, batch)
    batch = batch | ref.result() | finish_scores()

    def advantages() -> Batch:
        return Batch({"advantages": rl.group_advantages(
            batch["scores"], ctx.samples_per_prompt, batch["response_mask"],
            ctx.rl.group_eps)})

    batch = batch | ctx.on_controller("advantage", "controller", advantages, len(batch))
    actor = ctx.actor.update(batch)
    return _summary(batch, _prefixed("actor", actor.result().meta), ctx.task.eos_token_id)


def remax_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    prompts = _prompts(ctx, iteration)
    sampled = ctx.actor.generate(prompts)
    greedy_prompts = Batch(prompts.tensors, {**prompts.meta, "greedy": True})
    greedy = ctx.actor.generate(greedy_prompts, node="actor.generate_greedy")
    batch, baseline = sampled.result(), greedy.result()
    ref = ctx.ref.log_probs(batch)
    both = Batch.concat([batch.select("prompts", "responses", "input_ids", "response_mask"),
                         baseline.select("prompts", "responses", "input_ids",
                                         "response_mask")])
    _, finish_scores = _scores(ctx, both)
    scored = finish_scores()
    half = len(batch)
    batch = batch | ref.result() | Batch({"scores": scored["scores"][:half],
                                          "rule_scores": scored["rule_scores"][:half]})

    def advantages() -> Batch:
        shaped = rl.kl_penalty_rewards(batch["scores"] - scored["scores"][half:],
                                       batch["old_log_probs"], batch["ref_log_probs"],
                                       batch["response_mask"], ctx.rl.kl_in_reward)
        # REINFORCE with the greedy baseline: the reward to go of every token.
        to_go = shaped.flip(-1).cumsum(-1).flip(-1) * batch["response_mask"]
        return Batch({"advantages": to_go})

    batch = batch | ctx.on_controller("advantage", "controller", advantages, len(batch))
    actor = ctx.actor.update(batch)
    greedy_lengths = baseline["response_mask"].sum(-1).long().tolist()
    return _summary(batch, {"greedy_rule_score": float(scored["rule_scores"][half:].mean()),
                            "greedy_length_counts": json.dumps(
                                {str(n): greedy_lengths.count(n)
                                 for n in sorted(set(greedy_lengths))}),
                            **_prefixed("actor", actor.result().meta)}, ctx.task.eos_token_id)


DRIVERS: dict[str, Callable[[Context, int], dict[str, float]]] = {
    "ppo": ppo_iteration, "grpo": grpo_iteration, "remax": remax_iteration,
    "safe-rlhf": safe_rlhf_iteration,
}


def fit_reward_model(ctx: Context, steps: int, batch_size: int,
                     role: str = "reward") -> list[float]:
    """Fit the reward (or cost) model to the task's rule on random responses (before RL)."""
    losses = []
    task = ctx.task
    rule = task.cost if role == "cost" else task.score
    handle = ctx.handles[role]
    for step in range(steps):
        prompts = task.sample(batch_size, ctx.generator)
        target = task.targets(prompts)
        # Responses between random and correct, so every score level is represented.
        noise = torch.randint(0, task.values, target.shape, generator=ctx.generator) + 4
        keep = torch.rand(target.shape, generator=ctx.generator) < torch.rand(
            (batch_size, 1), generator=ctx.generator)
        responses = torch.where(keep, target, noise)
        mask = torch.ones(responses.shape)
        batch = Batch({"prompts": prompts, "responses": responses,
                       "input_ids": torch.cat([prompts, responses], dim=1),
                       "response_mask": mask, "targets": rule(prompts, responses)},
                      {"prompt_length": prompts.shape[1], "iteration": -1 - step})
        result = handle.fit(batch, node=f"{role}.fit").result()
        losses.append(float(result.meta.get("fit_loss", 0.0)))
    return losses


def _prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    return {f"{prefix}_{k}": float(v) for k, v in metrics.items()}


def validation_scores(ctx: Context, prompts: Batch, iteration: int) -> dict[str, float]:
    """Greedy responses to the held-out prompts, scored by the rule (or the user's reward
    function, or the reward model): the validation reward. Recorded as its own stage,
    outside the iteration."""
    batch = ctx.actor.generate(Batch(prompts.tensors, {"iteration": iteration,
                                                       "greedy": True}),
                               node="actor.validate").result()
    rule = ctx.task.score(batch["prompts"], batch["responses"]) if ctx.task.has_rule \
        else None
    if rule is None and ctx.reward_function is None:
        # A reward model's validation: its scores of the greedy responses.
        scores = ctx.reward.scores(batch, node="reward.validate").result()["model_scores"]
    else:
        scores = _rule_scores(ctx, batch, rule, "actor.validate")
    rule = scores if rule is None else rule
    return {"val_score": float(scores.mean()), "val_rule_score": float(rule.mean()),
            "val_solved": float((rule == 1.0).float().mean())}
