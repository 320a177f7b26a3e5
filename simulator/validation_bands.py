"""Assumption bands of the validation cases: a group's error over each assumed input's
plausible range (``bands:`` of a group in ``simulator/data/validation_cases.yaml``).

A band names one input that the source does not publish (a prompt length, a response-length
mean, the driver's pickling rate, a per-step host cost), where it lives, the values it may
plausibly take and why. ``validate`` prices the group again at each value, one band at a time
with the others at their nominal value, and at every corner of all the bands together, and says
whether the group's goal holds across the band (its nominal point included), in part of it
(naming where), or nowhere in it.

Where a band points:
- ``job.<path>``: a key of each case's job (``job.workload.prompt_length``);
- ``case.<path>``: a key of each case itself (a generation case's ``prompt``);
- ``framework.<path>``: a setting of the framework profile each case's job names
  (``framework.controller.serialize_bytes_per_s``), applied as a profile whose ``base:`` is the
  case's own;
- ``device.<path>``: a field of the device profile (``device.overheads.decode_step_seconds``),
  applied as an in-memory copy of the case's profile.

The values are either absolute (``values: [low, high]``) or multiples of each case's own value
(``factors: [low, high]``). The errors are taken at the listed values only: between them the
group's error is not computed (it moves smoothly with these inputs in every band written so
far, but nothing here checks that).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from profiles.datafile import SpecError, from_mapping

PLACES = ("job", "case", "framework", "device")
"""Where a band's key may point (the first part of its dotted key)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Band:
    """One assumed input of a group's cases and its plausible range."""

    input: str
    """What is assumed, in words (``mean response length``)."""
    key: str
    """Where it lives: ``job.``, ``case.``, ``framework.`` or ``device.`` and a dotted path."""
    reason: str
    """Why the range is plausible, with its sources."""
    values: tuple[Any, ...] = ()
    """The plausible values (absolute), usually its two ends."""
    factors: tuple[float, ...] = ()
    """Or: the plausible values as multiples of each case's own value."""
    cases: tuple[str, ...] = ()
    """The case names the band applies to (empty: every case of the group)."""

    def __post_init__(self) -> None:
        place, _, path = self.key.partition(".")
        if place not in PLACES or not path:
            raise SpecError(f"expected one of {', '.join(p + '.<path>' for p in PLACES)}, "
                            f"got {self.key!r}", key="key")
        if bool(self.values) == bool(self.factors):
            raise SpecError("give either values (absolute) or factors (of each case's own "
                            "value), not both and not neither", key="values")
        if any(not isinstance(f, (int, float)) or f <= 0 for f in self.factors):
            raise SpecError(f"factors are positive numbers, got {list(self.factors)}",
                            key="factors")

    @property
    def place(self) -> str:
        return self.key.partition(".")[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.key.partition(".")[2].split("."))

    @property
    def points(self) -> tuple[Any, ...]:
        return self.values or self.factors

    def describe_point(self, point: Any) -> str:
        return f"x{point:g}" if self.factors else _short(point)


@dataclass(kw_only=True, slots=True, frozen=True)
class BandPoint:
    """The group's error with one setting of its bands."""

    setting: str
    """The band values priced, in words (``mean response length x0.5``)."""
    value: str = ""
    """A single band's value priced (``x0.5``; empty for corners and the nominal point)."""
    median_abs_error_pct: float
    mean_abs_error_pct: float
    max_abs_error_pct: float


@dataclass(kw_only=True, slots=True, frozen=True)
class BandResult:
    """A band (or all of a group's bands together) and the group's error over it."""

    band: str
    """The band's input (or 'all bands together')."""
    key: str
    reason: str
    points: tuple[BandPoint, ...]
    goal: str | None = None
    """For a group with a goal or target: whether it holds at every point priced ('holds
    across the band'), at some ('holds in part of the band only (at ...)', naming them) or
    at none ('holds nowhere in the band'); the nominal point is one of them."""

    @property
    def median_range(self) -> tuple[float, float]:
        medians = [p.median_abs_error_pct for p in self.points]
        return min(medians), max(medians)

    @property
    def max_range(self) -> tuple[float, float]:
        maxima = [p.max_abs_error_pct for p in self.points]
        return min(maxima), max(maxima)


