"""Shared by the benchmarks: build a trainer from the demo config, reuse finished runs, read their
evaluation curves over virtual time, and write JSON + Markdown results."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import tomllib
from pathlib import Path

import tomli_w

from meshlearn.atomic import atomic_write_json, atomic_write_text
from meshlearn.config import RunConfig, load_config, to_dict
from meshlearn.entry.plugins import register_builtin_plugins
from meshlearn.train import Trainer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DEMO = ROOT / "configs" / "demo.toml"

register_builtin_plugins()  # benchmarks build Trainers directly, with the built-in methods


def demo_config(*overrides: str) -> RunConfig:
    return load_config(DEMO, list(overrides))


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them: recorded beside every
    timing, since the machine is shared."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def scratch_trainer(cfg: RunConfig) -> Trainer:
    """A trainer whose run folder is thrown away: benchmarks keep only their own results."""
    return Trainer(cfg, Path(tempfile.mkdtemp(prefix="meshlearn-bench-")), progress=False)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = [format(row[k], f) if isinstance(row[k], (int, float)) else str(row[k])
                 for k, _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(name: str, payload: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"{name}.json", payload)
    atomic_write_text(RESULTS / f"{name}.md", markdown.rstrip() + "\n")
    print(markdown)
    print(f"\nwrote {RESULTS / name}.json and .md")


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2)


# --- reusing finished runs, and reading their curves -------------------------------------


def finished_run(run_dir: Path, cfg: RunConfig) -> dict | None:
    """A run this script already finished with this config: every key of its resolved config.toml
    agrees (keys added to meshlearn after that run was written have no effect on it)."""
    summary, config = run_dir / "summary.json", run_dir / "config.toml"
    if not (summary.is_file() and config.is_file()):
        return None
    resolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256))
    current = tomllib.loads(tomli_w.dumps(to_dict(resolved)))
    if not _agrees(tomllib.loads(config.read_text()), current):
        return None
    return json.loads(summary.read_text())


def _agrees(saved: dict, current: dict) -> bool:
    return all(key in current and (_agrees(value, current[key]) if isinstance(value, dict)
                                   else value == current[key]) for key, value in saved.items())


def eval_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(virtual time, val loss) of every evaluation, in time order."""
    return sorted((r["sim_time_s"], r["val_loss"]) for r in records if r["kind"] == "eval")


def val_at_time(curve: list[tuple[float, float]], t: float) -> float | None:
    """Validation loss at virtual time ``t``, linear between evaluations (None past the last)."""
    if t > curve[-1][0] + 1e-9:
        return None
    for (t0, v0), (t1, v1) in zip(curve, curve[1:], strict=False):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return curve[0][1]


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """First virtual time at which the interpolated val loss reaches ``target`` (None: never); a
    relative 1e-6 tolerance lets a mathematically equal run (GPipe vs 1F1B) count as reaching it."""
    target += 1e-6 * abs(target)
    for (t0, v0), (t1, v1) in zip(curve, curve[1:], strict=False):
        if v1 <= target <= v0 and v0 != v1:
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
        if v0 <= target:
            return t0
    return None


def slug(name: str) -> str:
    """A run label as a folder name."""
    return "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in name).strip("-")
