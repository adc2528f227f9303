"""The run's record of what its machines refused: a ``refused`` block in the coordinator's
summary.json, from every host's security record (``hostport.HostPort.record``).

Why in summary.json: it is the file a run is judged by; connections a stranger tried, preambles
that were no preambles and requests a host was not allowed to make belong beside the losses,
not only in a log nobody reads. Each host's own ``security.json`` keeps its details.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from meshlearn.atomic import atomic_write_json

SUMMARY = "summary.json"


def refused_block(records: dict[str, dict]) -> dict:
    """The counts by reason over every host, each host's, their total, and the refusals
    attributed to each authenticated participant (``by_sender``: who misbehaved; a stranger's
    connections are attributed to nobody)."""
    by_reason: Counter[str] = Counter()
    by_sender: Counter[str] = Counter()
    for record in records.values():
        by_reason.update(record.get("refused", {}))
        by_sender.update(record.get("by_sender", {}))
    return {"total": sum(by_reason.values()), "by_reason": dict(sorted(by_reason.items())),
            "by_sender": dict(sorted(by_sender.items())),
            "by_host": {host: record.get("refused", {}) for host, record in sorted(records.items())}}


def record_refusals(run_dir: Path, records: dict[str, dict]) -> None:
    """Add the ``refused`` block to ``run_dir``'s summary.json (nothing when the run wrote none:
    it failed before its end)."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    summary["refused"] = refused_block(records)
    atomic_write_json(path, summary)
