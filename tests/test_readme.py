"""The figures of the README and docs/ from the default job and the examples are what the
commands print today (tests/readme_transcripts.py; `make docs` rewrites stale lines)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.readme_transcripts import DOCUMENTS, MARK, README, ROOT, stale_lines, transcripts


def test_every_transcript_is_what_its_commands_print_now(local_ray: object) -> None:
    blocks = 0
    stale_text = []
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        blocks += len(transcripts(lines))
        stale_text += [f"{document.relative_to(ROOT)}:{i + 1}: {quoted.strip()!r} -> now "
                       f"{fresh.strip() if fresh else None!r}"
                       for i, quoted, fresh in stale_lines(lines)]
    assert blocks >= 10
    assert not stale_text, "stale lines (run `make docs`):\n" + "\n".join(stale_text)


def test_the_readme_stays_a_five_minute_read_and_every_doc_is_listed() -> None:
    """Issue 32: the README within ~300 lines; every page of docs/ is one the transcripts
    check and the README links to; no link of the README or docs/ points at a missing file."""
    import re

    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == {d.name for d in DOCUMENTS if d.parent.name == "docs"}
    readme = README.read_text(encoding="utf-8")
    assert all(f"docs/{page}" in readme for page in pages - {"index.md"})
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)",
                                 document.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue
            assert (document.parent / target).exists(), f"{document.name}: {target}"
    assert Path(ROOT / "docs" / "index.md").exists()


def test_a_changed_number_is_caught_and_rewritten() -> None:
    """The check fails on one changed digit and proposes the line the command prints."""
    lines = README.read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("  sync-colocate"))
    mark = max(i for i in range(index) if lines[i].strip() == MARK)
    block = lines[mark:index + 8]
    printed = re.search(r"\d+\.\d\d", block[index - mark]).group()  # the s/iter column
    changed = f"{float(printed) + 1.09:.2f}"
    block[index - mark] = block[index - mark].replace(printed, changed, 1)
    [(where, quoted, fresh)] = stale_lines(block)
    assert where == index - mark and changed in quoted
    assert fresh is not None and printed in fresh


@functools.cache
def _documented_commands() -> tuple[tuple[str, int, str], ...]:
    """Every ``hybridflow ...`` line of the README and docs/ (a ``$`` prompt or not, lines
    continued with ``\\`` joined): (document, line number, the command's text)."""
    import re

    found = []
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            match = re.match(r"^\s*(?:\$ )?(hybridflow (?:[a-z|]+).*)$", lines[i])
            start = i
            if match:
                text = match.group(1)
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i].strip()
                found.append((document.name, start + 1, text.split("  #")[0]))
            i += 1
    return tuple(found)


def test_every_documented_command_and_option_exists() -> None:
    """Issue 32: the commands the docs show outside their transcripts (synopses and
    examples) cannot go stale either: each names a command of the CLI and only options that
    command takes (a synopsis's ``a|b`` names each command)."""
    import re

    import click

    from planner.cli import cli

    commands = _documented_commands()
    assert len(commands) >= 40
    problems = []
    for document, line, text in commands:
        words = text.split()
        names = words[1].split("|")
        for name in names:
            command = cli.commands.get(name)
            if command is None:
                problems.append(f"{document}:{line}: no command {name!r}")
                continue
            if isinstance(command, click.Group):
                sub = words[2] if len(words) > 2 else ""
                parts = [s for s in sub.split("|") if s in command.commands]
                if not parts:
                    problems.append(f"{document}:{line}: no subcommand {sub!r} of {name}")
                    continue
                targets = [command.commands[s] for s in parts]
            else:
                targets = [command]
            flags = {f for target in targets for p in target.params
                     for f in (*p.opts, *p.secondary_opts)} | {"--help"}
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])", text):
                if flag not in flags:
                    problems.append(f"{document}:{line}: {' '.join(words[:2])} has no "
                                    f"option {flag}")
    assert not problems, "\n".join(problems)


FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".log", ".sh", ".csv")
OUTPUT_FLAGS = ("--out", "-o", "--save-hf", "--framework-out")


def _transcript_line_numbers(lines: list[str]) -> set[int]:
    """Line numbers (from 1) inside the document's transcript blocks."""
    inside: bool | None = False
    numbers = set()
    for i, line in enumerate(lines):
        if line.strip() == MARK:
            inside = None  # the next fence opens a transcript
        elif line.startswith("```"):
            inside = inside is None  # a fence after the mark opens, any other closes
        elif inside:
            numbers.add(i + 1)
    return numbers


