"""Which code a calibration was fitted on, and whether that code has changed since.

A calibrated profile's fitted overheads and corrections stand in for what the executor does
and what the cost models leave out, so they hold only for the executor and cost-model code
they were fitted against. ``calibrate`` records a fingerprint of that code (and the git commit
when there is one); ``plan`` compares it with the code it runs on and says when they differ.

The shipped calibrated profile (``make accuracy``) records two narrower things instead: a
fingerprint of the executor code its runs execute (``executor_fingerprint``), and its own
predictions of the calibration plans (``predictions``). CI fails when either moved
(tests/test_shipped_calibration.py), so a change to code that moves neither (another engine, a
cost model the calibration plans do not use, the planner) does not force a refit.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from profiles.device import DeviceProfile

ROOT = Path(__file__).resolve().parents[1]
"""The project's root (the directory holding planner/, simulator/, executor/)."""

FITTED_CODE = ("executor", "simulator/costs", "simulator/predict.py", "simulator/engine.py")
"""The code whose behaviour a calibration's parameters describe: the executor that made the
runs, and the cost models and engine whose form the parameters complete."""


NOT_RUN_BY_CALIBRATION = ("executor/profiler.py", "executor/backends/megatron.py",
                          "executor/backends/megatron_hybrid.py", "executor/backends/vllm.py")
"""Executor code the CPU calibration runs never execute: the device-profile measurement
(``hybridflow profile``) and the Megatron-core and vLLM engines (the runs train with torch and
generate natively)."""


def code_fingerprint(root: Path = ROOT) -> str | None:
    """SHA-256 (first 16 hex digits) over the sources in FITTED_CODE, or None when they are not
    on disk (a planner-only install)."""
    if not (root / "executor").is_dir():
        return None
    return _fingerprint(root, _sources(root, FITTED_CODE))


def executor_fingerprint(root: Path = ROOT) -> str | None:
    """SHA-256 (first 16 hex digits) over the executor code that calibration runs execute
    (the executor less NOT_RUN_BY_CALIBRATION), or None without the executor on disk."""
    if not (root / "executor").is_dir():
        return None
    skipped = {root / p for p in NOT_RUN_BY_CALIBRATION}
    return _fingerprint(root, [f for f in _sources(root, ("executor",)) if f not in skipped])


def _sources(root: Path, entries: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for entry in entries:
        path = root / entry
        if path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
        elif path.is_file():
            files.append(path)
    return files


def _fingerprint(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(file.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def git_commit(root: Path = ROOT) -> str | None:
    """The checkout's commit (with '+dirty' when files differ from it), or None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=root, capture_output=True, text=True, timeout=10,
                                check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def stale_calibration(profile: DeviceProfile, root: Path = ROOT) -> str | None:
    """A one-line warning when ``profile`` was calibrated on executor runs with code that
    differs from the code here; None when it was not calibrated, matches, or cannot be told."""
    provenance = profile.provenance
    if not provenance.fitted_on:
        return None
    if provenance.predictions and provenance.executor_fingerprint:
        # The shipped profile: its predictions are checked by CI; only its runs can go stale.
        current = executor_fingerprint(root)
        if current is None or current == provenance.executor_fingerprint:
            return None
        return (f"profile {profile.name} was calibrated on {provenance.fitted_at or '?'} "
                f"(commit {provenance.commit or 'unknown'}) on runs of executor code that has "
                "changed since, so its quoted error may not hold: re-run `make accuracy`")
    current = code_fingerprint(root)
    if current is None:
        return None
    if not provenance.code_fingerprint:
        when = provenance.fitted_at or "date unknown"
        return (f"profile {profile.name} was calibrated ({when}) without a record of the code "
                "it was fitted on; its quoted error may not hold for this code: re-run "
                "`make accuracy`")
    if provenance.code_fingerprint == current:
        return None
    return (f"profile {profile.name} was calibrated on {provenance.fitted_at or '?'} (commit "
            f"{provenance.commit or 'unknown'}); the executor or cost-model code has changed "
            "since, so its quoted error may not hold: re-run `make accuracy`")
