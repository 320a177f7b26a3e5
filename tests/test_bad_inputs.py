"""The bad-input corpus (tests/bad_inputs/cases.yaml) through every command.

Each case breaks one good input (tests/bad_inputs/good/) in one way and runs it through the
commands it names. Every run must end within ``TIMEOUT_SECONDS`` with a non-zero exit and one
line naming the broken file (or flag), the key and the problem; no traceback; and every file
that was on disk before (inputs, an earlier report, an earlier profile) exactly as it was, with
nothing new written beside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import EXAMPLES, ROOT

CORPUS = ROOT / "tests" / "bad_inputs"
GOOD = CORPUS / "good"
TIMEOUT_SECONDS = 60.0
"""A case still running after this long counts as a hang (the slowest good input of any
command here takes under 10 s on a 2-core machine)."""

INPUT_PATHS = {
    "job": "job.yaml", "plan": "plan.json", "profile": "profile.yaml", "model": "model.yaml",
    "hf_config": "hf/config.json", "run": "run", "data": "your-data",
    "data_plan": "data-plan.json", "verl_log": "verl-log.jsonl",
}
"""Where each good input lives in a case's sandbox (relative paths)."""


@dataclass(kw_only=True, slots=True)
class Case:
    """One broken input and the commands it goes through."""

    id: str
    """Unique name (the pytest id, with the command)."""
    input: str = "none"
    """The good input this case breaks (a key of ``INPUT_PATHS``), or none for flags only."""
    file: str | None = None
    """For directory inputs (run, data): the file inside that is broken."""
    commands: list[str] = field(default_factory=list)
    """Command templates (``commands:`` in cases.yaml) to run it through."""
    args: list[str] | None = None
    """A whole command line instead of templates (flag cases)."""
    extra: list[str] = field(default_factory=list)
    """Arguments appended to each template."""
    edits: dict[str, Any] = field(default_factory=dict)
    """How the input is broken (text, replace, set, delete, truncate, bytes, kind, csv)."""
    expect: list[str] = field(default_factory=list)
    """Text the one-line message must contain, besides the broken file's name."""
    names_file: bool = True
    """Whether the message must name the broken file (false for flag cases)."""
    exit: int = 2
    """Expected exit status (2: bad input; 1: a valid job that cannot run)."""


def load_corpus() -> tuple[dict[str, list[str]], list[Case]]:
    data = yaml.safe_load((CORPUS / "cases.yaml").read_text(encoding="utf-8"))
    templates = data["commands"]
    cases = []
    edit_keys = {"text", "replace", "set", "delete", "truncate", "bytes", "kind", "csv", "append"}
    for raw in data["cases"]:
        edits = {k: raw.pop(k) for k in list(raw) if k in edit_keys}
        case = Case(**raw, edits=edits)
        unknown = [c for c in case.commands if c not in templates]
        assert not unknown, f"case {case.id}: unknown command template {unknown}"
        cases.append(case)
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return templates, cases


TEMPLATES, CASES = load_corpus()
RUNS = [(case, command) for case in CASES for command in (case.commands or ["args"])]


# --- building a case's sandbox ------------------------------------------------------------

