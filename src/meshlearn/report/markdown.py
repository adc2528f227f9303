"""report.md: the same content as the HTML page, readable in a terminal or on a code host."""

from __future__ import annotations

import html

from meshlearn.report.page import ReportPage
from meshlearn.report.table import Table


def _cell(text: str) -> str:
    # Entities render in Markdown; pipes and newlines would break the table row.
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table, marked: list[bool] | None = None) -> str:
    """Render ``table`` as a GitHub-flavoured Markdown table; ``marked`` rows get their first cell bold."""
    align = ["---:" if numeric else ":---" for numeric in table.numeric]
    lines = [
        "| " + " | ".join(_cell(h) for h in table.headers) + " |",
        "| " + " | ".join(align) + " |",
    ]
    for i, row in enumerate(table.rows):
        cells = [_cell(c) for c in row]
        if marked is not None and marked[i] and cells[0]:
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(page: ReportPage) -> str:
    """The whole report.md."""
    parts = ["# meshlearn report", "", "Runs: " + ", ".join(f"{_cell(label)} (`{path}`)"
                                                           for label, path in page.runs), ""]
    for line in page.unfinished:
        parts += [f"> **Not finished:** {_cell(line)}", ""]
    parts += ["## Configuration", ""]
    if len(page.runs) > 1 and any(page.config_differs):
        parts += ["Rows in bold differ between the runs.", ""]
    parts += [markdown_table(page.config, page.config_differs), "", "## Results", "",
              markdown_table(page.comparison)]
    for items in (page.notes, page.explanations):
        if items:
            parts += ["", *[f"- {_cell(n)}" for n in items]]
    parts += ["", "## Figures", ""]
    for f in page.figures:
        parts += [f"### {_cell(f.title)}", ""]
        if f.url is None:
            parts += [f"*Not shown: {_cell(f.missing)}.*", ""]
            continue
        parts += [f"![{_cell(f.title)}]({f.url})", ""]  # one paragraph per image, so they stack
        if f.note:
            parts += [_cell(f.note), ""]
    if page.verifier is not None or page.bans is not None:
        parts += ["## Verifier trust", ""]
        if page.verifier is not None:
            parts += [markdown_table(page.verifier), ""]
        if page.bans is not None:
            parts += ["### Banned workers", "", markdown_table(page.bans), ""]
    if page.samples:
        parts += ["## Samples", ""]
        for label, sample in page.samples:
            parts += [f"### {_cell(label)}", ""]
            if sample.text is None:
                parts += [f"*No sample: {_cell(sample.source)}.*", ""]
            else:
                fence = "````" if "```" in sample.text else "```"
                parts += [_cell(sample.source), "", fence + "text", sample.text, fence, ""]
    return "\n".join(parts).rstrip("\n") + "\n"
