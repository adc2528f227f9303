"""The report's tables as plain strings, shared by the HTML page and report.md.

Formatting lives here once so both outputs always show identical numbers.
"""

from __future__ import annotations

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


def _fraction(value: float | None) -> str:
    return MISSING if value is None else f"{100 * value:.1f}%"


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
    ("bubble fraction", True, lambda s: _fraction(s.bubble_fraction)),
    ("least busy worker", True, lambda s: _fraction(s.min_worker_utilization)),
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
            notes.append(
                f"{run.label}: no summary.json (the run probably crashed or is still running); "
                f"figures are derived from metrics.jsonl{upto}."
            )
        if not run.train_records:
            notes.append(f"{run.label}: metrics.jsonl holds no train records.")
    return notes
