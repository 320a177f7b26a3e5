"""reports/document.py: one list of blocks written as Markdown and as HTML (issue 32: the
plan report's two versions were each built by hand and had drifted apart)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from reports.document import (
    Bullets,
    Document,
    Heading,
    Image,
    Note,
    Paragraph,
    Table,
    inline_html,
    markdown_table,
    to_html,
    to_markdown,
    write_document,
)

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")
"""A 1 x 1 PNG."""


def _document(directory: Path) -> Document:
    (directory / "figure.png").write_bytes(PNG)
    frame = pd.DataFrame({"name": ["a|b", "c"], "seconds": [1.5, float("nan")],
                          "wide": [1, 2]}).set_index("name")
    return Document(title="Plan <7B>", summary=(("cluster", "2 nodes of `8`"),),
                    blocks=(Note("Profile **x**"), Heading("Best"), Paragraph("**1.0 s** each"),
                            Bullets(("one", "`two`")), Heading("Detail", 3),
                            Table(frame, index=True, index_name="operation",
                                  markdown_drop=("wide",)),
                            Image(directory / "figure.png")))


def test_markdown_and_html_carry_the_same_blocks(tmp_path: Path) -> None:
    document = _document(tmp_path)
    markdown = to_markdown(document)
    assert markdown.splitlines()[:4] == ["# Plan <7B>", "", "- **cluster**: 2 nodes of `8`", ""]
    assert "> Profile **x**" in markdown and "## Best" in markdown and "### Detail" in markdown
    assert "- one\n- `two`" in markdown and "![figure](figure.png)" in markdown
    assert "| operation | seconds |\n|---|---|\n| a\\|b | 1.50 |\n| c |  |" in markdown
    page = to_html(document)
    assert "<h1>Plan &lt;7B&gt;</h1>" in page and "<title>Plan &lt;7B&gt;</title>" in page
    assert "<li><b>cluster</b>: 2 nodes of <code>8</code></li>" in page
    assert "<p class='note'>Profile <b>x</b></p>" in page and "<h3>Detail</h3>" in page
    assert "<ul><li>one</li><li><code>two</code></li></ul>" in page
    assert "<th>wide</th>" in page  # the HTML table keeps what Markdown leaves out
    assert 'src="data:image/png;base64,' in page


def test_inline_markup_is_escaped_before_it_is_marked_up() -> None:
    assert inline_html("**a<b>** and `x&y`") == "<b>a&lt;b&gt;</b> and <code>x&amp;y</code>"
    assert markdown_table(pd.DataFrame()) == "(none)"


def test_documents_are_written_whole(tmp_path: Path) -> None:
    markdown, page = write_document(_document(tmp_path), tmp_path, "report")
    assert markdown.read_text() == to_markdown(_document(tmp_path))
    assert page is not None and page.read_text().endswith("</body></html>\n")
    only, none = write_document(Document(title="t"), tmp_path, "compare", html_too=False)
    assert only.read_text() == "# t\n" and none is None
    assert not (tmp_path / "compare.html").exists()