def read_bands(spec: Mapping, group: str, source: str) -> tuple[Band, ...]:
    raw = spec.get("bands", [])
    if not isinstance(raw, list):
        raise SpecError("expected a list of bands", key=f"{group}.bands", source=source)
    bands = []
    for i, item in enumerate(raw):
        if isinstance(item, Mapping):
            item = {k: tuple(v) if isinstance(v, list) else v for k, v in item.items()}
        band = from_mapping(Band, item, source=source, key_prefix=f"{group}.bands[{i}]")
        names = {c.get("name") for c in spec.get("cases", [])}
        unknown = [c for c in band.cases if c not in names]
        if unknown:
            raise SpecError(f"no case named {unknown[0]!r} in the group",
                            key=f"{group}.bands[{i}].cases", source=source)
        bands.append(band)
    return tuple(bands)


def band_results(spec: Mapping, bands: Sequence[Band],
                 errors_of: Callable[[dict], list[float]], *,
                 goal: Callable[[BandPoint], bool] | None,
                 nominal: BandPoint) -> tuple[BandResult, ...]:
    """The group priced at each band's values (the others nominal), then at every corner of
    all bands together, each with the ``nominal`` point; ``errors_of`` prices a group spec
    and returns its whole-step signed errors in percent; ``goal`` says whether one point meets
    the group's goal."""
    if not bands:
        return ()
    results = []
    with tempfile.TemporaryDirectory(prefix="hybridflow-bands-") as scratch:
        def point(setting: Sequence[tuple[Band, Any]]) -> BandPoint:
            # Through JSON, not deepcopy: YAML anchors make cases share mappings (one
            # workload for six cases), which a deep copy keeps shared and a band would then
            # change once per case that shares it.
            variant = json.loads(json.dumps(dict(spec)))
            for band, value in setting:
                _apply(variant, band, value, Path(scratch))
            described = [(b.input, b.describe_point(v)) for b, v in setting]
            return summary_point(", ".join(f"{name} {value}" for name, value in described),
                                 errors_of(variant),
                                 value=described[0][1] if len(described) == 1 else "")

        for band in bands:
            points = (nominal, *(point([(band, value)]) for value in band.points))
            results.append(BandResult(band=band.input, key=band.key, reason=band.reason,
                                      points=points, goal=_verdict(points, goal)))
        if len(bands) > 1:
            corners = tuple(point(list(zip(bands, values, strict=True)))
                            for values in itertools.product(*(b.points for b in bands)))
            results.append(BandResult(band="all bands together", key="",
                                      reason="every corner of the bands above",
                                      points=(nominal, *corners),
                                      goal=_verdict((nominal, *corners), goal,
                                                    corners=True)))
    return tuple(results)


def summary_point(setting: str, signed_errors: Sequence[float], *,
                  value: str = "") -> BandPoint:
    """The median, mean and max |error| of one setting from its signed errors (percent)."""
    errors = [abs(e) for e in signed_errors]
    return BandPoint(setting=setting, value=value,
                     median_abs_error_pct=float(statistics.median(errors)),
                     mean_abs_error_pct=sum(errors) / len(errors),
                     max_abs_error_pct=max(errors))


def _verdict(points: Sequence[BandPoint], goal: Callable[[BandPoint], bool] | None, *,
             corners: bool = False) -> str | None:
    """Where the goal holds among ``points`` (the first is the nominal one): named for one
    band's values, counted for the corners of several."""
    if goal is None:
        return None
    held = [p for p in points if goal(p)]
    if len(held) == len(points):
        return "holds across the band"
    if not held:
        return "holds nowhere in the band"
    if corners:
        at_nominal = goal(points[0])
        count = len(held) - at_nominal
        where = f"{count} of {len(points) - 1} corners" if count else \
            f"none of the {len(points) - 1} corners"
        return (f"holds in part of the band only (at {where}"
                f"{', and at the nominal point' if at_nominal else ''})")
    return "holds in part of the band only (at " + \
        ", ".join(p.value or p.setting for p in held) + ")"