def _runnable_examples(document: Path) -> list[tuple[int, list[str]]]:
    """(line, argv) of the document's commands outside its transcripts that run as written,
    in order. The rule, fixed before any was run: optional ``[...]`` parts are dropped; what
    is left is a synopsis, not run, if it still has alternatives (``a|b``), ``...`` or an
    upper-case placeholder (PLAN, LOG, HEAD_IP); and an example runs only when each file it
    reads (a path with ``/`` or a data suffix, not an output flag's value) is in the
    repository or written by an earlier example of the same document."""
    import re
    import shlex

    transcript = _transcript_line_numbers(document.read_text(encoding="utf-8").splitlines())
    written: set[str] = set()
    examples = []
    for name, line, text in _documented_commands():
        if name != document.name or line in transcript:
            continue
        previous = None
        while previous != text:
            previous, text = text, re.sub(r"\[[^\[\]]*\]", " ", text)
        if re.search(r"[\[\]|]|\.\.\.|\b[A-Z][A-Z_]+\b", text):
            continue
        argv = shlex.split(text)
        reads = [a for i, a in enumerate(argv[2:], 2) if ("/" in a or a.endswith(FILE_SUFFIXES))
                 and argv[i - 1] not in OUTPUT_FLAGS]
        if all(any(a.startswith(w + "/") for w in written)
               or ((ROOT / a).exists() and not a.startswith(("runs/", "hybridflow-report")))
               for a in reads):
            examples.append((line, argv))
            written |= {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS}
            if argv[1] == "plan" and "--out" not in argv:
                written.add("hybridflow-report")
    return examples


EXAMPLE_DOCUMENTS = [d for d in DOCUMENTS if _runnable_examples(d)]


@pytest.mark.parametrize("document", EXAMPLE_DOCUMENTS, ids=lambda d: d.name)
def test_every_runnable_example_outside_the_transcripts_runs(document: Path, tmp_path: Path,
                                                             local_ray: object) -> None:
    """Issue 32: a command the docs show outside a transcript runs as written whenever it
    can (see ``_runnable_examples``), from a directory of its own (the repository's
    planner/examples reachable as there), and exits 0; its output is not compared. The
    commands run in this process (``run_cli``), as the transcripts' do, and an ``execute``
    joins the test process's Ray."""
    from tests.conftest import run_cli

    (tmp_path / "planner").symlink_to(ROOT / "planner", target_is_directory=True)
    for line, argv in _runnable_examples(document):
        done = run_cli(argv[1:], cwd=tmp_path, env={"COLUMNS": "200"})
        assert done.returncode == 0, (f"{document.name}:{line}: {' '.join(argv)}\n"
                                      f"{done.stderr[-2000:]}")


def test_the_runnable_examples_are_the_documented_ones() -> None:
    """The rule above keeps the concrete examples and drops the synopses and placeholders."""
    docs = ROOT / "docs"
    lines = {d.name: [" ".join(argv[1:3]) for _, argv in _runnable_examples(d)]
             for d in EXAMPLE_DOCUMENTS}
    assert lines["your-data.md"] == ["plan --config", "execute runs/yd-report/plan.json"]
    assert "estimate train" in lines["commands.md"]
    assert not _runnable_examples(docs / "gpu-clusters.md")  # HEAD_IP: a placeholder
    assert not _runnable_examples(docs / "executor.md")  # job.yaml is the reader's
    assert sum(len(v) for v in lines.values()) >= 10


def test_the_readme_quotes_the_shipped_calibrations_own_accuracy() -> None:
    """Issue 30 item 5: the README's CPU accuracy figures are the shipped calibrated
    profile's held-out figures (its provenance), so a refit cannot leave them stale."""
    import yaml

    profile = yaml.safe_load((ROOT / "profiles" / "devices" / "cpu-2core-calibrated.yaml")
                             .read_text(encoding="utf-8"))
    accuracy = profile["provenance"]["accuracy"]
    quoted = (f"predicted within {accuracy['median_abs_error_pct']:.1f}% median and "
              f"{accuracy['max_abs_error_pct']:.1f}% max on held-out plans")
    assert quoted in " ".join(README.read_text(encoding="utf-8").split())
