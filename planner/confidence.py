"""How sure the planner is of its winner: the finalists re-ranked under the cost model's own
measured error.

Each finalist's predicted step is split along its critical path (read back from its simulated
timeline) into the time of four kinds of work: generation, training, forward passes (log-probs,
values, rewards) and the rest (transitions, weight syncs, transfers, the controller). Each kind
has an error distribution measured by ``hybridflow validate``: the log-ratios predicted /
measured of the validation cases that price that kind of work (the generation groups, the
training groups, and the published stage timers of whole RL steps). A draw gives every kind of
work of every finalist an error taken from that distribution, correlated between finalists as
the errors of one validation group's cases are correlated with each other (the intra-group
correlation, measured on the same cases): two plans of one job share hardware, framework and
model, as one group's cases do. The true step of a finalist in that draw is its predicted step
with each kind's time divided by its drawn error.

Over the draws: the probability that the winner is the fastest, the expected regret (how much
slower the winner is than the fastest finalist of the draw, on average), and how often each
mode's best plan is the fastest mode. First order: the critical path of each finalist is held
fixed (a plan whose generation and training run side by side on two sets is priced on the path
that decided its step). The job's own inputs (response lengths) are the user's, not drawn.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

WORK_KINDS = ("generate", "train", "infer", "other")
"""The kinds of work whose errors are drawn separately."""

STAGE_KINDS = {"policy_training": "train", "generation": "generate", "logprobs": "infer",
               "refit": "other"}
"""Published stage timers of whole-step validation cases, by the kind of work they time."""

GENERATION_METRICS = ("latency_ms", "out_tokens_per_s", "out_tokens_per_s_per_gpu")

DRAWS = 2000
"""Monte Carlo draws (a fixed seed: the same plan gets the same figures)."""

SURE = 0.8
"""A winner fastest in at least this share of draws is called firm; below one half, the
verdict flips inside the model's error."""


@dataclass(frozen=True, slots=True)
class ErrorModel:
    """The cost model's measured error per kind of work (log of predicted / measured)."""

    log_errors: dict[str, tuple[float, ...]]
    """Per kind of work: one log-ratio per validation case (or published stage timer)."""
    correlation: dict[str, float]
    """Per kind of work: the correlation of two cases' errors within one validation group
    (intra-class correlation), used between the finalists of one job; a kind priced by a
    single group takes that of the kinds that have several."""

    def spread_pct(self, kind: str) -> float:
        """Typical |error| of a kind of work: the median of exp(|log-ratio|) - 1, percent."""
        values = self.log_errors[kind]
        return 100.0 * (math.exp(float(np.median(np.abs(values)))) - 1.0)


@dataclass(frozen=True, slots=True)
class Finalist:
    """A plan to re-rank: its label, mode, predicted value and where its time goes."""

    label: str
    mode: str
    value: float
    """The objective's value per iteration (seconds, or dollars under a cost objective)."""
    shares: dict[str, float]
    """Share of its critical path per kind of work (sums to 1)."""
    allowed: bool = True
    """The job lets the planner choose it (an asynchronous mode the job does not allow is
    compared among the modes, not among the winners)."""


@dataclass(frozen=True, slots=True)
class PlanConfidence:
    """How sure the planner is of its winner."""

    winner: str
    p_best: float
    """Share of draws in which the winner is the fastest allowed finalist."""
    expected_regret: float
    """Mean over the draws of (winner's value - the fastest allowed finalist's value), in the
    objective's unit (seconds or dollars per iteration)."""
    expected_regret_pct: float
    """The same, over the winner's predicted value, in percent."""
    rival: str | None
    """The finalist most often fastest when the winner is not (None when it always is)."""
    p_rival: float
    finalists: int
    """Plans re-ranked: the winner's rivals and each mode's best plan."""
    allowed: int
    """Of them, the plans of the modes the job allows (the winner's rivals)."""
    p_mode: dict[str, float]
    """Per mode with a plan: share of draws in which its best plan is the fastest mode."""
    spread_pct: dict[str, float]
    """Typical |error| per kind of work, as validated."""
    correlation: dict[str, float]
    """Per kind of work: the correlation of its error between two plans."""
    draws: int
    unit: str
    """'s' (seconds per iteration) or '$' (dollars per iteration)."""

    @property
    def verdict(self) -> str:
        if self.p_best >= SURE:
            return "firm"
        return "uncertain" if self.p_best >= 0.5 else "flips inside the model's error"

    def lines(self) -> list[str]:
        """What ``plan`` prints."""
        regret = (f"{self.expected_regret:.2f} s" if self.unit == "s"
                  else f"${self.expected_regret:,.2f}")
        spread = ", ".join(f"{k} {v:.0f}% (r {self.correlation[k]:.2f})"
                           for k, v in self.spread_pct.items())
        if self.allowed == 1:
            head = ("confidence: the winner is the only finalist of the modes the job allows "
                    f"(of {self.finalists} priced)")
        else:
            head = (f"confidence: the winner is the fastest of {self.allowed} finalists in "
                    f"{self.p_best:.0%} of {self.draws:,} draws of the model's error: "
                    f"{self.verdict}; expected regret {regret} "
                    f"({self.expected_regret_pct:.1f}%)")
        out = [head,
               f"  validated error per kind of work (typical |error|, r: correlation between "
               f"plans): {spread}"]
        if self.rival is not None:
            out.append(f"  most often faster instead: {self.rival} ({self.p_rival:.0%} of "
                       "draws)")
        if len(self.p_mode) > 1:
            modes = ", ".join(f"{m} {p:.0%}" for m, p in self.p_mode.items())
            out.append(f"  fastest mode under the model's error: {modes}")
        return out

    def to_value(self) -> dict:
        return {"winner": self.winner, "p_best": self.p_best, "verdict": self.verdict,
                "expected_regret": self.expected_regret,
                "expected_regret_pct": self.expected_regret_pct, "unit": self.unit,
                "rival": self.rival, "p_rival": self.p_rival, "finalists": self.finalists,
                "allowed_finalists": self.allowed,
                "p_mode": dict(self.p_mode), "spread_pct": dict(self.spread_pct),
                "correlation": dict(self.correlation), "draws": self.draws}


