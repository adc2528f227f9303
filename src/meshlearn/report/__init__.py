"""Run reports: HTML/Markdown comparison of one or more run folders, and console progress.

``render_report`` imports the plotting code lazily so that a training loop importing
``meshlearn.report.progress`` does not pay for matplotlib.
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


def _unique_labels(runs: list[RunData]) -> list[RunData]:
    """Suffix repeated labels (" #2", " #3") so legends and table rows stay distinguishable."""
    seen: dict[str, int] = {}
    out = []
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        n = seen[run.label]
        out.append(run if n == 1 else dataclasses.replace(run, label=f"{run.label} #{n}"))
    return out


def render_report(
    run_dirs: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    out_dir: Path | None = None,
) -> Path:
    """Render index.html, report.md and the plots for ``run_dirs``; return index.html's path.

    All runs are loaded before anything is written, so a bad path leaves no partial report.
    """
    from meshlearn.report import plots
    from meshlearn.report.html import write_html

    if isinstance(run_dirs, str | os.PathLike):
        run_dirs = [run_dirs]
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("render_report needs at least one run folder")
    runs = _unique_labels([load_run(p) for p in paths])
    out = Path(out_dir) if out_dir is not None else default_out_dir(paths)
    out.mkdir(parents=True, exist_ok=True)
    plot_paths = [
        plots.plot_loss_vs_step(runs, out / "loss_vs_step.png"),
        plots.plot_loss_vs_sim_time(runs, out / "loss_vs_sim_time.png"),
        plots.plot_bytes_per_token(runs, out / "bytes_per_token.png"),
        plots.plot_link_utilization(runs, out / "link_utilization.png"),
    ]
    if (curvature := plots.plot_curvature(runs, out / "curvature.png")) is not None:
        plot_paths.append(curvature)
    return write_html(runs, plot_paths, out / INDEX_NAME)
