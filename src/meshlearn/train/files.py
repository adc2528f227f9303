"""Crash-safe files: write to a temporary name in the same folder, then rename over the target."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class MetricsLog:
    """``metrics.jsonl``: one JSON record per line, appended and flushed as it happens.

    Appending keeps a long run O(1) per record; a crash can leave at most one partial last line,
    which readers skip. On resume the file is atomically rewritten without the records after the
    checkpoint, so a resumed run's log reads as if it had never stopped.
    """

    def __init__(self, path: Path, keep_until_step: int | None = None):
        self.path = path
        if keep_until_step is not None and path.exists():
            kept = [line for line in read_records(path) if line.get("step", 0) <= keep_until_step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        elif keep_until_step is None:
            atomic_write_text(path, "")
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a partial last line from a crash
    return records
