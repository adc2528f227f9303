"""index.html: one self-contained page (inline CSS, images by relative name) per report.

Self-contained so the report folder can be copied, zipped or served statically as is: no script,
no external stylesheet or font, nothing fetched from the network.
"""

from __future__ import annotations

import html
from pathlib import Path

from meshlearn.atomic import atomic_write_text
from meshlearn.report.markdown import render_markdown
from meshlearn.report.page import ReportPage
from meshlearn.report.table import Table

MARKDOWN_NAME = "report.md"

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; } h3 { font-size: 1.05em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.differs td { background: #fff7e0; }
tr.differs td:first-child { font-weight: bold; }
.notes { color: #8a4b00; }
.unfinished { background: #fff4e0; border-left: 4px solid #d98300; padding: 0.5em 1em 0.5em 2em; }
.explain, .note { color: #444; font-size: 0.9em; max-width: 60em; }
.missing { color: #777; font-style: italic; }
figure { margin: 1em 0 2em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
pre.sample { background: #f7f7f7; padding: 0.8em; white-space: pre-wrap; max-width: 60em;
             font-size: 0.85em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def html_table(table: Table, marked: list[bool] | None = None) -> str:
    """Render ``table`` as an HTML table; every cell is escaped; ``marked`` rows get class differs."""
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    rows = []
    for i, row in enumerate(table.rows):
        cls = ' class="differs"' if marked is not None and marked[i] else ""
        cells = "".join(f'<td class="num">{_e(c)}</td>' if numeric else f"<td>{_e(c)}</td>"
                        for c, numeric in zip(row, table.numeric, strict=True))
        rows.append(f"<tr{cls}>{cells}</tr>")
    body = "\n".join(rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>"


def _list(items: list[str], cls: str) -> list[str]:
    return [f'<ul class="{cls}">' + "".join(f"<li>{_e(n)}</li>" for n in items) + "</ul>"] if items else []


def render_html(page: ReportPage) -> str:
    """The whole page as a string."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(page.title)}</title>",
        f"<style>{_CSS}</style></head>",
        "<body>",
        f"<h1>{_e(page.title)}</h1>",
        "<p>Runs: " + ", ".join(f"{_e(label)} (<code>{_e(path)}</code>)" for label, path in page.runs)
        + "</p>",
        *_list(page.unfinished, "unfinished"),
        "<h2>Configuration</h2>",
    ]
    if len(page.runs) > 1 and any(page.config_differs):
        parts.append('<p class="explain">Highlighted rows differ between the runs.</p>')
    parts += [html_table(page.config, page.config_differs), "<h2>Results</h2>", html_table(page.comparison)]
    parts += _list(page.notes, "notes") + _list(page.explanations, "explain")
    parts.append("<h2>Figures</h2>")
    for f in page.figures:
        parts.append(f"<h3>{_e(f.title)}</h3>")
        if f.url is None:
            parts.append(f'<p class="missing">Not shown: {_e(f.missing)}.</p>')
            continue
        parts.append(f'<figure><img src="{_e(f.url)}" alt="{_e(f.title)}">'
                     + (f'<figcaption class="note">{_e(f.note)}</figcaption>' if f.note else "")
                     + "</figure>")
    if page.verifier is not None or page.bans is not None:
        parts.append("<h2>Verifier trust</h2>")
        if page.verifier is not None:
            parts += ['<p class="explain">Scored against the simulator\'s ground truth: a positive message '
                      "is one an attack changed; a positive worker is a running attacker. FPR: flagged "
                      "share of honest messages.</p>", html_table(page.verifier)]
        if page.bans is not None:
            parts += ["<h3>Banned workers</h3>", html_table(page.bans)]
    if page.samples:
        parts.append("<h2>Samples</h2>")
        for label, sample in page.samples:
            parts.append(f"<h3>{_e(label)}</h3>")
            if sample.text is None:
                parts.append(f'<p class="missing">No sample: {_e(sample.source)}.</p>')
            else:
                parts += [f'<p class="note">{_e(sample.source)}</p>',
                          f'<pre class="sample">{_e(sample.text)}</pre>']
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def write_html(page: ReportPage, out_path: Path) -> Path:
    """Write ``out_path`` (HTML) and ``report.md`` beside it, atomically; return ``out_path``."""
    out_path = Path(out_path)
    atomic_write_text(out_path, render_html(page))
    atomic_write_text(out_path.with_name(MARKDOWN_NAME), render_markdown(page))
    return out_path
