"""Per-step training signals over all runs: learning rate and gradient norm, throughput, staleness,
curvature."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshlearn.report.plots import (
    LOSS_LABEL,
    new_figure,
    no_data,
    plain_log_ticks,
    run_color,
    save_png,
    series,
)
from meshlearn.report.records import RunData, read_metrics
from meshlearn.report.units import as_number


def plot_lr_grad_norm(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Two panels against step: the learning rate the schedule gave, and the gradient norm before
    clipping (flushing schedules: the global norm; async: the mean of the stages' own norms)."""
    if not any(series(r.train_records, "step", "lr")[0] for r in runs):
        return None
    fig = new_figure(7.5, 5.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for i, run in enumerate(runs):
        xs, ys = series(run.train_records, "step", "lr")
        top.plot(xs, ys, color=run_color(i), lw=1.2, label=run.label)
        xs, ys = series(run.train_records, "step", "grad_norm")
        bottom.plot(xs, ys, color=run_color(i), lw=0.9, label=run.label)
    clip = {as_number((r.config.get("train") or {}).get("grad_clip")) for r in runs} - {None, 0.0}
    for value in sorted(clip):
        bottom.axhline(value, color="gray", ls=":", lw=1.0)
        bottom.annotate(f"train.grad_clip = {value:g}", (0.01, value), xycoords=("axes fraction", "data"),
                        fontsize="x-small", color="gray", va="bottom")
    top.set_ylabel("learning rate")
    top.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    bottom.set_ylabel("gradient norm")
    bottom.set_yscale("log")
    plain_log_ticks(bottom)
    bottom.set_xlabel("step")
    top.legend(fontsize="small")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.suptitle("Learning rate and gradient norm")
    return save_png(fig, out_path)


def step_tokens_per_s(run: RunData, time_key: str) -> tuple[list[float], list[float]]:
    """(step, tokens of that step / its seconds) from the train records' per-step times."""
    xs, ys = [], []
    previous = 0.0
    for record in run.train_records:
        step, tokens, seconds = (as_number(record.get(k)) for k in ("step", "tokens", time_key))
        if step is None or tokens is None:
            continue
        if seconds is not None and seconds > 0:
            xs.append(step)
            ys.append((tokens - previous) / seconds)
        previous = tokens
    return xs, ys


def plot_throughput(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Tokens per second of every step: on the virtual clock (solid) and on this machine (dotted)."""
    curves = [(step_tokens_per_s(r, "step_sim_s"), step_tokens_per_s(r, "step_wall_s")) for r in runs]
    if not any(sim[0] or wall[0] for sim, wall in curves):
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    for i, (run, (sim, wall)) in enumerate(zip(runs, curves, strict=True)):
        if sim[0]:
            ax.plot(*sim, color=run_color(i), lw=1.4, label=f"{run.label} virtual")
        if wall[0]:
            ax.plot(*wall, color=run_color(i), lw=0.8, ls=":", label=f"{run.label} wall (this machine)")
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return save_png(fig, out_path)


def plot_staleness(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Versions behind per stage against step, for runs that record it (the async schedule)."""
    stale = [(i, r) for i, r in enumerate(runs) if any(isinstance(t.get("staleness"), list)
                                                      for t in r.train_records)]
    if not stale:
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    styles = ["-", "--", "-.", ":"]
    for i, run in stale:
        rows = [(t["step"], t["staleness"]) for t in run.train_records
                if isinstance(t.get("staleness"), list) and as_number(t.get("step")) is not None]
        stages = max(len(values) for _, values in rows)
        for s in range(stages):
            points = [(step, values[s]) for step, values in rows
                      if s < len(values) and as_number(values[s]) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], color=run_color(i),
                    ls=styles[s % len(styles)], lw=1.2, label=f"{run.label} stage {s}")
    ax.set_xlabel("step")
    ax.set_ylabel("versions behind (mean over the step's updates)")
    ax.set_title("Staleness of the applied gradients")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    return save_png(fig, out_path)


def _curvature_records(run: RunData) -> list[dict]:
    """The run's ``curvature`` records (the tracker's, ``curvature.every`` > 0), read from its
    metrics here so that RunData stays as it is for runs without them."""
    return [r for r in read_metrics(run.path) if r.get("kind") == "curvature"]


def split_by_convergence(records: Sequence[dict], key: str) -> tuple[list[dict], list[dict]]:
    """(converged, unconverged) curvature records for estimate ``key``, by its ``<key>_converged``
    flag; a record without the flag (a run from before the flag existed) counts as converged."""
    loose = [r for r in records if r.get(f"{key}_converged") is False]
    return [r for r in records if r.get(f"{key}_converged") is not False], loose


def plot_curvature(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Train loss beside the curvature tracker's estimates and their stability thresholds, or None
    when no run tracked curvature.

    Panels share the step axis: the loss; λ_max(H) (solid) with gradient descent's 2/η (dashed);
    λ_max(P^{-1/2}HP^{-1/2}) with Adam's (2 + 2β₁)/((1 − β₁)η). A curve that meets its threshold
    line is at the edge of stability (ratio 1); spikes in the loss should sit where it does.
    Hollow markers are estimates flagged unconverged (``<key>_converged`` false): lower bounds on
    λ_max, not its value; filled ones converged (or come from a run that logged no flag)."""
    tracked = [(i, run, records) for i, run in enumerate(runs) if (records := _curvature_records(run))]
    if not tracked:
        return None
    fig = new_figure(7.5, 8.0)
    loss_ax, gd_ax, adam_ax = fig.subplots(3, 1, sharex=True)
    panels = ((gd_ax, "lambda_max", "gd_threshold", "λ_max(H)", "2/η"),
              (adam_ax, "lambda_max_precond", "adam_threshold", "λ_max(P^-½HP^-½)", "(2+2β₁)/((1−β₁)η)"))
    drawn: list[tuple] = []  # threshold curves already on the axes (runs at one lr share them)
    for i, run, records in tracked:
        color = run_color(i)
        xs, ys = series(run.train_records, "step", "train_loss")
        loss_ax.plot(xs, ys, color=color, lw=0.8, label=run.label)
        for ax, key, threshold, _, _ in panels:
            positive = [r for r in records if (as_number(r.get(key)) or 0.0) > 0]  # log axis
            xs, ys = series(positive, "step", key)
            if xs:
                ax.plot(xs, ys, color=color, lw=1.0)
            settled, loose = split_by_convergence(positive, key)
            for points, face in ((loose, "none"), (settled, color)):
                xs, ys = series(points, "step", key)
                if xs:
                    ax.plot(xs, ys, ls="none", marker="o", ms=4, mec=color, mfc=face)
            xs, ys = series(records, "step", threshold)
            if xs and (ax, xs, ys) not in drawn:
                drawn.append((ax, xs, ys))
                ax.plot(xs, ys, color=color, lw=1.0, ls="--")
    loss_ax.set_ylabel(LOSS_LABEL)
    loss_ax.set_title("Train loss; curvature (solid; hollow = unconverged, a lower bound) and its "
                      "stability threshold (dashed)", fontsize="small")
    loss_ax.legend(fontsize="small")
    for ax, key, _, name, bound in panels:
        ax.set_ylabel(f"{name}  vs  {bound}")
        if ax.lines:
            ax.set_yscale("log")
        else:
            no_data(ax, f"no {key} records")
    for ax in (loss_ax, gd_ax, adam_ax):
        ax.grid(True, alpha=0.3)
    adam_ax.set_xlabel("optimizer step")
    return save_png(fig, out_path)
