"""The figures of the README and docs/ from the default job and the examples are what the
commands print today (tests/readme_transcripts.py; `make docs` rewrites stale lines)."""

from __future__ import annotations

from pathlib import Path

from tests.readme_transcripts import DOCUMENTS, MARK, README, ROOT, stale_lines, transcripts


def test_every_transcript_is_what_its_commands_print_now() -> None:
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
    block[index - mark] = block[index - mark].replace("135.26", "136.35")
    [(where, quoted, fresh)] = stale_lines(block)
    assert where == index - mark and "136.35" in quoted
    assert fresh is not None and "135.26" in fresh
