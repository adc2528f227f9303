"""Run reports: HTML/Markdown comparison of one or more run folders (docs/report.md), what a run
records for them (``report.*``: the pipeline timeline, TensorBoard), and console progress.

``render_report`` imports the plotting code lazily so that a training loop importing
``meshlearn.report.progress`` (or the report's plugins) does not pay for matplotlib.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from meshlearn.report.records import RunData, load_run, read_metrics, read_summary

__all__ = ["RunData", "load_run", "read_metrics", "read_summary", "render_report"]

INDEX_NAME = "index.html"


def default_out_dir(run_dirs: Sequence[Path]) -> Path:
    """``<run>/report`` for one run, ``<first run>/report-compare`` for several."""
    first = Path(run_dirs[0])
    return first / ("report" if len(run_dirs) == 1 else "report-compare")


def unique_labels(runs: list[RunData]) -> list[RunData]:
    """Label each run by its folder name; where two folders share a name, by as many trailing path
    parts as tell them apart (``a/demo``, ``b/demo``); the same folder given twice gets " #2"."""
    parts = [run.path.resolve().parts for run in runs]
    labels = []
    for i, mine in enumerate(parts):
        depth = 1
        while depth < len(mine) and any(other[-depth:] == mine[-depth:] and other != mine
                                        for j, other in enumerate(parts) if j != i):
            depth += 1
        labels.append("/".join(mine[-depth:]))
    seen: dict[str, int] = {}
    out = []
    for run, label in zip(runs, labels, strict=True):
        seen[label] = seen.get(label, 0) + 1
        n = seen[label]
        out.append(dataclasses.replace(run, label=label if n == 1 else f"{label} #{n}"))
    return out


def render_report(
    run_dirs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    out_dir: Path | None = None,
    samples: bool = True,
) -> Path:
    """Render index.html, report.md and the figures for ``run_dirs``; return index.html's path.

    All runs are loaded before anything is written, so a bad path leaves no partial report.
    ``samples``: show the runs' sample generations (generated from small checkpoints if absent).
    """
    from meshlearn.report.figures import render_figures
    from meshlearn.report.html import write_html
    from meshlearn.report.page import build_page

    if isinstance(run_dirs, str | os.PathLike):
        run_dirs = [run_dirs]
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("render_report needs at least one run folder")
    runs = unique_labels([load_run(p) for p in paths])
    out = Path(out_dir) if out_dir is not None else default_out_dir(paths)
    out.mkdir(parents=True, exist_ok=True)
    figures = render_figures(runs, out)
    return write_html(build_page(runs, figures, out, samples), out / INDEX_NAME)
