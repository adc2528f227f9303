"""report.md: the same tables as the HTML page, readable in a terminal or on a code host."""

from __future__ import annotations

import html
from collections.abc import Sequence

from meshlearn.report.records import RunData
from meshlearn.report.table import Table, comparison_table, run_notes, trust_table


def _cell(text: str) -> str:
    # Entities render in Markdown; pipes and newlines would break the table row.
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table) -> str:
    """Render ``table`` as a GitHub-flavoured Markdown table."""
    align = ["---:" if numeric else ":---" for numeric in table.numeric]
    lines = [
        "| " + " | ".join(_cell(h) for h in table.headers) + " |",
        "| " + " | ".join(align) + " |",
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def render_markdown(runs: Sequence[RunData], plot_refs: Sequence[tuple[str, str]]) -> str:
    """Whole report.md: comparison table, caveats, plots (relative links), trust table."""
    parts = ["# meshlearn report", "", markdown_table(comparison_table(runs))]
    notes = run_notes(runs)
    if notes:
        parts += ["", *[f"- {_cell(n)}" for n in notes]]
    trust = trust_table(runs)
    if trust is not None:
        parts += ["", "## Banned workers", "", markdown_table(trust)]
    if plot_refs:
        parts += ["", "## Plots", ""]
        for caption, ref in plot_refs:  # one paragraph per image, so they stack
            parts += [f"![{_cell(caption)}]({ref})", ""]
    return "\n".join(parts).rstrip("\n") + "\n"
