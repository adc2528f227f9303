"""Counts of connections turned away, by reason, for a run's summary.json.

Every listener of the ``net`` package adds to one ``Counters`` when it closes a connection it
did not trust (a malformed or slow routing preamble, an unknown destination, a failed or slow
handshake, a certificate of someone not wanted, a hello the peer may not say). The counts are
what a run reports; the last few details are kept for its log.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

RECENT = 64  # details kept (the newest), so a flood cannot grow the record without bound


class Counters:
    """Thread-safe counts by reason, and the newest ``RECENT`` details."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._recent: deque[str] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def add(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self._counts[reason] += 1
            self._recent.append(f"{reason}: {detail}" if detail else reason)

    def as_dict(self) -> dict[str, int]:
        """The counts, for summary.json."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def recent(self) -> list[str]:
        with self._lock:
            return list(self._recent)
