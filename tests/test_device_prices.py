"""Device profiles' optional price: price_per_gpu_hour with its price_source."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from profiles.datafile import SpecError
from profiles.device import (
    load_profile,
    load_profile_file,
    profile_to_mapping,
    resolve_profile_path,
    write_profile_file,
)

GPU_PROFILES = ("a100-80gb", "a800-80gb", "h100-80gb", "h200", "h20")
ASSUMED = {"a800-80gb", "h20"}
"""Sold in China: no public on-demand price of a named cloud offering, so assumed."""


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_shipped_gpu_profiles_carry_a_price_and_its_source(name: str) -> None:
    profile = load_profile(name)
    assert profile.price_per_gpu_hour is not None
    assert 0.5 < profile.price_per_gpu_hour < 20  # US dollars per GPU per hour
    assert profile.price_source and profile.price_source.strip()
    assert profile.price_is_assumed == (name in ASSUMED)


def test_cited_prices_are_the_instance_price_over_its_eight_gpus() -> None:
    # AWS On-Demand, us-east-1: p4de.24xlarge, p5.48xlarge, p5en.48xlarge (see the YAML files).
    for name, instance_price in {"a100-80gb": 27.44705, "h100-80gb": 55.04,
                                 "h200": 63.296}.items():
        assert load_profile(name).price_per_gpu_hour == pytest.approx(instance_price / 8)


@pytest.mark.parametrize("name", ["cpu-2core", "cpu-2core-calibrated"])
def test_cpu_profiles_have_no_price(name: str) -> None:
    profile = load_profile(name)
    assert profile.price_per_gpu_hour is None and profile.price_source is None
    assert not profile.price_is_assumed
    assert "price_per_gpu_hour" not in profile_to_mapping(profile)
    assert "price_source" not in profile_to_mapping(profile)


def _a100_text(**replacements: str) -> str:
    text = Path(resolve_profile_path("a100-80gb")).read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


SOURCE_LINES = ('price_source: "AWS EC2 On-Demand p4de.24xlarge, us-east-1, Linux: $27.44705/h '
                'for 8 GPUs\n  (AWS price list via datareceipts/data-receipts 109-gpu-pricing, '
                'retrieved 2026-11-09)"\n')
PRICE_LINE = "price_per_gpu_hour: 3.43088125\n"


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"),
    [
        (SOURCE_LINES, "", "price_source", "price_per_gpu_hour needs a source"),
        (SOURCE_LINES, 'price_source: "  "\n', "price_source",
         "price_per_gpu_hour needs a source"),
        (PRICE_LINE, "price_per_gpu_hour: -3.4\n", "price_per_gpu_hour", "must be > 0"),
        (PRICE_LINE, "price_per_gpu_hour: 0\n", "price_per_gpu_hour", "must be > 0"),
        (PRICE_LINE, "price_per_gpu_hour: cheap\n", "price_per_gpu_hour", "expected a number"),
        (PRICE_LINE, "", "price_source", "given without price_per_gpu_hour"),
    ],
)
def test_bad_price_names_file_and_key(tmp_path: Path, old: str, new: str, key: str,
                                      problem: str) -> None:
    path = tmp_path / "priced.yaml"
    path.write_text(_a100_text(**{old: new}))
    with pytest.raises(SpecError) as info:
        load_profile_file(path)
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: ")
    assert problem in message


def test_assumed_price_is_reported_as_assumed(tmp_path: Path) -> None:
    path = tmp_path / "assumed.yaml"
    path.write_text(_a100_text(**{SOURCE_LINES: 'price_source: "Assumed: what our lab pays"\n'}))
    profile = load_profile_file(path)
    assert profile.price_is_assumed
    assert profile.price_per_gpu_hour == pytest.approx(3.43088125)
    assert load_profile("h20").price_is_assumed and not load_profile("h100-80gb").price_is_assumed


def test_price_round_trips_through_a_written_profile(tmp_path: Path) -> None:
    # As a calibration of a GPU profile writes it: the fitted profile keeps the base's price.
    base = load_profile("h200")
    fitted = replace(base, name="h200-fitted", corrections={"train_compute": 1.2})
    out = tmp_path / "h200-fitted.yaml"
    write_profile_file(fitted, out)
    loaded = load_profile_file(out)
    assert loaded.price_per_gpu_hour == base.price_per_gpu_hour
    assert loaded.price_source == base.price_source
    assert loaded.price_is_assumed == base.price_is_assumed


def test_an_unpriced_profile_is_written_as_before_prices_existed(tmp_path: Path) -> None:
    # The calibrated CPU profile, rewritten, is the shipped file: no price keys appear.
    path = Path(resolve_profile_path("cpu-2core-calibrated"))
    header, body = path.read_text().split("\n", 1)
    out = tmp_path / "cpu-2core-calibrated.yaml"
    write_profile_file(load_profile_file(path), out, header=header)
    assert out.read_text() == f"{header}\n{body}"