def _apply(spec: dict, band: Band, value: Any, scratch: Path) -> None:
    """Set ``band`` to ``value`` (or multiply by it) in every case of ``spec`` it covers."""
    if band.place == "device" and not any("job" in c for c in spec["cases"]):
        # Cases without a job share the group's device: changed once.
        spec["device"] = _device_variant(spec["device"], band, value)
        return
    for case in _cases(spec, band):
        if band.place in ("job", "case"):
            target = case["job"] if band.place == "job" else case
            _set(target, band.path, value, factor=bool(band.factors), key=band.key)
        elif band.place == "framework":
            job = case["job"]
            job["framework"] = _framework_variant(job.get("framework", "verl"), band, value,
                                                  scratch)
        else:
            _set_device(spec, case, band, value)


def _cases(spec: dict, band: Band) -> Iterator[dict]:
    for case in spec["cases"]:
        if not band.cases or case.get("name") in band.cases:
            yield case


def _set(mapping: dict, path: Sequence[str], value: Any, *, factor: bool, key: str) -> None:
    for part in path[:-1]:
        if not isinstance(mapping.get(part), dict):
            raise SpecError(f"the case has no mapping {part!r} on the way to this key",
                            key=key)
        mapping = mapping[part]
    leaf = path[-1]
    if factor:
        if not isinstance(mapping.get(leaf), (int, float)):
            raise SpecError("factors need a number in every case at this key", key=key)
        old = mapping[leaf]
        mapping[leaf] = type(old)(round(old * value)) if isinstance(old, int) else old * value
    else:
        mapping[leaf] = value


def _framework_variant(framework: str, band: Band, value: Any, scratch: Path) -> str:
    """A framework profile file: ``framework`` with the band's setting changed."""
    from profiles.framework import load_framework

    old = _get(load_framework(framework), band.path, band.key,
               missing_leaf_ok=not band.factors)
    if band.factors:
        value = old * value
    settings: dict[str, Any] = {}
    inner = settings
    for part in band.path[:-1]:
        inner = inner.setdefault(part, {})
    inner[band.path[-1]] = value
    base = framework if not framework.endswith((".yaml", ".yml")) else \
        str(Path(framework).resolve())
    out = scratch / f"variant-{len(list(scratch.iterdir()))}.yaml"
    out.write_text(yaml.safe_dump({"base": base, **settings}, sort_keys=False))
    return str(out)


def _set_device(spec: dict, case: dict, band: Band, value: Any) -> None:
    """Point the case's node groups at in-memory copies of their device profiles with the
    band's field changed."""
    cluster = case["job"]["cluster"]
    for group in cluster.get("node_groups", [cluster]):
        group["device"] = _device_variant(group.get("device", "a100-80gb"), band, value)


def _device_variant(name: str, band: Band, value: Any) -> str:
    from profiles.device import load_profile, register_profile

    profile = load_profile(name)
    old = _get(profile, band.path, band.key, missing_leaf_ok=not band.factors)
    new = value * old if band.factors else value
    return register_profile(_replaced(profile, band.path, new))


def _get(obj: Any, path: Sequence[str], key: str, *, missing_leaf_ok: bool = False) -> Any:
    """The value at ``path`` in a profile (dataclass fields, or keys of a mapping in it); a
    mapping may lack the last key when the band sets it (``missing_leaf_ok``)."""
    for i, part in enumerate(path):
        if isinstance(obj, Mapping):  # a mapping of the profile (its corrections)
            if part not in obj:
                if missing_leaf_ok and i == len(path) - 1:
                    return None
                raise SpecError(f"the profile has no {part!r} here to multiply; give values",
                                key=key)
            obj = obj[part]
            continue
        if not hasattr(obj, part) or part.startswith("_"):
            raise SpecError(f"the profile has no field {part!r}", key=key)
        obj = getattr(obj, part)
    if not missing_leaf_ok and not isinstance(obj, (int, float)):
        raise SpecError(f"factors need a number here, the profile has {obj!r}; give values",
                        key=key)
    return obj


def _replaced(obj: Any, path: Sequence[str], value: Any) -> Any:
    """``obj`` (a frozen dataclass, or a mapping inside one) with ``path`` set to ``value``."""
    head, rest = path[0], path[1:]
    if isinstance(obj, Mapping):
        return {**obj, head: value if not rest else _replaced(obj[head], rest, value)}
    return replace(obj, **{head: value if not rest else _replaced(getattr(obj, head), rest,
                                                                      value)})


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)

