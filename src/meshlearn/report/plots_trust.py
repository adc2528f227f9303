"""The verifier's view of every worker: how many of its messages were flagged, against ground truth."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.patches import Patch

from meshlearn.report.plots import new_figure, save_png
from meshlearn.report.records import RunData
from meshlearn.report.units import as_number

HONEST, MALICIOUS = "tab:green", "tab:red"


def trust_summary(run: RunData) -> dict | None:
    """summary.json's ``trust`` object (present when the run verified or attacked), else None."""
    trust = (run.summary or {}).get("trust")
    return trust if isinstance(trust, dict) else None


def plot_flags_per_worker(runs: Sequence[RunData], out_path: Path) -> Path | None:
    """Per run that verified, the share of each worker's scored messages the verifier flagged; red
    bars are the workers that really attacked (the simulator's ground truth), banned ones hatched."""
    panels = [(r, trust_summary(r)) for r in runs]
    panels = [(r, t) for r, t in panels if t is not None and t.get("verify", "none") != "none"
              and any(v.get("scored") for v in (t.get("flags_per_worker") or {}).values())]
    if not panels:
        return None
    fig = new_figure(7.5, 2.8 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (run, trust) in zip(axes, panels, strict=True):
        workers = sorted(trust["flags_per_worker"].items())
        banned = {b.get("worker") for b in (run.summary or {}).get("banned_workers") or []
                  if isinstance(b, dict)}
        shares, labels = [], []
        for _, tally in workers:
            flags, scored = as_number(tally.get("flags")) or 0.0, as_number(tally.get("scored")) or 0.0
            shares.append(100 * flags / scored if scored else 0.0)
            labels.append(f"{flags:.0f}/{scored:.0f}")
        bars = ax.bar(range(len(workers)), shares, width=0.6,
                      color=[MALICIOUS if t.get("malicious") else HONEST for _, t in workers])
        for bar, (name, _) in zip(bars, workers, strict=True):
            if name in banned:
                bar.set_hatch("//")
        ax.bar_label(bars, labels=labels, fontsize="x-small", padding=1)
        ax.set_xticks(range(len(workers)), [name for name, _ in workers], fontsize="small")
        ax.set_ylabel("flagged (%)")
        ax.set_ylim(0, max(5.0, 1.25 * max(shares)))  # small shares stay readable
        ax.set_title(f"{run.label} (verifier: {trust.get('verify', '?')}); label: flagged/scored messages")
        ax.grid(True, axis="y", alpha=0.3)
    fig.legend(handles=[Patch(color=HONEST, label="honest"), Patch(color=MALICIOUS, label="attacker"),
                        Patch(facecolor="white", edgecolor="black", hatch="//", label="banned")],
               loc="outside upper right", fontsize="small")
    fig.suptitle("Verifier flags per worker")
    return save_png(fig, out_path)
