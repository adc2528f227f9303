"""The one-line explanations the report puts beside its tables and figures.

Most are fixed sentences; some quote the runs' own numbers (the idle fraction against the
schedule's bubble, the timeline's compute share), so a reader sees why a number is what it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshlearn.mesh.timeline import parse_timeline_steps
from meshlearn.report.plots import bans
from meshlearn.report.plots_timeline import timeline_stats
from meshlearn.report.plots_trust import trust_summary
from meshlearn.report.records import RunData
from meshlearn.report.stats import run_stats
from meshlearn.report.table import format_percent


def duration(seconds: float) -> str:
    """A short duration in the unit that suits it: 31 ns, 3.4 µs, 60 ms, 1.2 s."""
    if seconds < 1e-6:
        return f"{seconds * 1e9:.3g} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def idle_notes(runs: Sequence[RunData]) -> list[str]:
    """What the idle column means, and for each run how much of it the schedule's bubble explains."""
    notes = ["idle (bubble + waits) = 1 − (compute time of all workers) / (workers × run time): every "
             "moment a worker is not computing. It includes the schedule bubble — the pipeline's fill "
             "and drain, (P − 1)/(M + P − 1) of a gpipe or 1f1b step even with instant links and equal "
             "stages — and every wait for an activation, a gradient or the all-reduce on the links. "
             "Near 100% means the links, not the devices, set the pace."]
    for run in runs:
        s = run_stats(run)
        if s.idle_fraction is None:
            continue
        mesh = run.config.get("mesh") or {}
        if s.schedule_bubble is not None:
            what = (f"{run.label}: idle {format_percent(s.idle_fraction)}; {mesh.get('schedule')} with "
                    f"P = {mesh.get('stages')}, M = {mesh.get('microbatches')} accounts for "
                    f"{format_percent(s.schedule_bubble)} (its bubble), waits on links for the rest")
        elif mesh.get("schedule") != "async":
            what = f"{run.label}: idle {format_percent(s.idle_fraction)}"
        else:
            what = (f"{run.label}: idle {format_percent(s.idle_fraction)}; {mesh.get('schedule', '?')} "
                    "has no per-step flush, so what remains is drains at evaluations and checkpoints "
                    "and waits on links")
        stats = timeline_stats(run.timeline) if run.timeline else None
        if stats is not None and "F" in stats.mean_s and stats.mean_hop_s is not None:
            what += (f" (a forward lasts {duration(stats.mean_s['F'])}, a PP transfer "
                     f"{duration(stats.mean_hop_s)} from queue to delivery)")
        notes.append(what + ".")
    return notes


def loss_note(runs: Sequence[RunData]) -> str:
    text = ("Thin lines: each step's train loss (mean over its microbatches); dots: validation loss at "
            "evaluation steps.")
    if any(bans(r) for r in runs):
        text += " Dashed vertical lines: a worker banned by the verifier (replaced at the next drain point)."
    return text


def sim_time_note(runs: Sequence[RunData]) -> str:
    models = sorted({m for r in runs if (m := run_stats(r).compute_model)})
    return ("Virtual time is the simulator's clock: compute from the compute model "
            f"({', '.join(models) or 'unknown'}), transfers from the link profiles and the bytes each "
            "codec put on the wire — how long the run would take on that mesh, not on this machine.")


def grad_norm_note(runs: Sequence[RunData]) -> str:
    return ("Gradient norm before clipping: above the dotted line (train.grad_clip) the update was scaled "
            "down. gpipe/1f1b: the global norm over all stages; async: the mean of the stages' own norms, "
            "each clipped at grad_clip / √P.")


def throughput_note(runs: Sequence[RunData]) -> str:
    return ("Tokens of each step divided by its time. Solid: virtual time on the simulated mesh (async "
            "steps overlap, so a step's time is the gap between step ends); dotted: wall time on this "
            "machine, which measures the simulator, not the mesh.")


def bytes_per_token_note(runs: Sequence[RunData]) -> str:
    return ("Wire bytes per trained token: pp = activations and gradients across stage boundaries, as "
            "the codec encoded them; dp = the data-parallel exchange between replicas of each stage.")


def link_note(runs: Sequence[RunData]) -> str:
    return ("One bar per directed link; its label is the share of the run's time the link was sending "
            "(serialization; latency is not busy time). A link near 100% binds the run.")


def timeline_note(runs: Sequence[RunData]) -> str:
    parts = []
    for run in runs:
        stats = timeline_stats(run.timeline) if run.timeline else None
        if stats is None:
            continue
        kinds = ", ".join(f"{name} {duration(stats.mean_s[k])}" for k, name in
                          (("F", "a forward"), ("B", "a backward"), ("U", "an update")) if k in stats.mean_s)
        parts.append(f"{run.label}: in {duration(stats.window_s)} the workers computed "
                     f"{format_percent(stats.compute_share)} of the time ({kinds})")
    return ("Each worker's lane: compute bars (with a tick at each start, so microsecond bars stay "
            "visible) and, below, its outgoing transfers while on the wire; blank space is idle — waiting "
            "for an input or for the update's collective. " + "; ".join(parts) + ".")


def staleness_note(runs: Sequence[RunData]) -> str:
    return ("Versions between the weights a gradient was computed with and those it is applied to; "
            "async 1F1B settles at P − 1 − s on stage s (0 on the last), more with mesh.in_flight > P − s.")


def curvature_note(runs: Sequence[RunData]) -> str:
    return ("The curvature tracker's top Hessian eigenvalue, plain beside gradient descent's 2/η and "
            "Adam-preconditioned beside (2 + 2β₁)/((1 − β₁)η): a curve at its dashed line is at the "
            "edge of stability. Hollow markers are unconverged estimates (lower bounds on λ_max); negative "
            "values are left off the log axis. Per-stage values are diagonal blocks, lower bounds on "
            "the full λ_max.")


def flags_note(runs: Sequence[RunData]) -> str:
    attacked = [r.label for r in runs if (t := trust_summary(r)) and t.get("attackers")]
    truth = (f"ground truth from the attack harness ({', '.join(attacked)})" if attacked else
             "no run had an attacker, so every flag is a false positive")
    return (f"Share of each worker's scored messages the verifier flagged; {truth}. Message- and "
            "worker-level precision and recall are in the trust table.")


def timeline_missing(runs: Sequence[RunData]) -> str:
    """Why no run shows a timeline: each run's own reason (it asked for none, or it has not reached
    the first step it asked for), not one guess for all."""
    reasons = []
    for run in runs:
        value = str((run.config.get("report") or {}).get("timeline_steps", "off"))
        total = int((run.config.get("train") or {}).get("steps", 0) or 0)
        try:
            steps = parse_timeline_steps(value, total) if total else []
        except ValueError:
            steps = []
        reached = run.train_records[-1].get("step", 0) if run.train_records else 0
        if not steps:
            reasons.append(f"{run.label} recorded none (report.timeline_steps = {value})")
        else:
            reasons.append(f"{run.label} stopped at step {reached}, before step {steps[0] + 1}, the first of "
                           f"report.timeline_steps = {value}")
    return "; ".join(reasons) or "no run recorded a timeline"
