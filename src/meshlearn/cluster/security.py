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
MAX_REASONS = 64  # far more kinds of refusal than the counters have (docs/security.md, "Counters")


def refused_block(records: dict[str, object]) -> dict:
    """The counts by reason over every host, each host's, and their total. Another host's record
    is its word, and may be anything: one that is not counts by reason is left out, and named
    under ``unreadable``."""
    counts = {host: _counts(record) for host, record in sorted(records.items())}
    by_reason: Counter[str] = Counter()
    for refused in counts.values():
        by_reason.update(refused or {})
    block = {"total": sum(by_reason.values()), "by_reason": dict(sorted(by_reason.items())),
             "by_host": {host: refused for host, refused in counts.items() if refused is not None}}
    unreadable = [host for host, refused in counts.items() if refused is None]
    return block | ({"unreadable": unreadable} if unreadable else {})


def _counts(record: object) -> dict[str, int] | None:
    """A host record's ``refused`` counts, or None when they are not counts by reason."""
    refused = record.get("refused", {}) if isinstance(record, dict) else None
    if not isinstance(refused, dict) or len(refused) > MAX_REASONS:
        return None
    if not all(isinstance(k, str) and len(k) <= 64 and type(v) is int and v >= 0 for k, v in refused.items()):
        return None
    return refused


def record_refusals(run_dir: Path, records: dict[str, dict]) -> None:
    """Add the ``refused`` block to ``run_dir``'s summary.json (nothing when the run wrote none:
    it failed before its end)."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    summary["refused"] = refused_block(records)
    atomic_write_json(path, summary)
