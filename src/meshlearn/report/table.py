"""The report's tables as plain strings, shared by the HTML page and report.md.

Formatting lives here once so both outputs always show identical numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshlearn.report.records import RunData
from meshlearn.report.stats import RunStats, run_stats
from meshlearn.report.units import format_amount, format_count

MISSING = "—"


@dataclass(frozen=True)
class Table:
    """A table of already-formatted cells; ``numeric`` marks right-aligned columns."""

    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool]


def format_loss(value: float | None) -> str:
    """Losses get four decimals: differences between runs are often in the third."""
    return MISSING if value is None else f"{value:.4f}"


def _count(value: float | None) -> str:
    return MISSING if value is None else format_count(value)


def _steps(value: int | None) -> str:
    return MISSING if value is None else f"{value:,}"


def _amount(value: float | None) -> str:
    return MISSING if value is None else format_amount(value)


def format_percent(value: float | None) -> str:
    """A share as a percentage that never rounds to a misleading 0% or 100%: 0.99994 → '99.994%',
    5.9e-5 → '0.0059%', 0.125 → '12.5%'."""
    if value is None:
        return MISSING
    p = 100 * value
    if 99.95 <= p < 100:
        return f"{p:.{max(1, math.ceil(-math.log10(100 - p)))}f}%"
    if 0 < p < 0.05:
        return f"{p:.2g}%"
    return f"{p:.1f}%"


_COLUMNS: list[tuple[str, bool, Callable[[RunStats], str]]] = [
    ("run", False, lambda s: s.label),
    ("steps", True, lambda s: _steps(s.steps)),
    ("tokens", True, lambda s: _count(s.tokens)),
    ("final train loss", True, lambda s: format_loss(s.final_train_loss)),
    ("final val loss", True, lambda s: format_loss(s.final_val_loss)),
    ("sim tok/s", True, lambda s: _count(s.sim_tokens_per_s)),
    ("wall tok/s", True, lambda s: _count(s.wall_tokens_per_s)),
    ("bytes/token pp", True, lambda s: _amount(s.bytes_per_token_pp)),
    ("bytes/token dp", True, lambda s: _amount(s.bytes_per_token_dp)),
    ("idle (bubble + waits)", True, lambda s: format_percent(s.idle_fraction)),
    ("schedule bubble", True, lambda s: format_percent(s.schedule_bubble)),
    ("least busy worker", True, lambda s: format_percent(s.min_worker_utilization)),
    ("staleness per stage", False,
     lambda s: "/".join(f"{v:.3g}" for v in s.staleness) if s.staleness else MISSING),
    ("compute model", False, lambda s: s.compute_model or MISSING),
]


def comparison_table(runs: Sequence[RunData]) -> Table:
    """One row per run with the headline figures."""
    stats = [run_stats(r) for r in runs]
    return Table(
        headers=[name for name, _, _ in _COLUMNS],
        rows=[[fmt(s) for _, _, fmt in _COLUMNS] for s in stats],
        numeric=[numeric for _, numeric, _ in _COLUMNS],
    )


def trust_table(runs: Sequence[RunData]) -> Table | None:
    """Workers banned by the trust layer, or None when no run banned anyone.

    Entries are free-form beyond worker/step/metric; extra keys get their own columns so
    nothing the trainer recorded is hidden.
    """
    entries: list[tuple[str, dict]] = []
    for run in runs:
        banned = (run.summary or {}).get("banned_workers") or []
        if isinstance(banned, list):
            entries.extend((run.label, b) for b in banned if isinstance(b, dict))
    if not entries:
        return None
    keys = ["worker", "step", "metric"]
    for _, entry in entries:
        keys.extend(k for k in entry if k not in keys)
    rows = [[label] + [_cell(entry.get(k)) for k in keys] for label, entry in entries]
    numeric = [False] + [k == "step" for k in keys]
    return Table(headers=["run", *keys], rows=rows, numeric=numeric)


def _cell(value: object) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_notes(runs: Sequence[RunData]) -> list[str]:
    """Caveats the reader must see next to the numbers (e.g. a run without summary)."""
    notes = []
    for run in runs:
        if run.summary is None:
            last = run.train_records[-1].get("step") if run.train_records else None
            upto = f" up to step {last}" if last is not None else ""
            notes.append(f"{run.label}: no summary.json; figures are derived from metrics.jsonl{upto}.")
        if not run.train_records:
            notes.append(f"{run.label}: metrics.jsonl holds no train records.")
    return notes


def _share(value: object) -> str:
    return MISSING if not isinstance(value, int | float) or isinstance(value, bool) else f"{value:.3f}"


def verifier_table(runs: Sequence[RunData]) -> Table | None:
    """Per run that verified or attacked: the verifier's decisions scored against the simulator's
    ground truth (a positive is a message an attack actually changed; at worker level, a ban of a
    running attacker). None when no run has a trust summary."""
    rows = []
    for run in runs:
        trust = (run.summary or {}).get("trust")
        if not isinstance(trust, dict):
            continue
        messages = (trust.get("messages") or {}).get("all") or {}
        workers = trust.get("workers") or {}
        attackers = ", ".join(f"{a.get('worker')} ({a.get('attack')} from step {a.get('start_step')})"
                              for a in trust.get("attackers") or []) or "none"
        rows.append([run.label, str(trust.get("verify", MISSING)), attackers,
                     _share(messages.get("precision")), _share(messages.get("recall")),
                     _share(messages.get("fpr")), _share(workers.get("precision")),
                     _share(workers.get("recall")), str(trust.get("bans", 0)),
                     str(workers.get("fp", MISSING))])  # worker-level false positives: honest bans
    if not rows:
        return None
    headers = ["run", "verifier", "attackers (ground truth)", "message precision", "message recall",
               "message FPR", "worker precision", "worker recall", "bans", "honest bans"]
    return Table(headers=headers, rows=rows, numeric=[False, False, False] + [True] * 7)
