"""The command transcripts of the README and docs/, run again: ``python -m
tests.readme_transcripts`` checks them (``make docs`` rewrites the stale lines), and
``tests/test_readme.py`` fails CI on a stale one.

A transcript is a fenced block right after a ``<!-- transcript -->`` line. In it, a line
starting with ``$ hybridflow`` is a command (``\\`` continues it on the next line), run from the
repository root in order (a later command may read what an earlier one wrote under runs/);
the lines after it, up to the next ``$``, are quoted from its output: each must be a line of
what the command prints (stdout and stderr), except ``...``, which stands for lines left out
(inside a line: for columns left out).
A ``$`` line of another program is not run, and the lines after it are not checked. The
search's time and candidate count differ from run to run and machine to machine, so
``searched in X s (N candidates)`` is compared without its numbers.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README] + [ROOT / "docs" / name for name in (
    "commands.md", "job-file.md", "plan-file.md", "search.md", "your-data.md", "executor.md",
    "calibration.md", "simulator.md", "network-and-mixed-clusters.md", "async-modes.md",
    "moe.md", "export-import.md", "paper-study.md", "frameworks.md", "validation.md",
    "performance.md", "development.md", "gpu-clusters.md", "index.md")]
"""The README and docs/, in the order their transcripts run (a later command may read what an
earlier one wrote under runs/)."""
MARK = "<!-- transcript -->"
VOLATILE = [(re.compile(r"searched in [0-9.]+ s \(\d+ candidates\)"),
             "searched in ~ s (~ candidates)")]


@dataclass(slots=True)
class Command:
    """One ``$ hybridflow ...`` of a transcript and the README lines quoted from its output."""

    argv: list[str]
    quoted: list[int] = field(default_factory=list)
    """Indexes of the README's lines quoted from this command's output."""


def normalized(line: str) -> str:
    for pattern, replacement in VOLATILE:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def printed_as(quoted: str, printed: list[str]) -> bool:
    """Whether the quoted line is one the command printed (``...`` inside it: any text)."""
    if "..." not in quoted.strip():
        return quoted in printed
    pattern = re.compile(".*".join(re.escape(part.strip()) for part in quoted.split("...")))
    return any(pattern.fullmatch(p.strip()) for p in printed)


def transcripts(lines: list[str]) -> list[list[Command | None]]:
    """Per transcript block, its commands in order (None: a command of another program)."""
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARK:
            i += 1
            continue
        i += 1
        assert lines[i].startswith("```"), f"README.md:{i + 1}: {MARK} is not before a block"
        i += 1
        block: list[Command | None] = []
        current: Command | None = None
        while not lines[i].startswith("```"):
            line = lines[i]
            if line.startswith("$ "):
                text = line[2:]
                while text.endswith("\\"):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                argv = shlex.split(text)
                current = Command(argv=argv) if argv[0] == "hybridflow" else None
                block.append(current)
            elif current is not None and line.strip() not in ("...", ""):
                current.quoted.append(i)
            i += 1
        blocks.append(block)
        i += 1
    return blocks


def output_of(argv: list[str]) -> list[str]:
    """What the command prints, stdout then stderr, line by line (normalized). It runs in
    this process, through the entry point ``python -m planner`` calls (``run_cli``): a
    child process each cost a second or more of start-up, and the cost models' caches stay
    warm from one command to the next."""
    done = run_cli(argv[1:], cwd=ROOT, env={"COLUMNS": "200"})
    return [normalized(x) for x in (done.stdout + done.stderr).splitlines()]


def same_row(quoted: str, printed: list[str]) -> str | None:
    """The printed line that replaces a stale quoted one: the same first two words (a table
    row's name and placement), else the same first word (a stage, a strategy, a size)."""
    words = quoted.split()
    for n in (2, 1):
        found = next((p for p in printed if p.split()[:n] == words[:n]), None)
        if found is not None:
            return found
    return None


def stale_lines(lines: list[str]) -> list[tuple[int, str, str | None]]:
    """(README line index, the quoted line, the line the command prints now that has the
    same first two words, or None) for every quoted line the commands no longer print."""
    stale = []
    for block in transcripts(lines):
        for command in block:
            if command is None or not command.quoted:
                if command is not None:
                    output_of(command.argv)  # later commands may read what it writes
                continue
            printed = output_of(command.argv)
            for index in command.quoted:
                quoted = normalized(lines[index])
                if printed_as(quoted, printed):
                    continue
                fresh = None if "..." in quoted else same_row(quoted, printed)
                stale.append((index, lines[index], fresh))
    return stale


def main(argv: list[str]) -> int:
    write = "--write" in argv
    status = 0
    commands = 0
    for document in DOCUMENTS:
        name = document.relative_to(ROOT)
        lines = document.read_text(encoding="utf-8").splitlines()
        commands += sum(len(b) for b in transcripts(lines))
        stale = stale_lines(lines)
        for index, quoted, fresh in stale:
            print(f"{name}:{index + 1}: stale: {quoted.strip()}", file=sys.stderr)
            print(f"{name}:{index + 1}:   now: {fresh.strip() if fresh else '(no such line)'}",
                  file=sys.stderr)
            if write and fresh is not None:
                indent = quoted[:len(quoted) - len(quoted.lstrip())]
                lines[index] = fresh if fresh.startswith(indent) else indent + fresh.lstrip()
        if write and stale:
            temporary = document.with_name(f".{document.name}.tmp")
            temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(temporary, document)
            unresolved = sum(1 for _, _, fresh in stale if fresh is None)
            print(f"rewrote {len(stale) - unresolved} stale line(s) of {name}"
                  + (f"; {unresolved} need a hand" if unresolved else ""), file=sys.stderr)
            status = max(status, 1 if unresolved else 0)
        elif stale:
            status = 1
    if status == 0 and not write:
        print(f"README.md and docs/: every transcript line is what its command prints "
              f"({commands} commands)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
