"""What each process of a cluster host refused, on disk, for the host's security record.

Why a file per process: a worker's refusals (a link hello its certificate does not allow, a DP
contribution that does not decode) happen in the worker's process, while the host's record
(``hostport.HostPort.record``, its security.json and the coordinator's summary.json) is written by
the launcher, which outlives its workers but shares no memory with them. Each process keeps
``<run folder>/refusals/<process>.json`` current after every refusal (``ProcessRecord``, a
``Counters`` hook), so the record survives a worker that ends by ``os._exit``; the launcher adds
them up when it writes its own (``merged``). The files are this host's own processes' (never
another participant's bytes); still, one that does not read as a record is skipped, not trusted.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

from meshlearn.atomic import atomic_write_json
from meshlearn.net.counters import Counters

REFUSALS_DIR = "refusals"  # in a host's run folder
MAX_RECORD_BYTES = 1 << 20  # a process's record: counts and its newest details


class ProcessRecord:
    """Writes one process's ``Counters`` to ``folder/<process>.json`` whenever they change."""

    def __init__(self, folder: Path, process: str):
        self.path = Path(folder) / f"{process}.json"
        self.process = process
        self._lock = threading.Lock()  # the newest snapshot is the last written

    def __call__(self, counters: Counters) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"process": self.process, "refused": counters.as_dict(),
                                          "by_sender": counters.by_sender(), "recent": counters.recent()})


def process_records(run_dir: Path | None) -> dict[str, dict]:
    """Every process record in ``run_dir/refusals`` by process name (none without a folder)."""
    folder = Path(run_dir) / REFUSALS_DIR if run_dir is not None else None
    records = {}
    for path in sorted(folder.glob("*.json")) if folder is not None and folder.is_dir() else ():
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                continue
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _counts(record.get("refused")) and _counts(record.get("by_sender")):
            records[path.stem] = record
    return records


def merged(own: Counters, records: dict[str, dict]) -> tuple[dict[str, int], dict[str, int]]:
    """The counts by reason and by sender of ``own`` (the launcher's) and every process record."""
    by_reason, by_sender = Counter(own.as_dict()), Counter(own.by_sender())
    for record in records.values():
        by_reason.update(record["refused"])
        by_sender.update(record["by_sender"])
    return dict(sorted(by_reason.items())), dict(sorted(by_sender.items()))


def _counts(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and type(n) is int for k, n in value.items())
