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
from matplotlib.ticker import LogFormatter

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


class _PlainLogFormatter(LogFormatter):
    """matplotlib's choice of which log ticks to label, written as plain numbers (2000, 0.5)."""

    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{x:g}"


def plain_log_ticks(ax: Axes) -> None:
    """Log-scale y ticks as plain numbers instead of 2×10³."""
    ax.yaxis.set_major_formatter(_PlainLogFormatter())
    ax.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def new_figure(width: float = 7.5, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, out_path: Path) -> Path:
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return out_path


def series(records: Sequence[dict], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """Finite (x, y) pairs; records missing either value (or NaN) are skipped."""
    xs, ys = [], []
    for r in records:
        x, y = as_number(r.get(x_key)), as_number(r.get(y_key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_loss(
    runs: Sequence[RunData], out_path: Path, x_key: str, xlabel: str, x_scale: float, title: str
) -> Path:
    fig = new_figure()
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        color = run_color(i)
        xs, ys = series(run.train_records, x_key, "train_loss")
        if xs:
            ax.plot(
                [x / x_scale for x in xs],
                ys,
                color=color,
                lw=0.8,
                alpha=0.6,
                label=f"{run.label} train",
            )
        xs, ys = series(run.eval_records, x_key, "val_loss")
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
        _mark_bans(ax, runs, x_key, x_scale)
        ax.legend(fontsize="small")
    else:
        no_data(ax, "no loss records")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(LOSS_LABEL)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return save_png(fig, out_path)


def bans(run: RunData) -> list[dict]:
    """The run's ``ban`` records (metrics.jsonl), in order."""
    return [e for e in run.events if e.get("kind") == "ban"]


def _mark_bans(ax: Axes, runs: Sequence[RunData], x_key: str, x_scale: float) -> None:
    """A dashed vertical line in the run's colour at every ban, labelled with the banned worker."""
    for i, run in enumerate(runs):
        for ban in bans(run):
            x = as_number(ban.get(x_key))
            if x is None:
                continue
            ax.axvline(x / x_scale, color=run_color(i), ls="--", lw=1.0, alpha=0.8)
            ax.annotate(f"ban {ban.get('worker', '?')}", (x / x_scale, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(2, -10), textcoords="offset points",
                        fontsize="x-small", color=run_color(i), rotation=90, va="top")


def plot_loss_vs_step(runs: Sequence[RunData], out_path: Path) -> Path:
    """Train loss (thin line) and val loss (markers) against step; bans as dashed lines."""
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
    fig = new_figure(max(5.0, 1.3 * len(runs) + 3.0), 4.5)
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
    return save_png(fig, out_path)


def _links(run: RunData) -> list[dict]:
    """Links with a byte count, pipeline links first (stable within each axis)."""
    links = (run.summary or {}).get("links") or []
    usable = [link for link in links if isinstance(link, dict) and as_number(link.get("bytes")) is not None]
    order = {"pp": 0, "dp": 1}
    return sorted(usable, key=lambda link: order.get(link.get("axis"), 2))


def plot_link_bytes(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Bytes each directed link carried over the run, one panel per run, each bar labelled with the
    link's busy share of the run's time (busy_s / time): which link bound the run."""
    per_run = [_links(r) for r in runs]
    if not any(per_run):
        return None
    widest = max(len(links) for links in per_run)
    width = min(30.0, max(7.5, 0.45 * widest + 2.0))
    fig = new_figure(width, 2.9 * len(runs) + 0.6)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run, links in zip(axes, runs, per_run, strict=True):
        ax.set_title(run.label)
        ax.set_ylabel("MB sent")
        if not links:
            no_data(ax, "no link data (summary.json missing)")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        megabytes = [(as_number(link["bytes"]) or 0.0) / 1e6 for link in links]
        colors = [AXIS_COLORS.get(link.get("axis"), _OTHER_AXIS_COLOR) for link in links]
        names = [f"{link.get('src', '?')}→{link.get('dst', '?')}" for link in links]
        bars = ax.bar(range(len(links)), megabytes, width=0.6, color=colors)
        util = [as_number(link.get("utilization")) for link in links]
        ax.bar_label(bars, labels=["" if u is None else f"{100 * u:.0f}%" for u in util],
                     fontsize="x-small", padding=1)
        ax.set_xlim(-0.5, max(len(links), 6) - 0.5)  # a few links stay bar-shaped, not slabs
        rotate = len(links) > 6
        ax.set_xticks(range(len(links)), names, rotation=60 if rotate else 0,
                      ha="right" if rotate else "center", fontsize="small")
        ax.set_xlabel("link (src→dst); label: busy share of the run's time")
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
    present = [a for a in AXIS_COLORS if any(link.get("axis") == a for ls in per_run for link in ls)]
    fig.legend(handles=[Patch(color=AXIS_COLORS[a], label=f"{a} link") for a in present],
               loc="outside upper right", fontsize="small")
    fig.suptitle("Bytes per link")
    return save_png(fig, out_path)
