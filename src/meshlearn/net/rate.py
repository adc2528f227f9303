"""A token bucket: how long a request must wait so that one participant stays under its rate.

Why a bucket and not a refusal count: an authenticated participant's requests are served on a
thread of their own (``cluster/control.py``), so the cheapest defence against one that floods is to
make that thread wait — its flood then queues in its own TCP buffers and costs the server a
sleeping thread, while an honest burst (a process starting, a checkpoint agreement) passes at
once. The bucket holds ``burst`` requests and refills at ``per_s``; a request that finds it empty
goes into debt and is told how long to wait, so every request is served, none faster than the rate.
One bucket may be shared by several threads (a participant's connections): each request's debt
adds up, so together they wait as long as one connection asking all of it would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """``burst`` requests at once, ``per_s`` sustained, whichever thread asks. ``clock``: a
    monotonic clock (tests give their own)."""

    def __init__(self, per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
        if per_s <= 0 or burst < 1:
            raise ValueError(f"a rate of {per_s}/s with a burst of {burst}: the rate must be > 0, "
                             "the burst >= 1")
        self.per_s, self.burst, self.clock = per_s, burst, clock
        self._tokens, self._last = float(burst), clock()
        self._lock = threading.Lock()

    def delay(self) -> float:
        """Take one request's token: the seconds it must wait before it is served (0: at once)."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.per_s) - 1.0
            self._last = now
            return 0.0 if self._tokens >= 0 else -self._tokens / self.per_s
