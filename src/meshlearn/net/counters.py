"""Counts of connections turned away, by reason, for a run's summary.json.

Every listener of the ``net`` package adds to one ``Counters`` when it closes a connection it
did not trust (a malformed or slow routing preamble, an unknown destination, a failed or slow
handshake, a certificate of someone not wanted, a hello the peer may not say), and every
receiver adds what an authenticated participant sent that it refused (a control request beyond
the sender's authority, a contribution that does not decode). The counts are what a run reports;
the last few details are kept for its log. A refusal of something an authenticated participant
did is also counted under its ``sender`` (the identity its certificate names): a run's record
says who misbehaved, and that no honest participant did.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable

RECENT = 64  # details kept (the newest), so a flood cannot grow the record without bound


class Counters:
    """Thread-safe counts by reason, and the newest ``RECENT`` details. ``on_add``: called after
    each refusal (outside the lock), e.g. to keep a process's record on disk up to date."""

    def __init__(self, on_add: Callable[[Counters], None] | None = None) -> None:
        self._on_add = on_add
        self._counts: Counter[str] = Counter()
        self._senders: Counter[str] = Counter()
        self._recent: deque[str] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def add(self, reason: str, detail: str = "", sender: str | None = None) -> None:
        """Count one refusal; ``sender``: the authenticated identity it is attributed to (None: a
        connection that never authenticated, a stranger's)."""
        with self._lock:
            self._counts[reason] += 1
            if sender is not None:
                self._senders[sender] += 1
            self._recent.append(f"{reason}: {detail}" if detail else reason)
        if self._on_add is not None:
            self._on_add(self)

    def as_dict(self) -> dict[str, int]:
        """The counts, for summary.json."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def by_sender(self) -> dict[str, int]:
        """The refusals attributed to each authenticated sender."""
        with self._lock:
            return dict(sorted(self._senders.items()))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def recent(self) -> list[str]:
        with self._lock:
            return list(self._recent)
