"""Counts of connections turned away, by reason, for a run's summary.json.

Every listener of the ``net`` package adds to one ``Counters`` when it closes a connection it
did not trust (a malformed or slow routing preamble, an unknown destination, a failed or slow
handshake, a certificate of someone not wanted, a hello the peer may not say), and every
receiver adds what an authenticated participant sent that it refused (a control request beyond
the sender's authority, a contribution that does not decode). The counts are what a run reports;
the newest few details of each reason are kept for its log: per reason, so that one participant
flooding one kind of refusal (thousands of ``rate_limited`` lines) cannot push out the record of
another's lies. A refusal of something an authenticated participant
did is also counted under its ``sender`` (the identity its certificate names): a run's record
says who misbehaved, and that no honest participant did.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable

RECENT = 16  # details kept per reason (the newest), so a flood cannot grow the record without bound
MAX_REASONS = 64  # reasons with details kept: far more than the listeners have (docs/security.md)


class Counters:
    """Thread-safe counts by reason, and the newest ``RECENT`` details of each reason. ``on_add``:
    called after each refusal (outside the lock), e.g. to keep a process's record on disk up to date."""

    def __init__(self, on_add: Callable[[Counters], None] | None = None) -> None:
        self._on_add = on_add
        self._counts: Counter[str] = Counter()
        self._senders: Counter[str] = Counter()
        self._recent: dict[str, deque[tuple[int, str]]] = {}  # by reason: (arrival, line)
        self._arrivals = 0
        self._lock = threading.Lock()

    def add(self, reason: str, detail: str = "", sender: str | None = None) -> None:
        """Count one refusal; ``sender``: the authenticated identity it is attributed to (None: a
        connection that never authenticated, a stranger's)."""
        with self._lock:
            self._counts[reason] += 1
            if sender is not None:
                self._senders[sender] += 1
            kept = self._recent.get(reason)
            if kept is None and len(self._recent) < MAX_REASONS:
                kept = self._recent[reason] = deque(maxlen=RECENT)
            if kept is not None:
                kept.append((self._arrivals, f"{reason}: {detail}" if detail else reason))
                self._arrivals += 1
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
        """The newest details of each reason, oldest first."""
        with self._lock:
            return [line for _, line in sorted(item for kept in self._recent.values() for item in kept)]


def newest_per_reason(lines: Iterable[str], per_reason: int = RECENT) -> list[str]:
    """The last ``per_reason`` of ``lines`` of each reason (a line's text before its first ": "),
    in their order, at most ``MAX_REASONS`` reasons: what a record keeps of several ``recent()``."""
    lines = list(lines)
    seen: Counter[str] = Counter()
    kept = []
    for line in reversed(lines):
        reason = line.split(": ", 1)[0]
        if seen[reason] < per_reason and (reason in seen or len(seen) < MAX_REASONS):
            seen[reason] += 1
            kept.append(line)
    return kept[::-1]
