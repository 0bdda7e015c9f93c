"""One writer for the reports of `multigpu study` and `multigpu tune`: a page of blocks, rendered
as a self-contained HTML file and a Markdown summary.

A page is a title and a list of blocks (text, headings, tables, lists, figures, key/value
pairs); each verb builds its page from its own results and ``write`` renders both forms.
Figures are PNG bytes: embedded in the HTML as base64 (the page needs no network and no
other file) and written next to the Markdown, which links them.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union


@dataclass(frozen=True)
class Text:
    text: str
    lead: bool = False  # the page's headline: set apart in the HTML


@dataclass(frozen=True)
class Heading:
    text: str


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Items:
    items: list[str]


@dataclass(frozen=True)
class Figures:
    pngs: dict[str, bytes]  # name -> PNG; the Markdown links <name>.png


@dataclass(frozen=True)
class Pairs:
    pairs: dict[str, object]


Block = Union[Text, Heading, Table, Items, Figures, Pairs]


@dataclass(frozen=True)
class Page:
    title: str
    blocks: list[Block] = field(default_factory=list)


def markdown(page: Page) -> str:
    lines = [f"# {page.title}"]
    for b in page.blocks:
        lines.append("")
        if isinstance(b, Text):
            lines.append(b.text)
        elif isinstance(b, Heading):
            lines.append(f"## {b.text}")
        elif isinstance(b, Table):
            lines += ["| " + " | ".join(b.header) + " |", "|" + "---|" * len(b.header)]
            lines += ["| " + " | ".join(r) + " |" for r in b.rows]
        elif isinstance(b, Items):
            lines += [f"- {item}" for item in b.items]
        elif isinstance(b, Figures):
            lines += [f"![{name}]({name}.png)" for name in b.pngs]
        elif isinstance(b, Pairs):
            lines += [f"- {k}: {v}" for k, v in b.pairs.items()]
    return "\n".join(lines) + "\n"


_STYLE = """body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
figure { margin: 1.5em 0; } img { max-width: 100%; }
.headline { font-size: 18px; background: #f3f6fa; padding: .6em 1em; border-left: 4px solid #3a6ea5; }"""


def _html_block(b: Block) -> str:
    esc = html.escape
    if isinstance(b, Text):
        return f'<p class="headline">{esc(b.text)}</p>' if b.lead else f"<p>{esc(b.text)}</p>"
    if isinstance(b, Heading):
        return f"<h2>{esc(b.text)}</h2>"
    if isinstance(b, Table):
        head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in b.header) + "</tr>"
        return "<table>" + head + "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in b.rows) + "</table>"
    if isinstance(b, Items):
        return "<ul>" + "".join(f"<li>{esc(item)}</li>" for item in b.items) + "</ul>"
    if isinstance(b, Figures):
        return "".join(f'<figure><img alt="{esc(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
                       f"<figcaption>{esc(name)}</figcaption></figure>" for name, data in b.pngs.items())
    return "<table>" + "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in b.pairs.items()) + "</table>"


def to_html(page: Page) -> str:
    body = "\n".join(_html_block(b) for b in page.blocks)
    title = html.escape(page.title)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
            f"<style>\n{_STYLE}\n</style></head><body>\n<h1>{title}</h1>\n{body}\n</body></html>\n")


def write(page: Page, md_path: Path, html_path: Path) -> None:
    """``md_path`` (with the figures beside it as PNGs) and the self-contained ``html_path``; OSError as raised."""
    md_path, html_path = Path(md_path), Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    for b in page.blocks:
        if isinstance(b, Figures):
            for name, data in b.pngs.items():
                (md_path.parent / f"{name}.png").write_bytes(data)
    md_path.write_text(markdown(page))
    html_path.write_text(to_html(page))
