"""The validation result cached between processes (simulator/validation.py): the same result
as computing it, a new file whenever an input changes, and never a stale or broken read."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import validation
from simulator.validation import _validation_cache_path, cached_validation, run_validation


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("HYBRIDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cached_validation.cache_clear()
    yield tmp_path / "cache"
    cached_validation.cache_clear()


def test_a_cached_result_is_the_computed_one(fresh: Path) -> None:
    _, groups = cached_validation()              # computed, then written
    assert len(list(fresh.glob("validation-*.json"))) == 1
    cached_validation.cache_clear()
    again, again_groups = cached_validation()    # read back
    computed, computed_groups = run_validation()
    assert again.equals(computed) and again_groups == computed_groups == groups


def test_another_input_names_another_file(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    before = _validation_cache_path()
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "h100-80gb.yaml").write_text("name: h100-80gb\n")  # would shadow the shipped
    monkeypatch.setenv("HYBRIDFLOW_PROFILE_PATH", str(profiles))
    assert _validation_cache_path() != before


def test_a_broken_cache_file_is_computed_again(fresh: Path) -> None:
    path = _validation_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    table, _ = cached_validation()
    assert table.equals(run_validation()[0])
    assert path.read_text().startswith("{\"cases\"")


def test_an_empty_cache_dir_turns_the_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDFLOW_CACHE_DIR", "")
    assert validation._validation_cache_path() is None
