"""Comparison plots, one PNG per function, all runs on the same axes.

Uses matplotlib's object-oriented API with an explicit Agg canvas instead of pyplot: no
global backend state, no window, and no figures leaking between calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from meshlearn.atomic import atomic_path
from meshlearn.report.records import RunData
from meshlearn.report.stats import run_stats
from meshlearn.report.units import as_number, format_amount, time_axis_unit

DPI = 110
LOSS_LABEL = "cross-entropy loss (nats/token)"
AXIS_COLORS = {"pp": "tab:blue", "dp": "tab:orange"}
_OTHER_AXIS_COLOR = "tab:gray"


def run_color(index: int) -> Any:
    """Colour of the ``index``-th run, identical in every plot of the report."""
    return colormaps["tab10"](index % 10)


def _new_figure(width: float = 7.5, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_path: Path) -> Path:
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return out_path


def _series(records: Sequence[dict], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """Finite (x, y) pairs; records missing either value (or NaN) are skipped."""
    xs, ys = [], []
    for r in records:
        x, y = as_number(r.get(x_key)), as_number(r.get(y_key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_loss(
    runs: Sequence[RunData], out_path: Path, x_key: str, xlabel: str, x_scale: float, title: str
) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        color = run_color(i)
        xs, ys = _series(run.train_records, x_key, "train_loss")
        if xs:
            ax.plot(
                [x / x_scale for x in xs],
                ys,
                color=color,
                lw=0.8,
                alpha=0.6,
                label=f"{run.label} train",
            )
        xs, ys = _series(run.eval_records, x_key, "val_loss")
        if xs:
            ax.plot(
                [x / x_scale for x in xs],
                ys,
                color=color,
                lw=1.8,
                marker="o",
                ms=4,
                label=f"{run.label} val",
            )
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        _no_data(ax, "no loss records")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(LOSS_LABEL)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return _save(fig, out_path)


def plot_loss_vs_step(runs: Sequence[RunData], out_path: Path) -> Path:
    """Train loss (thin line) and val loss (markers) against optimizer step."""
    return _plot_loss(runs, out_path, "step", "optimizer step", 1.0, "Loss vs step")


def plot_loss_vs_sim_time(runs: Sequence[RunData], out_path: Path) -> Path:
    """Loss against virtual-clock time: what the run would take on the simulated mesh."""
    times = [
        t
        for run in runs
        for record in (*run.train_records, *run.eval_records)
        if (t := as_number(record.get("sim_time_s"))) is not None
    ]
    unit, scale = time_axis_unit(max(times, default=0.0))
    return _plot_loss(
        runs, out_path, "sim_time_s", f"simulated time ({unit})", scale, "Loss vs virtual time"
    )


def plot_bytes_per_token(runs: Sequence[RunData], out_path: Path) -> Path:
    """Wire bytes per trained token on the pipeline and data-parallel axes, per run."""
    stats = [run_stats(r) for r in runs]
    fig = _new_figure(max(5.0, 1.3 * len(runs) + 3.0), 4.5)
    ax = fig.add_subplot()
    width = 0.38
    xs = range(len(stats))
    for offset, axis, values in (
        (-width / 2, "pp", [s.bytes_per_token_pp for s in stats]),
        (width / 2, "dp", [s.bytes_per_token_dp for s in stats]),
    ):
        heights = [math.nan if v is None else v for v in values]
        bars = ax.bar(
            [x + offset for x in xs], heights, width, color=AXIS_COLORS[axis], label=f"{axis} axis"
        )
        ax.bar_label(
            bars,
            labels=["" if v is None else format_amount(v) for v in values],
            fontsize="small",
            padding=2,
        )
    ax.set_xticks(list(xs), [s.label for s in stats])
    ax.set_ylabel("wire bytes per token (B/token)")
    ax.set_title("Communication per token")
    ax.margins(y=0.15)
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out_path)


def _links(run: RunData) -> list[dict]:
    """Links with a numeric utilization, pipeline links first (stable within each axis)."""
    links = (run.summary or {}).get("links") or []
    usable = [
        link
        for link in links
        if isinstance(link, dict) and as_number(link.get("utilization")) is not None
    ]
    order = {"pp": 0, "dp": 1}
    return sorted(usable, key=lambda link: order.get(link.get("axis"), 2))


def plot_link_utilization(runs: Sequence[RunData], out_path: Path) -> Path:
    """Busy fraction of every link (busy_s / sim_time_s), one panel per run.

    Shows which links bound the run: a saturated pp link means the pipeline waits on the
    wire, a saturated dp link means gradient exchange does.
    """
    per_run = [_links(r) for r in runs]
    widest = max((len(links) for links in per_run), default=0)
    width = min(30.0, max(7.5, 0.35 * widest + 2.0))
    fig = _new_figure(width, 2.8 * max(1, len(runs)) + 0.6)
    axes = fig.subplots(max(1, len(runs)), 1, squeeze=False)[:, 0]
    for ax, run, links in zip(axes, runs, per_run, strict=False):
        ax.set_title(run.label)
        ax.set_ylabel("utilization (%)")
        if not links:
            reason = "summary.json missing" if run.summary is None else "no links in summary"
            _no_data(ax, f"no link data ({reason})")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        util = [100 * (as_number(link["utilization"]) or 0.0) for link in links]
        colors = [AXIS_COLORS.get(link.get("axis"), _OTHER_AXIS_COLOR) for link in links]
        names = [f"{link.get('src', '?')}→{link.get('dst', '?')}" for link in links]
        ax.bar(range(len(links)), util, width=0.6, color=colors)
        ax.set_xlim(-0.5, max(len(links), 6) - 0.5)  # a few links stay bar-shaped, not slabs
        if len(links) > 6:
            ax.set_xticks(range(len(links)), names, rotation=60, ha="right", fontsize="small")
        else:
            ax.set_xticks(range(len(links)), names, fontsize="small")
        ax.set_xlabel("link (src→dst)")
        ax.set_ylim(0, max(100.0, max(util)) * 1.05)
        ax.grid(True, axis="y", alpha=0.3)
    present = [
        a for a in AXIS_COLORS if any(link.get("axis") == a for ls in per_run for link in ls)
    ]
    if present:  # one legend outside the panels, so it never hides a saturated link
        fig.legend(
            handles=[Patch(color=AXIS_COLORS[a], label=f"{a} link") for a in present],
            loc="outside upper right",
            fontsize="small",
        )
    if not runs:
        _no_data(axes[0], "no runs")
    fig.suptitle("Link utilization (busy time / simulated time)")
    return _save(fig, out_path)


def _curvature_records(run: RunData) -> list[dict]:
    """The run's ``curvature`` records (the tracker's, ``curvature.every`` > 0), read from its
    metrics here so that RunData stays as it is for runs without them."""
    from meshlearn.report.records import read_metrics

    return [r for r in read_metrics(run.path) if r.get("kind") == "curvature"]


def plot_curvature(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Train loss beside the curvature tracker's estimates and their stability thresholds, or None
    when no run tracked curvature.

    Panels share the step axis: the loss; λ_max(H) (solid) with gradient descent's 2/η (dashed);
    λ_max(P^{-1/2}HP^{-1/2}) with Adam's (2 + 2β₁)/((1 − β₁)η). A curve that meets its threshold
    line is at the edge of stability (ratio 1); spikes in the loss should sit where it does."""
    tracked = [(i, run, records) for i, run in enumerate(runs) if (records := _curvature_records(run))]
    if not tracked:
        return None
    fig = _new_figure(7.5, 8.0)
    loss_ax, gd_ax, adam_ax = fig.subplots(3, 1, sharex=True)
    panels = ((gd_ax, "lambda_max", "gd_threshold", "λ_max(H)", "2/η"),
              (adam_ax, "lambda_max_precond", "adam_threshold", "λ_max(P^-½HP^-½)", "(2+2β₁)/((1−β₁)η)"))
    drawn: list[tuple] = []  # threshold curves already on the axes (runs at one lr share them)
    for i, run, records in tracked:
        color = run_color(i)
        xs, ys = _series(run.train_records, "step", "train_loss")
        loss_ax.plot(xs, ys, color=color, lw=0.8, label=run.label)
        for ax, key, threshold, _, _ in panels:
            positive = [r for r in records if (as_number(r.get(key)) or 0.0) > 0]  # log axis
            xs, ys = _series(positive, "step", key)
            if xs:
                ax.plot(xs, ys, color=color, lw=1.4, marker=".", ms=3)
            xs, ys = _series(records, "step", threshold)
            if xs and (ax, xs, ys) not in drawn:
                drawn.append((ax, xs, ys))
                ax.plot(xs, ys, color=color, lw=1.0, ls="--")
    loss_ax.set_ylabel(LOSS_LABEL)
    loss_ax.set_title("Train loss; curvature (solid) and its stability threshold (dashed)")
    loss_ax.legend(fontsize="small")
    for ax, key, _, name, bound in panels:
        ax.set_ylabel(f"{name}  vs  {bound}")
        if ax.lines:
            ax.set_yscale("log")
        else:
            _no_data(ax, f"no {key} records")
    for ax in (loss_ax, gd_ax, adam_ax):
        ax.grid(True, alpha=0.3)
    adam_ax.set_xlabel("optimizer step")
    return _save(fig, out_path)