def build_sandbox(root: Path) -> None:
    """The good inputs, plus earlier outputs that a failed command must leave alone."""
    for name in ("job.yaml", "plan.json", "profile.yaml", "model.yaml", "data-plan.json",
                 "verl-log.jsonl"):
        shutil.copy(GOOD / name, root / name)
    (root / "hf").mkdir()
    shutil.copy(GOOD / "config.json", root / "hf" / "config.json")
    shutil.copytree(GOOD / "run", root / "run")
    shutil.copytree(GOOD / "run", root / "good-run")
    job = yaml.safe_load((GOOD / "job.yaml").read_text(encoding="utf-8"))
    job["cluster"]["device"] = str(root / "profile.yaml")
    (root / "device-job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    shutil.copytree(EXAMPLES / "your-data", root / "your-data",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = root / "out"
    out.mkdir()
    (out / "plan.json").write_text('{"earlier": "plan"}\n')
    (out / "report.md").write_text("# an earlier report\n")
    (out / "profile.yaml").write_text("# an earlier profile\n")
    (out / "calibrated.yaml").write_text("# an earlier calibrated profile\n")


def _dotted(document: Any, dotted: str) -> tuple[Any, Any]:
    """(container, key) of a dotted path (numbers index lists)."""
    parts = dotted.split(".")
    node = document
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    return node, (int(last) if isinstance(node, list) else last)


def _structured_edit(path: Path, edits: dict[str, Any]) -> None:
    text = path.read_text(encoding="utf-8")
    is_json = path.suffix == ".json"
    document = json.loads(text) if is_json else yaml.safe_load(text)
    for dotted, value in (edits.get("set") or {}).items():
        node, key = _dotted(document, dotted)
        node[key] = value
    for dotted in edits.get("delete") or []:
        node, key = _dotted(document, dotted)
        del node[key]
    path.write_text(json.dumps(document) if is_json else yaml.safe_dump(document),
                    encoding="utf-8")


def _csv_edit(path: Path, edit: dict[str, Any]) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    if "drop_column" in edit:
        index = header.index(edit["drop_column"])
        lines = [",".join(v for i, v in enumerate(line.split(",")) if i != index)
                 for line in lines]
    if "line" in edit:
        import csv
        import io

        row = next(csv.reader([lines[edit["line"] - 1]]))
        row[header.index(edit["column"])] = edit["value"]
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="").writerow(row)
        lines[edit["line"] - 1] = buffer.getvalue()
    if "keep_lines" in edit:
        lines = lines[: edit["keep_lines"]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def break_input(root: Path, case: Case) -> Path | None:
    """Apply the case's edits; the broken file's path (None for flag cases)."""
    if case.input == "none":
        return None
    target = root / INPUT_PATHS[case.input]
    if case.file:
        target = target / case.file
    edits = case.edits
    kind = edits.get("kind")
    if kind:
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        if kind == "directory":
            target.mkdir()
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "symlink_loop":
            target.symlink_to(target.name)
        elif kind == "dangling_symlink":
            target.symlink_to(root / "nowhere" / target.name)
        elif kind == "empty_directory_as_run":
            target.mkdir()
        else:
            assert kind == "missing", f"case {case.id}: unknown kind {kind}"
        return target
    if "text" in edits:
        target.write_text(edits["text"], encoding="utf-8")
    if "bytes" in edits:
        target.write_bytes(bytes.fromhex(edits["bytes"]))
    for old, new in edits.get("replace") or []:
        text = target.read_text(encoding="utf-8")
        assert old in text, f"case {case.id}: {old!r} is not in {target.name}"
        target.write_text(text.replace(old, new, 1), encoding="utf-8")
    if "set" in edits or "delete" in edits:
        _structured_edit(target, edits)
    if "append" in edits:
        with target.open("a", encoding="utf-8") as handle:
            handle.write(edits["append"])
    if "csv" in edits:
        _csv_edit(target, edits["csv"])
    if "truncate" in edits:
        data = target.read_bytes()
        target.write_bytes(data[: int(len(data) * edits["truncate"])])
    return target


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file and directory under ``root``: content hash (or kind) and mode."""
    seen = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink() or path.is_fifo():
            seen[relative] = ("special", 0)
        elif path.is_dir():
            seen[relative] = ("directory", path.stat().st_mode)
        else:
            seen[relative] = (hashlib.sha256(path.read_bytes()).hexdigest(),
                              path.stat().st_mode)
    return seen


# --- running ------------------------------------------------------------------------------

class Runner:
    """The forking runner (tests/bad_inputs/runner.py), started once per session."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        env.pop("HYBRIDFLOW_DEBUG", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.bad_inputs.runner"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        assert json.loads(ready) == {"ready": True}, ready

    def run(self, argv: list[str], cwd: Path) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"argv": argv, "cwd": str(cwd), "timeout_seconds": TIMEOUT_SECONDS}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    started = Runner()
    yield started
    started.close()


def command_line(case: Case, command: str, root: Path) -> list[str]:
    template = case.args if command == "args" else [*TEMPLATES[command], *case.extra]
    assert template is not None
    paths = {name: str(root / relative) for name, relative in INPUT_PATHS.items()}
    paths["out"] = str(root / "out")
    paths["root"] = str(root)
    return [part.format(**paths) for part in template]


def test_the_corpus_is_big_enough_and_covers_every_command() -> None:
    assert len(RUNS) >= 150
    commands = {c.split("-")[0] for _, c in RUNS if c != "args"}
    commands |= {case.args[0] for case, c in RUNS if c == "args" and case.args}
    assert {"plan", "compare", "simulate", "estimate", "execute", "calibrate", "accuracy",
            "profile"} <= commands


@pytest.mark.parametrize(("case", "command"), RUNS,
                         ids=[f"{case.id}[{command}]" for case, command in RUNS])
def test_bad_input_gets_one_line_and_damages_nothing(case: Case, command: str,
                                                      runner: Runner, tmp_path: Path) -> None:
    root = tmp_path / "sandbox"
    root.mkdir()
    build_sandbox(root)
    broken = break_input(root, case)
    before = snapshot(root)
    argv = command_line(case, command, root)
    outcome = runner.run(argv, root)

    shown = f"hybridflow {' '.join(argv)}\nexit {outcome['exit_code']}\n{outcome['stderr']}"
    assert not outcome["timed_out"], f"hang (> {TIMEOUT_SECONDS} s):\n{shown}"
    assert "Traceback" not in outcome["stderr"], shown
    assert "internal error" not in outcome["stderr"], shown
    assert outcome["exit_code"] == case.exit, shown
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("hybridflow: warning:")]
    assert len(errors) == 1, f"not one line:\n{shown}"
    message = errors[0]
    if broken is not None and case.names_file:
        assert broken.name in message, f"the message does not name {broken.name}:\n{shown}"
    for expected in case.expect:
        assert expected in message, f"the message does not say {expected!r}:\n{shown}"
    assert snapshot(root) == before, f"files on disk changed:\n{shown}"
