"""index.html: one self-contained page (inline CSS, plots by relative name) per report.

Self-contained so the report folder can be copied, zipped or served statically as is.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from meshlearn.atomic import atomic_write_text
from meshlearn.report.markdown import render_markdown
from meshlearn.report.records import RunData
from meshlearn.report.table import Table, comparison_table, run_notes, trust_table

MARKDOWN_NAME = "report.md"

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.notes { color: #8a4b00; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def html_table(table: Table) -> str:
    """Render ``table`` as an HTML table; every cell is escaped."""
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    body = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_e(c)}</td>' if numeric else f"<td>{_e(c)}</td>"
            for c, numeric in zip(row, table.numeric, strict=True)
        )
        + "</tr>"
        for row in table.rows
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"


def plot_references(plot_paths: Sequence[Path], out_dir: Path) -> list[tuple[str, str]]:
    """(caption, URL relative to ``out_dir``) per plot; caption from the file name."""
    refs = []
    for path in plot_paths:
        rel = os.path.relpath(Path(path).resolve(), Path(out_dir).resolve())
        caption = Path(path).stem.replace("_", " ")
        refs.append((caption, quote(Path(rel).as_posix())))
    return refs


def render_html(runs: Sequence[RunData], plot_refs: Sequence[tuple[str, str]]) -> str:
    """The whole page as a string: comparison table, caveats, plots, trust table."""
    title = "meshlearn report: " + ", ".join(r.label for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head>",
        "<body>",
        f"<h1>{_e(title)}</h1>",
        "<p>Runs: "
        + ", ".join(f"{_e(r.label)} (<code>{_e(r.path)}</code>)" for r in runs)
        + "</p>",
        "<h2>Comparison</h2>",
        html_table(comparison_table(runs)),
    ]
    notes = run_notes(runs)
    if notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    trust = trust_table(runs)
    if trust is not None:
        parts += ["<h2>Banned workers</h2>", html_table(trust)]
    if plot_refs:
        parts.append("<h2>Plots</h2>")
        parts += [
            f'<figure><img src="{_e(ref)}" alt="{_e(caption)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>"
            for caption, ref in plot_refs
        ]
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def write_html(runs: Sequence[RunData], plot_paths: Sequence[Path], out_path: Path) -> Path:
    """Write ``out_path`` (HTML) and ``report.md`` beside it, atomically; return ``out_path``.

    Plots are referenced relative to ``out_path``'s folder, so they should live in or
    under it for the page to stay portable.
    """
    out_path = Path(out_path)
    refs = plot_references(plot_paths, out_path.parent)
    atomic_write_text(out_path, render_html(runs, refs))
    atomic_write_text(out_path.with_name(MARKDOWN_NAME), render_markdown(runs, refs))
    return out_path
