"""Everything one report shows, assembled once and rendered twice (index.html and report.md), so the
two always agree."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from meshlearn.report.config_table import config_table
from meshlearn.report.explain import idle_notes
from meshlearn.report.figures import RenderedFigure
from meshlearn.report.records import RunData
from meshlearn.report.samples import Sample, run_sample
from meshlearn.report.status import unfinished_lines
from meshlearn.report.table import Table, comparison_table, run_notes, trust_table, verifier_table


@dataclass(frozen=True)
class FigureRef:
    """A figure as a page links it: its URL relative to the page, or the reason it is absent."""

    title: str
    url: str | None
    note: str
    missing: str


@dataclass(frozen=True)
class ReportPage:
    title: str
    runs: list[tuple[str, str]]  # (label, folder)
    unfinished: list[str]  # one sentence per run that is not finished (stopped, in progress, ended)
    config: Table
    config_differs: list[bool]
    comparison: Table
    notes: list[str]  # caveats about the data (a run without summary, ...)
    explanations: list[str]  # what the comparison's columns mean, with the runs' numbers
    figures: list[FigureRef]
    verifier: Table | None
    bans: Table | None
    samples: list[tuple[str, Sample]]


def figure_refs(figures: Sequence[RenderedFigure], out_dir: Path) -> list[FigureRef]:
    """Image URLs relative to ``out_dir`` (the page's folder), so the folder stays portable."""
    refs = []
    for f in figures:
        url = None
        if f.path is not None:
            url = quote(Path(os.path.relpath(Path(f.path).resolve(), Path(out_dir).resolve())).as_posix())
        refs.append(FigureRef(f.title, url, f.note, f.missing))
    return refs


def build_page(runs: Sequence[RunData], figures: Sequence[RenderedFigure], out_dir: Path,
               samples: bool = True) -> ReportPage:
    config, differs = config_table(runs)
    return ReportPage(
        title="meshlearn report: " + ", ".join(r.label for r in runs),
        runs=[(r.label, str(r.path)) for r in runs],
        unfinished=unfinished_lines(runs),
        config=config,
        config_differs=differs,
        comparison=comparison_table(runs),
        notes=run_notes(runs),
        explanations=idle_notes(runs),
        figures=figure_refs(figures, out_dir),
        verifier=verifier_table(runs),
        bans=trust_table(runs),
        samples=[(r.label, run_sample(r)) for r in runs] if samples else [],
    )