@cache
def validated_error_model() -> ErrorModel:
    """The error model of today's validation cases (computed once per process)."""
    from simulator.validation import cached_validation

    table, _ = cached_validation()
    return error_model(table.to_dict(orient="records"))


def error_model(rows: Sequence[dict]) -> ErrorModel:
    """Log-ratios per kind of work, and their intra-group correlation, from validation rows
    (``group``, ``metric``, ``stage``, ``measured``, ``predicted``)."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_group: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        kind = _row_kind(row)
        if kind is None:
            continue
        ratio = row["predicted"] / row["measured"]
        # A throughput too high is a time too short: every log-ratio is a time's.
        log_error = -math.log(ratio) if "_per_s" in row["metric"] else math.log(ratio)
        by_kind[kind].append(log_error)
        by_group[(kind, row["group"])].append(log_error)
    missing = [k for k in WORK_KINDS if len(by_kind[k]) < 2]
    for kind in missing:  # no stage timers of this kind: the error of all other cases
        by_kind[kind] = [e for k in WORK_KINDS if k not in missing for e in by_kind[k]]
    correlation = {k: _intra_group_correlation(
        [v for (kind, _), v in by_group.items() if kind == k]) for k in WORK_KINDS}
    pooled = _intra_group_correlation(
        [list(np.asarray(v) - np.mean(by_kind[kind])) for (kind, _), v in by_group.items()
         if correlation[kind] is not None])
    # Without two groups of two cases anywhere, nothing measures the correlation: the
    # errors are drawn independently (the widest re-ranking).
    pooled = 0.0 if pooled is None else pooled
    return ErrorModel(log_errors={k: tuple(by_kind[k]) for k in WORK_KINDS},
                      correlation={k: pooled if c is None else c
                                   for k, c in correlation.items()})


def _row_kind(row: dict) -> str | None:
    if row.get("relative") in (True, 1):
        return None  # a published ratio of two layouts: not the error of one layout's time
    if row.get("stage"):
        return STAGE_KINDS.get(row["stage"])
    measures = row.get("measures")
    if isinstance(measures, str):  # a group of one stage timer (the refit times)
        return STAGE_KINDS.get(measures)
    if row["metric"] in GENERATION_METRICS:
        return "generate"
    if row["metric"] == "iteration_seconds":
        return "train"
    return None  # whole RL steps mix every kind


def _intra_group_correlation(groups: Sequence[Sequence[float]]) -> float | None:
    """One-way ANOVA estimate of the intra-class correlation of log-errors, the validation
    groups as classes, clipped to [0, 1]; None with fewer than two groups of two cases."""
    arrays = [np.asarray(g, dtype=float) for g in groups if len(g) >= 2]
    if len(arrays) < 2:
        return None
    sizes = np.array([len(a) for a in arrays], dtype=float)
    grand = float(np.concatenate(arrays).mean())
    k, n = len(arrays), float(sizes.sum())
    msb = float(sum(len(a) * (a.mean() - grand) ** 2 for a in arrays)) / (k - 1)
    msw = float(sum(((a - a.mean()) ** 2).sum() for a in arrays)) / (n - k)
    n0 = (n - float((sizes ** 2).sum()) / n) / (k - 1)
    denominator = msb + (n0 - 1) * msw
    if denominator <= 0:
        return 0.0
    return float(min(1.0, max(0.0, (msb - msw) / denominator)))


def critical_path_shares(timeline: Sequence) -> dict[str, float]:
    """Share of each kind of work on the path that decided the timeline's end: from the last
    event to end, back through the event that ended latest before each one started (waits
    between them count as 'other')."""
    events = sorted((e for e in timeline if e.end > e.start), key=lambda e: e.end)
    seconds = dict.fromkeys(WORK_KINDS, 0.0)
    if not events:
        return {"other": 1.0, **{k: 0.0 for k in WORK_KINDS if k != "other"}}
    ends = [e.end for e in events]
    index = len(events) - 1
    current = events[index]
    total = current.end
    epsilon = 1e-9 * max(1.0, total)
    while True:
        seconds[_event_kind(current)] += current.end - current.start
        # The latest-ending event before this one (in end order, so the walk always moves
        # back) that ended by the time this one started.
        index = _last_at_or_before(ends, current.start + epsilon, index)
        if index < 0:
            seconds["other"] += max(0.0, current.start)
            break
        previous = events[index]
        seconds["other"] += max(0.0, current.start - previous.end)
        current = previous
    span = sum(seconds.values())
    return {k: v / span for k, v in seconds.items()} if span > 0 else \
        {"other": 1.0, **{k: 0.0 for k in WORK_KINDS if k != "other"}}


def _last_at_or_before(sorted_ends: list[float], t: float, below: int) -> int:
    """The last index under ``below`` whose end is at or before ``t`` (-1 when none)."""
    import bisect

    return bisect.bisect_right(sorted_ends, t, 0, below) - 1


def _event_kind(event) -> str:
    if event.kind != "compute":
        return "other"
    if event.operation == "generate":
        return "generate"
    if event.operation == "train":
        return "train"
    if event.operation == "infer":
        return "infer"
    return "other"


def confidence(finalists: Sequence[Finalist], model: ErrorModel, *, unit: str = "s",
               draws: int = DRAWS, seed: int = 0) -> PlanConfidence | None:
    """Re-rank ``finalists`` (the first allowed one is the winner) over ``draws`` draws of the
    model's error. None when there is nothing to compare."""
    allowed = [i for i, f in enumerate(finalists) if f.allowed]
    if not allowed or len(finalists) < 2:
        return None
    rng = np.random.default_rng(seed)
    count = len(finalists)
    values = np.array([f.value for f in finalists])
    true_values = np.zeros((draws, count))
    for kind in WORK_KINDS:
        rho = model.correlation[kind]
        samples = np.asarray(model.log_errors[kind])
        mean = float(samples.mean())
        shared = rng.choice(samples, size=(draws, 1)) - mean
        own = rng.choice(samples, size=(draws, count)) - mean
        log_error = mean + math.sqrt(rho) * shared + math.sqrt(1 - rho) * own
        shares = np.array([f.shares.get(kind, 0.0) for f in finalists])
        # Predicted time of this kind of work over its drawn error (predicted / measured).
        true_values += values * shares * np.exp(-log_error)
    winner = allowed[0]
    allowed_values = true_values[:, allowed]
    fastest = np.asarray(allowed)[allowed_values.argmin(axis=1)]
    p_best = float((fastest == winner).mean())
    regret = true_values[:, winner] - allowed_values.min(axis=1)
    rival, p_rival = None, 0.0
    others = fastest[fastest != winner]
    if others.size:
        ids, counts = np.unique(others, return_counts=True)
        rival = finalists[int(ids[counts.argmax()])].label
        p_rival = float(counts.max() / draws)
    p_mode = _mode_shares(finalists, true_values)
    return PlanConfidence(
        winner=finalists[winner].label, p_best=p_best,
        expected_regret=float(regret.mean()),
        expected_regret_pct=100.0 * float(regret.mean()) / finalists[winner].value,
        rival=rival, p_rival=p_rival, finalists=count, allowed=len(allowed), p_mode=p_mode,
        spread_pct={k: model.spread_pct(k) for k in WORK_KINDS},
        correlation=dict(model.correlation), draws=draws, unit=unit)


def _mode_shares(finalists: Sequence[Finalist], true_values: np.ndarray) -> dict[str, float]:
    """Per mode: share of draws in which its fastest finalist beats every other mode's."""
    modes = list(dict.fromkeys(f.mode for f in finalists))
    per_mode = np.stack([true_values[:, [i for i, f in enumerate(finalists) if f.mode == m]]
                         .min(axis=1) for m in modes], axis=1)
    best = per_mode.argmin(axis=1)
    return {m: float((best == i).mean()) for i, m in enumerate(modes)}
