"""Headline numbers per run, from summary.json when present, else derived from metrics.

Both the comparison table and the bytes-per-token plot use this, so a crashed run
(no summary) shows the same derived figures everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlearn.mesh.schedule import flush_bubble_fraction
from meshlearn.report.records import RunData
from meshlearn.report.units import as_number


@dataclass(frozen=True)
class RunStats:
    """Headline figures of one run; None where neither summary nor metrics tell."""

    label: str
    steps: int | None
    tokens: float | None
    final_train_loss: float | None
    final_val_loss: float | None
    sim_tokens_per_s: float | None
    wall_tokens_per_s: float | None
    bytes_per_token_pp: float | None
    bytes_per_token_dp: float | None
    idle_fraction: float | None  # 1 − compute time / (workers × time): bubble and every wait
    schedule_bubble: float | None  # (P − 1)/(M + P − 1) of a flushing schedule; None under async
    min_worker_utilization: float | None  # the least busy worker's share of virtual time
    staleness: list[float] | None  # async: versions behind per stage, last train record
    compute_model: str | None
    has_summary: bool


def schedule_bubble(config: dict[str, Any]) -> float | None:
    """The fill-and-drain share of a flushing schedule at equal stage times; None for async (no
    flush in steady state) or when the config does not say."""
    mesh = config.get("mesh") or {}
    stages, micro = as_number(mesh.get("stages")), as_number(mesh.get("microbatches"))
    if mesh.get("schedule") not in ("gpipe", "1f1b") or not stages or not micro:
        return None
    return flush_bubble_fraction(int(stages), int(micro))


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _least(utilization: Any) -> float | None:
    values = [as_number(v) for v in utilization.values()] if isinstance(utilization, dict) else []
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _from_metrics(run: RunData) -> dict[str, Any]:
    """Reconstruct what summary.json would say from the cumulative fields of the records."""
    derived: dict[str, Any] = {}
    if run.train_records:
        last = run.train_records[-1]
        tokens = as_number(last.get("tokens"))
        derived["steps"] = as_number(last.get("step"))
        derived["tokens"] = tokens
        derived["final_train_loss"] = as_number(last.get("train_loss"))
        derived["sim_tokens_per_s"] = _ratio(tokens, as_number(last.get("sim_time_s")))
        derived["wall_tokens_per_s"] = _ratio(tokens, as_number(last.get("wall_time_s")))
        derived["bytes_per_token_pp"] = _ratio(as_number(last.get("bytes_pp")), tokens)
        derived["bytes_per_token_dp"] = _ratio(as_number(last.get("bytes_dp")), tokens)
    if run.eval_records:
        derived["final_val_loss"] = as_number(run.eval_records[-1].get("val_loss"))
    return derived


def run_stats(run: RunData) -> RunStats:
    """Headline figures of ``run``; each summary key missing falls back to the metrics."""
    summary = run.summary or {}
    derived = _from_metrics(run)

    def pick(key: str) -> float | None:
        value = as_number(summary.get(key))
        return value if value is not None else derived.get(key)

    steps = pick("steps")
    compute_model = summary.get("compute_model")
    return RunStats(
        label=run.label,
        steps=int(steps) if steps is not None else None,
        tokens=pick("tokens"),
        final_train_loss=pick("final_train_loss"),
        final_val_loss=pick("final_val_loss"),
        sim_tokens_per_s=pick("sim_tokens_per_s"),
        wall_tokens_per_s=pick("wall_tokens_per_s"),
        bytes_per_token_pp=pick("bytes_per_token_pp"),
        bytes_per_token_dp=pick("bytes_per_token_dp"),
        # Runs from before the rename call the same number bubble_fraction.
        idle_fraction=pick("idle_fraction") if pick("idle_fraction") is not None else pick("bubble_fraction"),
        schedule_bubble=schedule_bubble(run.config),
        min_worker_utilization=_least(summary.get("worker_utilization")),
        staleness=run.train_records[-1].get("staleness") if run.train_records else None,
        compute_model=str(compute_model) if compute_model is not None else None,
        has_summary=run.summary is not None,
    )
