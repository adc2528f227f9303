"""Shared by the benchmarks: build a trainer from the demo config, and write JSON + Markdown results."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from meshlearn.config import RunConfig, load_config
from meshlearn.train import Trainer
from meshlearn.train.files import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DEMO = ROOT / "configs" / "demo.toml"


def demo_config(*overrides: str) -> RunConfig:
    return load_config(DEMO, list(overrides))


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
