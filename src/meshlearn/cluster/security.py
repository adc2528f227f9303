"""The run's record of what its machines refused: a ``refused`` block in the coordinator's
summary.json, from every host's security record (``hostport.HostPort.record``).

Why in summary.json: it is the file a run is judged by; connections a stranger tried, preambles
that were no preambles and requests a host was not allowed to make belong beside the losses,
not only in a log nobody reads. Each host's own ``security.json`` keeps its details.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist

from meshlearn.atomic import atomic_write_json

SUMMARY = "summary.json"
MAX_REASONS = 64  # far more kinds of refusal than the counters have (docs/security.md, "Counters")
MAX_SENDERS = 4096  # far more participants than a run admits
MAX_RECORD_BYTES = 4 << 20  # a host's record: counts, and its 64 newest details (each < a 64 KiB header)


def refused_block(records: dict[str, object], coordinator: str, hosts: Iterable[str]) -> dict:
    """The counts by reason over every host, each host's, their total, and who misbehaved.

    ``by_sender`` is what the ``coordinator``'s own processes observed: its port, its control
    service and its workers, each refusal attributed to the identity a certificate proved. Another
    host's attributions are only its word: a lying host could write that honest hosts misbehaved.
    They are kept apart, under ``claims`` (``{reporter: {sender: n}}``), and only for senders a
    reporter could have met: the placement's other ``hosts`` (a name it made up, or itself, is
    dropped). Another host's record may be anything: one whose counts are not counts (by reason,
    by sender) is left out, and named under ``unreadable``."""
    hosts = set(hosts)
    counts = {host: (_counts(record, "refused", MAX_REASONS), _counts(record, "by_sender", MAX_SENDERS))
              for host, record in sorted(records.items())}
    readable = {host: pair for host, pair in counts.items() if None not in pair}
    by_reason: Counter[str] = Counter()
    for refused, _ in readable.values():
        by_reason.update(refused)
    own = readable.get(coordinator, ({}, {}))[1]
    claims = {reporter: peers for reporter, (_, senders) in readable.items() if reporter != coordinator
              if (peers := {s: n for s, n in sorted(senders.items()) if s in hosts and s != reporter and n})}
    block = {"total": sum(by_reason.values()), "by_reason": dict(sorted(by_reason.items())),
             "by_sender": dict(sorted(own.items())), "claims": claims,
             "by_host": {host: refused for host, (refused, _) in readable.items()}}
    unreadable = [host for host in counts if host not in readable]
    return block | ({"unreadable": unreadable} if unreadable else {})


def collect_records(store: dist.Store, prefix: str, hosts: Iterable[str]) -> dict[str, object]:
    """The security record each of ``hosts`` left at ``prefix/<host>`` on the control service
    (a host that left none, or whose record cannot be fetched, is absent). A record beyond
    ``MAX_RECORD_BYTES`` or that is not JSON is kept as None, so ``refused_block`` names the host
    under ``unreadable`` rather than dropping it without a word."""
    records: dict[str, object] = {}
    for host in hosts:
        key = f"{prefix}/{host}"
        try:
            if not store.check([key]):
                continue
            raw = store.get(key)
        except Exception:  # noqa: BLE001 — the coordinator's own service may be closing: no record
            continue
        try:
            records[host] = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
        except ValueError:  # UnicodeDecodeError and JSONDecodeError included
            records[host] = None
    return records


def _counts(record: object, field: str, most: int) -> dict[str, int] | None:
    """A host record's counts under ``field`` (none: empty), or None when they are not counts."""
    counted = record.get(field, {}) if isinstance(record, dict) else None
    if not isinstance(counted, dict) or len(counted) > most:
        return None
    if not all(isinstance(k, str) and len(k) <= 64 and type(v) is int and v >= 0 for k, v in counted.items()):
        return None
    return counted


def record_refusals(run_dir: Path, records: dict[str, object], coordinator: str,
                    hosts: Iterable[str]) -> None:
    """Add the ``refused`` block to ``run_dir``'s summary.json (nothing when the run wrote none:
    it failed before its end)."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    summary["refused"] = refused_block(records, coordinator, hosts)
    atomic_write_json(path, summary)
