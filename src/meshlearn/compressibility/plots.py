"""Two plots: normalized spectra per layer type, and validation loss against kept parameters.

Both take plain series keyed by a label, so one run (labels = layers, pipelines) and a comparison
of runs (labels = optimizers) use the same code. Matplotlib's object-oriented API with an Agg
canvas, as in :mod:`meshlearn.report.plots`: no global backend state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from meshlearn.atomic import atomic_path
from meshlearn.compressibility.matrices import BLOCK_KINDS
from meshlearn.compressibility.spectra import MatrixSpectrum

DPI = 110


def _color(index: int):
    return colormaps["tab10"](index % 10)


def _save(fig: Figure, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return path


def plot_spectra(groups: Mapping[str, Sequence[MatrixSpectrum]], path: Path, title: str) -> Path:
    """One panel per layer type; every matrix is a line of σ_i/σ_1 (log scale) against i, coloured
    by its group. Normalizing by σ_1 compares shapes: a faster drop means truncation loses less."""
    kinds = [k for k in BLOCK_KINDS if any(s.kind == k for g in groups.values() for s in g)]
    cols = 4
    rows = -(-len(kinds) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.8 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, kind in zip(axes, kinds, strict=False):
        for i, (label, spectra) in enumerate(groups.items()):
            for j, s in enumerate(m for m in spectra if m.kind == kind):
                top = s.singular_values[0] or 1.0
                ax.plot(range(1, len(s.singular_values) + 1), [v / top for v in s.singular_values],
                        color=_color(i), lw=0.9, alpha=0.8, label=label if j == 0 else None)
        ax.set_yscale("log")
        ax.set_title(kind)
        ax.set_xlabel("index i")
        ax.grid(alpha=0.3)
    for ax in axes[len(kinds):]:
        ax.set_visible(False)
    axes[0].set_ylabel("σ_i / σ_1")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def plot_loss_vs_kept(panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
                      references: Mapping[str, float], path: Path) -> Path:
    """One panel per key of ``panels``, one line per label of (kept fraction, loss) points.

    ``references`` are horizontal dashed lines (an uncompressed loss), in the colour of the line
    with the same label, or black if there is none."""
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    fig = Figure(figsize=(4.2 * len(panels), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True).ravel()
    for ax, (title, curves) in zip(axes, panels.items(), strict=True):
        for label, points in curves.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", color=_color(labels.index(label)), label=label)
        for label, loss in references.items():
            color = _color(labels.index(label)) if label in labels else "black"
            ax.axhline(loss, color=color, ls="--", lw=0.8,
                       label=f"{label} uncompressed" if label in labels else label)
        ax.set_title(title)
        ax.set_xlabel("kept fraction of compressed matrices (measured)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/token)")
    axes[0].legend(fontsize=7)
    return _save(fig, path)
