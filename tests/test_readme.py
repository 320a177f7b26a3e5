"""The README's figures from the default job and its examples are what the commands print
today (tests/readme_transcripts.py; `make docs` rewrites stale lines)."""

from __future__ import annotations

from tests.readme_transcripts import MARK, README, stale_lines, transcripts


def test_every_readme_transcript_is_what_its_commands_print_now() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks = transcripts(lines)
    assert len(blocks) >= 6 and sum(len(b) for b in blocks) >= 10
    stale = stale_lines(lines)
    assert not stale, "stale README lines (run `make docs`):\n" + "\n".join(
        f"README.md:{i + 1}: {quoted.strip()!r} -> now {fresh.strip() if fresh else None!r}"
        for i, quoted, fresh in stale)


def test_a_changed_number_is_caught_and_rewritten() -> None:
    """The check fails on one changed digit and proposes the line the command prints."""
    lines = README.read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("  sync-colocate"))
    mark = max(i for i in range(index) if lines[i].strip() == MARK)
    block = lines[mark:index + 8]
    block[index - mark] = block[index - mark].replace("135.26", "136.35")
    [(where, quoted, fresh)] = stale_lines(block)
    assert where == index - mark and "136.35" in quoted
    assert fresh is not None and "135.26" in fresh
