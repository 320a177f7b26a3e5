"""Response-length distributions: fixed, uniform, clipped normal, clipped lognormal, maximum
entropy (only the mean and the cap known), empirical.

Generation time is decided by the longest responses, so the simulator works with deterministic
stratified samples (quantiles at (i + 0.5) / n) rather than random draws: the same job always
gives the same prediction, and the tail is represented in proportion to its probability mass.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal

from profiles.datafile import SpecError, from_mapping, read_text_file, require

Kind = Literal["fixed", "uniform", "normal", "lognormal", "max_entropy", "empirical"]

PROGRESSION_RUNS = 64
"""Distinct lengths up to which ``progression_moments`` sums a range exactly, run by run."""
PROGRESSION_SAMPLES = 64
"""Evenly spread terms ``progression_moments`` averages over a range of many distinct lengths."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LengthDistribution:
    """A distribution of token counts, always bounded by ``max`` (responses stop there)."""

    distribution: Kind = "fixed"
    """fixed | uniform | normal (clipped) | lognormal (clipped) | max_entropy | empirical."""
    value: int | None = None
    """fixed: the length in tokens."""
    min: int | None = None
    """uniform / normal / max_entropy: smallest length in tokens (normal, max_entropy: default
    1)."""
    max: int | None = None
    """uniform / normal / lognormal / max_entropy: largest length in tokens (lengths are clipped
    here)."""
    mean: float | None = None
    """normal / max_entropy: mean in tokens."""
    std: float | None = None
    """normal: standard deviation in tokens."""
    median: float | None = None
    """lognormal: median in tokens."""
    sigma: float | None = None
    """lognormal: standard deviation of log(length)."""
    csv: str | None = None
    """empirical: CSV file with a ``length`` column (one row per response) and optionally a
    ``count`` column (a histogram). Relative paths are relative to the job file."""
    lengths: tuple[int, ...] = field(default=(), repr=False)
    """empirical: the distinct lengths (filled from ``csv``)."""
    weights: tuple[float, ...] = field(default=(), repr=False)
    """empirical: the probability of each length (filled from ``csv``)."""
    _cumulative_weights: tuple[float, ...] = field(default=(), init=False, repr=False,
                                                   compare=False)
    """empirical: running sums of ``weights``, kept here because hashing the weights to look
    them up in a cache costs as much as summing them (a quantile is a bisection in them)."""
    _mean_tokens: float | None = field(default=None, init=False, repr=False, compare=False)
    """``mean_tokens()`` once computed: the search asks it millions of times, and each answer
    is a sum over 512 stratified lengths."""

    def __post_init__(self) -> None:
        kind = self.distribution
        if kind == "fixed":
            require(self.value is not None, "fixed lengths need 'value'", "value")
            require(self.value > 0, f"must be a positive integer, got {self.value}", "value")
        elif kind == "uniform":
            require(self.min is not None and self.max is not None, "uniform needs min and max",
                    "min")
            require(0 < self.min <= self.max, f"need 0 < min <= max, got {self.min}, {self.max}",
                    "min")
        elif kind == "normal":
            require(self.mean is not None and self.std is not None and self.max is not None,
                    "normal needs mean, std and max", "mean")
            require(self.std >= 0, "must be >= 0", "std")
            require(self.max > 0, "must be a positive integer", "max")
            low = self.min if self.min is not None else 1
            require(0 < low <= self.max, f"need 0 < min <= max, got {low}, {self.max}", "min")
        elif kind == "lognormal":
            require(self.median is not None and self.sigma is not None and self.max is not None,
                    "lognormal needs median, sigma and max", "median")
            require(self.median > 0, "must be > 0", "median")
            require(self.sigma >= 0, "must be >= 0", "sigma")
            require(self.max > 0, "must be a positive integer", "max")
        elif kind == "max_entropy":
            require(self.mean is not None and self.max is not None,
                    "max_entropy needs mean and max", "mean")
            require(self.max > 0, "must be a positive integer", "max")
            low = self.min if self.min is not None else 1
            require(0 < low <= self.max, f"need 0 < min <= max, got {low}, {self.max}", "min")
            require(low <= self.mean <= self.max,
                    f"need min <= mean <= max, got {low}, {self.mean}, {self.max}", "mean")
        elif kind == "empirical":
            require(bool(self.lengths), "empirical needs 'csv' (a file of lengths)", "csv")
            require(len(self.lengths) == len(self.weights), "lengths and weights differ",
                    "csv")
            require(min(self.lengths) > 0, "lengths must be positive", "csv")
            object.__setattr__(self, "_cumulative_weights", _cumulative(self.weights))

    # ----- queries -----

    @property
    def max_tokens(self) -> int:
        """The longest possible response, in tokens (KV cache is reserved up to here)."""
        if self.distribution == "fixed":
            return int(self.value)  # type: ignore[arg-type]
        if self.distribution == "empirical":
            return max(self.lengths)
        return int(self.max)  # type: ignore[arg-type]

    @property
    def is_fixed(self) -> bool:
        return self.distribution == "fixed"

    def quantile(self, q: float) -> float:
        """Length (tokens, not rounded) at probability ``q`` in [0, 1]."""
        kind = self.distribution
        if kind == "fixed":
            return float(self.value)  # type: ignore[arg-type]
        if kind == "uniform":
            return self.min + q * (self.max - self.min)  # type: ignore[operator]
        if kind == "normal":
            low = self.min if self.min is not None else 1
            if self.std == 0:
                x = self.mean
            else:
                x = NormalDist(self.mean, self.std).inv_cdf(min(max(q, 1e-12), 1 - 1e-12))
            return float(min(max(x, low), self.max))  # type: ignore[type-var]
        if kind == "lognormal":
            z = NormalDist().inv_cdf(min(max(q, 1e-12), 1 - 1e-12))
            x = math.exp(math.log(self.median) + self.sigma * z)  # type: ignore[arg-type]
            return float(min(max(x, 1.0), self.max))  # type: ignore[type-var]
        if kind == "max_entropy":
            low = float(self.min if self.min is not None else 1)
            return _exponential_quantile(q, low, float(self.max),  # type: ignore[arg-type]
                                         _max_entropy_rate(low, float(self.max),  # type: ignore[arg-type]
                                                           float(self.mean)))  # type: ignore[arg-type]
        cumulative = self._cumulative_weights
        i = bisect.bisect_left(cumulative, q)
        return float(self.lengths[min(i, len(self.lengths) - 1)])

    def mean_tokens(self) -> float:
        """Mean length in tokens (of the clipped distribution)."""
        if self.distribution == "fixed":
            return float(self.value)  # type: ignore[arg-type]
        if self.distribution == "empirical":
            return sum(n * w for n, w in zip(self.lengths, self.weights, strict=True))
        if self.distribution == "max_entropy":
            return float(self.mean)  # type: ignore[arg-type]
        if self._mean_tokens is None:
            object.__setattr__(self, "_mean_tokens", sum(self.sample(512)) / 512)
        return self._mean_tokens  # type: ignore[return-value]

    def sample(self, count: int) -> tuple[int, ...]:
        """``count`` lengths at the quantiles (i + 0.5) / count, ascending (deterministic)."""
        return _stratified(self, count)

    def length_at(self, index: int, count: int) -> int:
        """``sample(count)[index]`` in tokens, without computing the other ``count - 1``."""
        if self.distribution == "fixed":
            return int(self.value)  # type: ignore[arg-type]
        return max(1, round(self.quantile((index + 0.5) / count)))

    def progression_moments(self, first: int, stride: int, terms: int,
                             count: int) -> tuple[float, float]:
        """Mean length (tokens) and mean squared length (tokens^2) of ``sample(count)[first +
        k * stride]`` for k in [0, terms), without evaluating every term.

        The lengths are non-decreasing in k, so they come in runs of equal values: when the
        range holds at most PROGRESSION_RUNS distinct lengths (empirical distributions, short
        lengths, the clipped maximum) the runs are found by bisection and summed exactly;
        otherwise (a smooth distribution over many distinct lengths) the terms are averaged
        over PROGRESSION_SAMPLES evenly spread ones (the midpoint rule).
        """
        if terms <= 0:
            return 0.0, 0.0

        def at(k: int) -> int:
            return self.length_at(first + k * stride, count)

        low, high = at(0), at(terms - 1)
        distinct = (high - low + 1 if self.distribution != "empirical" else
                    bisect.bisect_right(self.lengths, high) - bisect.bisect_left(self.lengths, low))
        if distinct > PROGRESSION_RUNS:  # a run costs a bisection: sample instead
            points = min(terms, PROGRESSION_SAMPLES)
            samples = [at(int((i + 0.5) * terms / points)) for i in range(points)]
            return sum(samples) / points, sum(x * x for x in samples) / points
        total = square = 0.0
        k = 0
        while k < terms:
            value = at(k)
            last, hi = k, terms - 1  # the run's last term lies in [last, hi]
            if at(hi) == value:
                last = hi
            step = 1
            while last + step < hi and at(last + step) == value:  # gallop, then bisect
                last += step
                step *= 2
            hi = min(hi, last + step)
            while last < hi:
                mid = (last + hi + 1) // 2
                if at(mid) == value:
                    last = mid
                else:
                    hi = mid - 1
            total += (last - k + 1) * value
            square += (last - k + 1) * value * value
            k = last + 1
        return total / terms, square / terms

    def to_value(self) -> int | dict[str, Any]:
        """The YAML form (an integer for fixed lengths)."""
        if self.distribution == "fixed":
            return int(self.value)  # type: ignore[arg-type]
        out: dict[str, Any] = {"distribution": self.distribution}
        for key in ("min", "max", "mean", "std", "median", "sigma", "csv"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def fixed(cls, tokens: int) -> LengthDistribution:
        return cls(distribution="fixed", value=tokens)


def _exponential_mean(low: float, high: float, rate: float) -> float:
    """Mean of the density proportional to exp(-rate * x) on [low, high]."""
    width = high - low
    if abs(rate * width) < 1e-9:
        return (low + high) / 2
    # mean - low = 1/rate - width / (exp(rate * width) - 1)
    return low + 1.0 / rate - width / math.expm1(rate * width)


@lru_cache(maxsize=256)
def _max_entropy_rate(low: float, high: float, mean: float) -> float:
    """The rate of the maximum-entropy density on [low, high] with the given mean: among all
    distributions on a bounded interval with a known mean, the truncated exponential
    exp(-rate * x) assumes the least (Jaynes 1957, Phys. Rev. 106:620). Positive when the mean
    is below the midpoint (lengths fall off towards the cap), negative above it (lengths pile up
    against the cap). Found by bisection: the mean decreases monotonically in the rate."""
    width = high - low
    if width <= 0:
        return 0.0
    fraction = (mean - low) / width
    # exp(500) is still a float; a mean within 0.2% of a bound is that bound's spike.
    lo, hi = -500.0 / width, 500.0 / width
    for _ in range(200):
        mid = (lo + hi) / 2
        if (_exponential_mean(0.0, width, mid) / width) > fraction:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _exponential_quantile(q: float, low: float, high: float, rate: float) -> float:
    """Inverse CDF of the density proportional to exp(-rate * x) on [low, high]."""
    width = high - low
    if abs(rate * width) < 1e-9:
        return low + q * width
    # F(x) = (1 - exp(-rate (x - low))) / (1 - exp(-rate width))
    return low - math.log1p(-q * -math.expm1(-rate * width)) / rate


@lru_cache(maxsize=256)
def _cumulative(weights: tuple[float, ...]) -> tuple[float, ...]:
    total = 0.0
    out = []
    for w in weights:
        total += w
        out.append(total)
    return tuple(out)


@lru_cache(maxsize=4096)
def _stratified(dist: LengthDistribution, count: int) -> tuple[int, ...]:
    if count <= 0:
        return ()
    if dist.distribution == "fixed":
        return (int(dist.value),) * count  # type: ignore[arg-type]
    return tuple(dist.length_at(i, count) for i in range(count))


def _read_lengths_csv(path: Path, key: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    try:
        text = read_text_file(path, what="UTF-8 CSV")
    except SpecError as exc:
        raise SpecError(f"{path}: {exc.problem}", key=key) from None
    counts: dict[int, float] = {}
    with io.StringIO(text, newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "length" not in reader.fieldnames:
            raise SpecError(f"{path}: needs a 'length' column (and optionally 'count')", key=key)
        for line, row in enumerate(reader, start=2):
            try:
                length = int(row["length"])
                count = float(row["count"]) if row.get("count") not in (None, "") else 1.0
            except (TypeError, ValueError):
                raise SpecError(f"{path}: line {line}: length must be an integer and count a "
                                f"number, got {row}", key=key) from None
            if length <= 0 or count < 0:
                raise SpecError(f"{path}: line {line}: length must be > 0 and count >= 0",
                                key=key)
            counts[length] = counts.get(length, 0.0) + count
    total = sum(counts.values())
    if total <= 0:
        raise SpecError(f"{path}: no lengths", key=key)
    lengths = tuple(sorted(counts))
    return lengths, tuple(counts[n] / total for n in lengths)


def parse_lengths(value: Any, key: str, base_dir: Path | None = None) -> LengthDistribution:
    """A length given as an integer or as a distribution mapping."""
    if isinstance(value, LengthDistribution):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise SpecError(f"must be a positive integer, got {value}", key=key)
        return LengthDistribution.fixed(value)
    if not isinstance(value, dict):
        raise SpecError(f"expected an integer or a mapping with 'distribution', got {value!r}",
                        key=key)
    if value.get("distribution") == "empirical":
        extra = [k for k in value if k not in ("distribution", "csv")]
        if extra:
            raise SpecError("unknown key for an empirical distribution (allowed: csv)",
                            key=f"{key}.{extra[0]}")
        csv_path = value.get("csv")
        if not isinstance(csv_path, str):
            raise SpecError("empirical needs 'csv' (a file path)", key=f"{key}.csv")
        path = Path(csv_path)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        lengths, weights = _read_lengths_csv(path, f"{key}.csv")
        return LengthDistribution(distribution="empirical", csv=csv_path, lengths=lengths,
                                  weights=weights)
    if "lengths" in value or "weights" in value:
        raise SpecError("give an empirical distribution as 'csv'", key=f"{key}.lengths")
    return from_mapping(LengthDistribution, value, key_prefix=key)
