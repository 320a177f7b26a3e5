"""The single-controller programs of PPO, GRPO, ReMax and Safe-RLHF (HybridFlow §4: a few
lines each).

Each iteration reads like the dataflow: generate, score / evaluate, advantages on the
controller, update. Calls on different colocated sets overlap because handles return
``Pending`` results that are collected only when needed.

One-step-off plans (``mode: one_step_off``) run the same programs with the generation moved
to the rollout set and one batch ahead (``_rollout``): iteration i takes batch i, generated
during iteration i - 1 (iteration 0 generates its batch first), launches batch i + 1 on the
rollout set at once, trains on batch i meanwhile, waits for batch i + 1, and syncs the
trainer's weights to the rollout set (``sync_weights``). Batch i + 1 is thus generated with
the weights after update i - 1: staleness 1.

The log-prob correction is the recomputation of the old log-probs (verl does the same in
every mode): the trainer's actor computes the sampled tokens' log-probs with its current
weights before the update (node ``actor.old_log_prob``), and PPO's ratio and clip, and the KL
penalty, take those, so each update is a proximal step from the trainer's own policy. The
generator's log-probs (one update older under one-step-off; numerically another engine's in
every mode) are kept as ``rollout_log_probs`` and their gap is reported per iteration
(``rollout_log_prob_mismatch``: mean |log p_rollout - log p_old| over response tokens).
Importance weights p_old / p_rollout on top (decoupled PPO) are not applied: at staleness 1
with a clipped update the two policies are one proximal step apart, and the recomputation
already makes the ratio's denominator the trainer's policy; the metric shows when that gap
grows.
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
from executor.controller import CallRecord, Pending, RoleHandle, wait_together
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
    mode: str = "sync"
    """The plan's mode: sync, or one_step_off (generation on the rollout set, one batch
    ahead of training)."""
    steps: int = 0
    """The run's iterations (one_step_off generates no batch past the last)."""
    ahead: dict[int, Callable[[], Any]] = field(default_factory=dict)
    """one_step_off: the next iteration's generation in flight (iteration -> its finish)."""

    @property
    def generation(self) -> RoleHandle:
        """The handle that generates: the rollout set's, else the actor's."""
        return self.handles.get("rollout") or self.handles["actor"]

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


def _generate(ctx: Context, prompts: Batch, node: str | None = None) -> Pending:
    pending = ctx.generation.generate(prompts, node=node)
    # One-step-off collects it after the update: its wall time ends when it is ready.
    return pending.collected_late() if ctx.mode == "one_step_off" else pending


def _launch_sampled(ctx: Context, iteration: int) -> Callable[[], Batch]:
    """Start generating the iteration's responses, one per prompt."""
    return _generate(ctx, _prompts(ctx, iteration)).result


def _launch_grouped(ctx: Context, iteration: int) -> Callable[[], Batch]:
    """Start generating GRPO's groups: samples_per_prompt responses per prompt."""
    return _generate(ctx, _prompts(ctx, iteration, ctx.samples_per_prompt)).result


def _launch_remax(ctx: Context, iteration: int) -> Callable[[], tuple[Batch, Batch]]:
    """Start ReMax's two generations: sampled responses and the greedy baseline's."""
    prompts = _prompts(ctx, iteration)
    sampled = _generate(ctx, prompts)
    greedy = _generate(ctx, Batch(prompts.tensors, {**prompts.meta, "greedy": True}),
                       node="actor.generate_greedy")
    return lambda: (sampled.result(), greedy.result())


def _rollout(ctx: Context, iteration: int,
             launch: Callable[[Context, int], Callable[[], Any]]) -> Any:
    """The iteration's generated batch. Synchronous: generated now. One-step-off: the batch
    launched during the previous iteration (the first iteration generates its own first),
    and the next iteration's batch is launched before this one is trained on."""
    if ctx.mode != "one_step_off":
        return launch(ctx, iteration)()
    finish = ctx.ahead.pop(iteration, None) or launch(ctx, iteration)
    generated = finish()
    if iteration + 1 < ctx.steps:
        import contextlib

        from executor.data import DataExhaustedError

        # Data used up: the next iteration finds it so and ends the run.
        with contextlib.suppress(DataExhaustedError):
            ctx.ahead = {iteration + 1: launch(ctx, iteration + 1)}
    return generated


OLD_LOG_PROB_NODE = "actor.old_log_prob"
"""The trainer's recomputation of the old log-probs (the simulator's node of that name)."""


def _old_log_probs(ctx: Context, batch: Batch) -> Callable[[], Batch]:
    """Start the trainer's recomputation of the sampled tokens' log-probs; the returned
    function finishes it into ``old_log_probs`` (the trainer's) and ``rollout_log_probs`` (the
    generator's). Every mode recomputes, as verl does (ray_trainer.py, the actor's
    compute_log_prob): one-step-off because the batch comes from older weights, synchronous
    runs because the generator's kernels (another engine, bf16 sampling) give other numbers
    than the trainer's, which would start PPO's ratio and the KL off 1 and 0 (issue 31 defect
    2)."""
    pending = ctx.actor.log_probs(batch, node=OLD_LOG_PROB_NODE)

    def finish() -> Batch:
        return Batch({"rollout_log_probs": batch["old_log_probs"],
                      "old_log_probs": pending.result()["old_log_probs"]})

    return finish


