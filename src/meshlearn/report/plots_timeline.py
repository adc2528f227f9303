"""The pipeline timeline: a Gantt of what every worker did in the recorded steps (timeline.json).

Each worker gets a lane of compute bars (forward, backward, update) and, just below it, a thin lane
of its outgoing transfers while they are on the wire; blank space is idle time. On a fast device a
forward can last microseconds beside link times of tens of milliseconds, so every compute bar also
gets a tick at its start: the tick shows where it is, the bar how long it lasted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from meshlearn.report.plots import AXIS_COLORS, new_figure, save_png
from meshlearn.report.records import RunData
from meshlearn.report.units import as_number

KIND_COLORS = {"F": "tab:blue", "B": "tab:green", "U": "tab:purple"}
KIND_NAMES = {"F": "forward", "B": "backward", "U": "update"}
SEND_COLORS = {"pp": "#7fb2d9", "dp": AXIS_COLORS["dp"]}


@dataclass(frozen=True)
class TimelineStats:
    """Numbers of one recorded window, for the figure's explanation."""

    window_s: float
    compute_share: float  # compute time of all workers / (workers × window)
    mean_s: dict[str, float]  # mean duration per compute kind
    mean_hop_s: float | None  # mean PP transfer: queued on the link → delivered


def _events(timeline: dict[str, Any]) -> list[dict]:
    return [e for e in timeline.get("events", []) if as_number(e.get("t0")) is not None]


def timeline_stats(timeline: dict[str, Any]) -> TimelineStats | None:
    events = _events(timeline)
    computes = [e for e in events if e.get("kind") in KIND_COLORS and as_number(e.get("t1")) is not None]
    if not computes:
        return None
    start = min(e["t0"] for e in events)
    end = max(max(e["t1"] for e in computes), max(e.get("t_sent") or e["t0"] for e in events))
    window = end - start
    workers = timeline.get("workers") or sorted({e["worker"] for e in computes})
    busy = sum(e["t1"] - e["t0"] for e in computes)
    means = {}
    for kind in KIND_COLORS:
        durations = [e["t1"] - e["t0"] for e in computes if e["kind"] == kind]
        if durations:
            means[kind] = sum(durations) / len(durations)
    hops = [e["t1"] - e["t0"] for e in events if e.get("kind") == "send" and e.get("axis") == "pp"
            and as_number(e.get("t1")) is not None]
    return TimelineStats(window, busy / (len(workers) * window) if window > 0 else 0.0, means,
                         sum(hops) / len(hops) if hops else None)


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds < 2e-3:
        return "µs", 1e-6
    if seconds < 2.0:
        return "ms", 1e-3
    return "s", 1.0


def _draw(ax: Any, run: RunData, timeline: dict[str, Any]) -> None:
    events = _events(timeline)
    workers = timeline.get("workers") or sorted({e["worker"] for e in events})
    lane = {w: i for i, w in enumerate(workers)}
    start = min(e["t0"] for e in events)
    end = max(e.get("t1") or e.get("t_sent") or e["t0"] for e in events)
    unit, scale = _time_unit(end - start)

    def x(t: float) -> float:
        return (t - start) / scale

    for kind, color in KIND_COLORS.items():
        bars = {w: [] for w in workers}
        for e in events:
            if e.get("kind") == kind and e.get("worker") in lane and as_number(e.get("t1")) is not None:
                bars[e["worker"]].append((x(e["t0"]), (e["t1"] - e["t0"]) / scale))
        for w, spans in bars.items():
            if spans:
                ax.broken_barh(spans, (lane[w] - 0.4, 0.5), facecolors=color)
                ax.plot([s for s, _ in spans], [lane[w] - 0.15] * len(spans), ls="none", marker="|",
                        ms=9, mew=1.2, color=color)
    for axis, color in SEND_COLORS.items():
        spans = {w: [] for w in workers}
        for e in events:
            if e.get("kind") == "send" and e.get("axis") == axis and e.get("worker") in lane:
                sent = as_number(e.get("t_sent"))
                if sent is not None:
                    spans[e["worker"]].append((x(e["t0"]), max((sent - e["t0"]) / scale, 0.0)))
        for w, items in spans.items():
            if items:
                ax.broken_barh(items, (lane[w] + 0.15, 0.2), facecolors=color)
    for step in timeline.get("steps", []):  # where each recorded step's first action starts
        starts = [e["t0"] for e in events if e.get("step") == step and e.get("kind") in KIND_COLORS]
        if starts:
            ax.axvline(x(min(starts)), color="gray", ls=":", lw=1.0)
            ax.annotate(f"step {step}", (x(min(starts)), -0.9), fontsize="x-small", color="gray",
                        xytext=(2, 0), textcoords="offset points")
    ax.set_yticks(range(len(workers)), workers, fontsize="small")
    ax.set_ylim(len(workers) - 0.4, -1.0)
    clock = "virtual" if timeline.get("clock") == "virtual" else "wall-clock"
    ax.set_xlabel(f"{clock} time since the window's start ({unit})")
    truncated = " (truncated: event cap reached)" if timeline.get("truncated") else ""
    steps = timeline.get("steps", [])
    ax.set_title(f"{run.label}: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}{truncated}")
    ax.grid(True, axis="x", alpha=0.3)


def plot_timeline(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """One Gantt panel per run that recorded a timeline."""
    panels = [r for r in runs if r.timeline is not None and _events(r.timeline)]
    if not panels:
        return None
    heights = [0.32 * len(r.timeline.get("workers") or []) + 1.4 for r in panels]
    fig = new_figure(10.0, sum(heights) + 0.8)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, run in zip(axes, panels, strict=True):
        _draw(ax, run, run.timeline)
    handles = [Patch(color=c, label=KIND_NAMES[k]) for k, c in KIND_COLORS.items()]
    handles += [Patch(color=c, label=f"{a} send (on the wire)") for a, c in SEND_COLORS.items()]
    handles.append(Line2D([], [], ls="none", marker="|", color="black", label="compute start"))
    fig.legend(handles=handles, loc="outside upper center", ncol=6, fontsize="small")
    return save_png(fig, out_path)
