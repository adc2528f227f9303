"""Read a run folder (config.toml, metrics.jsonl, summary.json) into memory.

The reader is deliberately forgiving: a run that crashed still deserves a report, so a
truncated last line, a missing summary or unknown record kinds never stop it.
"""

from __future__ import annotations

import json
import os
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlearn.mesh.timeline import TIMELINE_FILE

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.toml"


@dataclass
class RunData:
    """Everything the report needs from one run folder."""

    label: str
    path: Path
    train_records: list[dict[str, Any]] = field(default_factory=list)
    eval_records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # records of other kinds (ban, alert, ...)
    timeline: dict[str, Any] | None = None  # timeline.json (the pipeline Gantt's events), if recorded


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Return every record of ``<run_dir>/metrics.jsonl`` in file order.

    A crash can leave the last line half-written (even mid UTF-8 character), so an
    undecodable last line is dropped silently. An undecodable line elsewhere (e.g. a
    resumed run appending after a partial line) is dropped with a warning: losing one
    point is better than losing the report.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a run folder needs the {METRICS_FILE} written during training"
        )
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number != len(lines):
            bad.append(number)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        warnings.warn(f"{path}: skipped {len(bad)} malformed line(s): {shown}", stacklevel=2)
    return records


def read_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Return ``summary.json`` as a dict, or None if the run never wrote one (crashed).

    An unreadable summary is treated as missing (with a warning) so the report falls back
    to the metrics instead of failing.
    """
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        warnings.warn(f"{path}: unreadable, ignoring it ({exc})", stacklevel=2)
        return None
    if not isinstance(summary, dict):
        warnings.warn(f"{path}: expected a JSON object, ignoring it", stacklevel=2)
        return None
    return summary


def read_config(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the resolved ``config.toml`` as a dict; {} when absent or unreadable."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        warnings.warn(f"{path}: unreadable, ignoring it ({exc})", stacklevel=2)
        return {}


def load_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Load one run folder; raise FileNotFoundError naming what is missing.

    The label is the folder's name (``render_report`` lengthens it to a path suffix where two
    folders share a name): folders are unique where config names repeat. Records of kinds other
    than "train" and "eval" are kept as ``events`` (bans, alerts), and readers ignore kinds they do
    not know, so newer writers do not break older readers.
    """
    path = Path(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"run folder not found: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"run folder is not a directory: {path}")
    records = read_metrics(path)
    return RunData(
        label=path.resolve().name,
        path=path,
        train_records=[r for r in records if r.get("kind") == "train"],
        eval_records=[r for r in records if r.get("kind") == "eval"],
        summary=read_summary(path),
        config=read_config(path),
        events=[r for r in records if r.get("kind") not in ("train", "eval")],
        timeline=read_timeline(path),
    )


def read_timeline(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``timeline.json``, or the per-process ``timeline.<worker>.json`` files of a dist run merged
    into one; None when the run recorded none. An unreadable file is skipped with a warning."""
    path = Path(run_dir)
    files = [path / TIMELINE_FILE] if (path / TIMELINE_FILE).is_file() else sorted(
        path.glob("timeline.*.json"))
    parts = []
    for file in files:
        try:
            part = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            warnings.warn(f"{file}: unreadable, ignoring it ({exc})", stacklevel=2)
            continue
        if isinstance(part, dict) and isinstance(part.get("events"), list):
            parts.append(part)
    if not parts:
        return None
    merged = dict(parts[0])
    merged["workers"] = sorted({w for p in parts for w in p.get("workers", [])})
    merged["events"] = [e for p in parts for e in p["events"] if isinstance(e, dict)]
    merged["truncated"] = any(p.get("truncated") for p in parts)
    return merged
