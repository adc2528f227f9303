"""The report's figures as one ordered registry: a figure is a name, a title, a function that draws
it and a one-line explanation. ``render_report`` draws them in this order.

To add a figure, append a ``FigureSpec`` to ``FIGURES`` (or call ``register_figure`` from your own
module, ``after=`` an existing name). ``draw(runs, path)`` writes the PNG and returns its path, or
returns None when no run has the data (the page then says ``missing`` instead of showing an empty
plot). ``note(runs)`` is the sentence shown beside the figure; it may quote numbers of the runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshlearn.report import explain, plots, plots_timeline, plots_training, plots_trust
from meshlearn.report.records import RunData

Draw = Callable[[Sequence[RunData], Path], Path | None]
Note = Callable[[Sequence[RunData]], str]
Missing = str | Callable[[Sequence[RunData]], str]  # why no run has the figure, fixed or per runs


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem of the PNG, unique in the report
    title: str
    draw: Draw
    note: Note = lambda runs: ""
    missing: Missing = "no run recorded the data"


@dataclass(frozen=True)
class RenderedFigure:
    """One figure as the page shows it: an image (``path``) or, when absent, why (``missing``)."""

    name: str
    title: str
    path: Path | None
    note: str
    missing: str


FIGURES: list[FigureSpec] = [
    FigureSpec("loss_vs_step", "Loss by step", plots.plot_loss_vs_step, explain.loss_note),
    FigureSpec("loss_vs_sim_time", "Loss by virtual time", plots.plot_loss_vs_sim_time,
               explain.sim_time_note),
    FigureSpec("lr_grad_norm", "Learning rate and gradient norm", plots_training.plot_lr_grad_norm,
               explain.grad_norm_note),
    FigureSpec("throughput", "Throughput", plots_training.plot_throughput, explain.throughput_note),
    FigureSpec("bytes_per_token", "Communication per token", plots.plot_bytes_per_token,
               explain.bytes_per_token_note),
    FigureSpec("link_bytes", "Bytes per link", plots.plot_link_bytes, explain.link_note,
               "no run has per-link counters (summary.json missing)"),
    FigureSpec("timeline", "Pipeline timeline", plots_timeline.plot_timeline, explain.timeline_note,
               explain.timeline_missing),
    FigureSpec("staleness", "Staleness", plots_training.plot_staleness, explain.staleness_note,
               "no asynchronous run: gpipe and 1f1b apply every gradient to the weights it was "
               "computed with (staleness 0)"),
    FigureSpec("verifier_flags", "Verifier flags per worker", plots_trust.plot_flags_per_worker,
               explain.flags_note, "no run verified its messages (verify.name = none)"),
    FigureSpec("curvature", "Curvature and its stability thresholds", plots_training.plot_curvature,
               explain.curvature_note, "no run tracked curvature (curvature.every = 0)"),
]


def register_figure(spec: FigureSpec, after: str | None = None) -> None:
    """Add ``spec`` at the end, or right after the figure named ``after``."""
    names = [f.name for f in FIGURES]
    if spec.name in names:
        raise ValueError(f"figure {spec.name!r} is registered twice")
    FIGURES.insert(names.index(after) + 1 if after is not None else len(FIGURES), spec)


def render_figures(runs: Sequence[RunData], out_dir: Path) -> list[RenderedFigure]:
    """Draw every registered figure into ``out_dir``; one entry per figure, drawn or not."""
    out = []
    for spec in FIGURES:
        target = Path(out_dir) / f"{spec.name}.png"
        path = spec.draw(runs, target)
        if path is None:
            target.unlink(missing_ok=True)  # a figure of an earlier report into the same folder
        missing = "" if path else spec.missing(runs) if callable(spec.missing) else spec.missing
        out.append(RenderedFigure(spec.name, spec.title, path, spec.note(runs) if path else "", missing))
    return out
