"""A report as plain data (a title, a summary and a list of blocks), written as Markdown and
as a self-contained HTML page from the same blocks, so the two cannot drift apart. What goes
into a report is decided by its producer (the planner's ``planner/report.py``); this module
knows tables, paragraphs and images, nothing about plans."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from profiles.datafile import write_text_atomic


@dataclass(frozen=True, slots=True)
class Heading:
    text: str
    level: int = 2
    """1 = the page title's level; 2 = a section; 3 = a subsection."""


@dataclass(frozen=True, slots=True)
class Paragraph:
    text: str
    """Markdown inline text: **bold** and `code` become <b> and <code> in HTML."""


@dataclass(frozen=True, slots=True)
class Bullets:
    lines: tuple[str, ...]
    """One item each (Markdown inline text, without the leading '- ')."""


@dataclass(frozen=True, slots=True)
class Note:
    text: str
    """A highlighted remark (a Markdown quote; a shaded paragraph in HTML)."""


@dataclass(frozen=True, slots=True)
class Table:
    frame: pd.DataFrame
    index: bool = False
    """Write the frame's index as the first column."""
    index_name: str | None = None
    """The index column's header in Markdown (default: the index's own name)."""
    markdown_drop: tuple[str, ...] = ()
    """Columns the Markdown table leaves out (too wide to read there)."""


@dataclass(frozen=True, slots=True)
class Image:
    path: Path
    """A PNG beside the report: linked from the Markdown, embedded in the HTML."""


Block = Heading | Paragraph | Bullets | Note | Table | Image


@dataclass(frozen=True, slots=True)
class Document:
    title: str
    summary: tuple[tuple[str, str], ...] = ()
    """(key, value) lines under the title."""
    blocks: tuple[Block, ...] = field(default_factory=tuple)


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".2f") -> str:
    """A GitHub-flavoured Markdown table (floats with ``floatfmt``, NaN blank, '|' escaped)."""
    if frame.empty:
        return "(none)"
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = [header, rule]
    for _, row in frame.iterrows():
        cells = []
        for value in row:
            if isinstance(value, float):
                cells.append("" if pd.isna(value) else format(value, floatfmt))
            else:
                cells.append(str(value).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown_block(block: Block) -> list[str]:
    if isinstance(block, Heading):
        return ["#" * block.level + " " + block.text, ""]
    if isinstance(block, Paragraph):
        return [block.text, ""]
    if isinstance(block, Bullets):
        return [*(f"- {line}" for line in block.lines), ""]
    if isinstance(block, Note):
        return [f"> {block.text}", ""]
    if isinstance(block, Table):
        frame = block.frame.drop(columns=list(block.markdown_drop))
        if block.index:
            frame = frame.reset_index(names=block.index_name)
        return [markdown_table(frame), ""]
    return [f"![{block.path.stem}]({block.path.name})", ""]


def to_markdown(document: Document) -> str:
    lines = [f"# {document.title}", ""]
    if document.summary:
        lines += [*(f"- **{key}**: {value}" for key, value in document.summary), ""]
    for block in document.blocks:
        lines += _markdown_block(block)
    return "\n".join(lines)


_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")


def inline_html(text: str) -> str:
    """Markdown inline text as HTML: escaped, with **bold** and `code`."""
    escaped = html.escape(text)
    return _CODE.sub(r"<code>\1</code>", _BOLD.sub(r"<b>\1</b>", escaped))


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{inline_html(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{inline_html(block.text)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{inline_html(line)}</li>" for line in block.lines) + \
            "</ul>"
    if isinstance(block, Note):
        return f"<p class='note'>{inline_html(block.text)}</p>"
    if isinstance(block, Table):
        return block.frame.to_html(index=block.index, float_format=lambda v: f"{v:,.2f}",
                                   na_rep="", border=0, classes="table")
    data = base64.b64encode(block.path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(block.path.stem)}" src="data:image/png;base64,{data}">'


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:1em 0;font-size:13px}"
         "td,th{padding:4px 8px;border-bottom:1px solid #ddd;text-align:left}"
         "img{max-width:100%;margin:1em 0}.note{background:#f6f6f6;padding:8px}"
         "code{font-size:90%}")


def to_html(document: Document) -> str:
    """One page with the figures embedded (base64 PNGs): it can be mailed on its own."""
    parts = [f"<h1>{inline_html(document.title)}</h1>"]
    if document.summary:
        parts.append("<ul>" + "".join(f"<li><b>{html.escape(key)}</b>: {inline_html(value)}"
                                      "</li>" for key, value in document.summary) + "</ul>")
    parts += [_html_block(block) for block in document.blocks]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(document.title)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def write_document(document: Document, directory: Path, stem: str, *,
                   html_too: bool = True) -> tuple[Path, Path | None]:
    """``directory/stem.md`` (and ``stem.html``), each replaced atomically; the paths."""
    markdown = directory / f"{stem}.md"
    write_text_atomic(markdown, to_markdown(document))
    if not html_too:
        return markdown, None
    page = directory / f"{stem}.html"
    write_text_atomic(page, to_html(document))
    return markdown, page
