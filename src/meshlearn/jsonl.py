"""The metrics log of a run: append-only JSON lines that survive crashes and resumes (the trainer's
metrics.jsonl, SENTINEL's verify.jsonl, an elastic run's per-step records)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshlearn.atomic import atomic_write_text


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
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, _line(record))

    def close(self) -> None:
        os.close(self._fd)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One record appended with a single ``O_APPEND`` write: records that several processes append
    to one file (an elastic run's writers, one per step) never interleave within a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, _line(record))
    finally:
        os.close(fd)


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record) + "\n").encode()


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a partial last line from a crash
    return records