def sync_weights(ctx: Context, node: str = "actor.weight_sync") -> dict[str, float]:
    """One-step-off: the trainer's actor weights to the rollout set, through the sync group
    (``executor.weight_sync``), recorded as one stage (operation ``sync``, on the rollout
    set, both sides' ranks timed); returns its metrics."""
    start = time.time()
    sent = ctx.actor.send_weights(Batch(), record=False)
    received = ctx.rollout.receive_weights(Batch(), record=False)
    wait_together([sent, received])
    sent.result()
    sender = sent.first_rank_result().meta  # the trainer's rank 0, the one that broadcasts
    got = received.result().meta
    for info in received.record.infos:
        info["sync"] = {"bytes": got["bytes"], "tensors": got["tensors"]}
    record = CallRecord(node=node, role="actor", operation="sync",
                        location=received.record.location, dispatch_start=start,
                        collected=time.time(),
                        infos=[*sent.record.infos, *received.record.infos])
    ctx.records.append(record)
    return {"weight_sync_seconds": record.wall_seconds, "weight_sync_bytes": got["bytes"],
            "weight_sync_tensors": got["tensors"],
            "weight_sync_gather_seconds": sender["gather_seconds"],
            "weight_sync_broadcast_seconds": sender["broadcast_seconds"]}


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
    if "rollout_log_probs" in batch:
        # How far the generator's log-probs (one update older under one-step-off) are from
        # the trainer's on the sampled tokens.
        gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask
        metrics["rollout_log_prob_mismatch"] = float(gap.sum() / tokens)
    if "ref_log_probs" in batch:
        # k1 estimate of KL(actor || reference) per token, on the sampled tokens.
        kl = (batch["old_log_probs"] - batch["ref_log_probs"]) * mask
        metrics["kl_to_reference"] = float(kl.sum() / tokens)
    return {**metrics, **extra}


def ppo_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    batch = _rollout(ctx, iteration, _launch_sampled)
    old = _old_log_probs(ctx, batch)
    values = ctx.critic.values(batch)      # the three run in parallel where the roles are
    ref = ctx.ref.log_probs(batch)         # on different sets, one after another (in this
    _, finish_scores = _scores(ctx, batch)  # order) where they share GPUs
    batch = batch | old() | ref.result() | values.result() | finish_scores()

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
    batch = _rollout(ctx, iteration, _launch_sampled)
    old = _old_log_probs(ctx, batch)
    values = ctx.critic.values(batch)
    ref = ctx.ref.log_probs(batch)
    _, finish_scores = _scores(ctx, batch)
    finish_costs = _costs(ctx, batch)
    batch = batch | old() | ref.result() | values.result() | finish_scores() | finish_costs()
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
    batch = _rollout(ctx, iteration, _launch_grouped)
    old = _old_log_probs(ctx, batch)
    ref = ctx.ref.log_probs(batch)
    _, finish_scores = _scores(ctx, batch)
    batch = batch | old() | ref.result() | finish_scores()

    def advantages() -> Batch:
        return Batch({"advantages": rl.group_advantages(
            batch["scores"], ctx.samples_per_prompt, batch["response_mask"],
            ctx.rl.group_eps)})

    batch = batch | ctx.on_controller("advantage", "controller", advantages, len(batch))
    actor = ctx.actor.update(batch)
    return _summary(batch, _prefixed("actor", actor.result().meta), ctx.task.eos_token_id)


def remax_iteration(ctx: Context, iteration: int) -> dict[str, float]:
    batch, baseline = _rollout(ctx, iteration, _launch_remax)
    old = _old_log_probs(ctx, batch)
    ref = ctx.ref.log_probs(batch)
    both = Batch.concat([batch.select("prompts", "responses", "input_ids", "response_mask"),
                         baseline.select("prompts", "responses", "input_ids",
                                         "response_mask")])
    _, finish_scores = _scores(ctx, both)
    scored = finish_scores()
    half = len(batch)
    batch = batch | old() | ref.result() | Batch({"scores": scored["scores"][:half],
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


def run_iteration(ctx: Context, algorithm: str, iteration: int) -> dict[str, float]:
    """One iteration of ``algorithm``; one-step-off then waits for the next batch (launched
    before the update) and syncs the updated weights to the rollout set."""
    summary = DRIVERS[algorithm](ctx, iteration)
    if ctx.mode == "one_step_off":
        for finish in ctx.ahead.values():
            finish()  # its record joins this iteration's, which it overlapped
        summary.update(sync_weights(ctx))
    return summary


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
    batch = ctx.generation.generate(Batch(prompts.tensors, {"iteration": iteration,
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
