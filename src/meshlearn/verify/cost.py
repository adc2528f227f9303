"""What verification costs, in the units it is paid in: CPU time on the verifiers' own nodes.

SENTINEL's verifiers are CPU nodes of their own, one per boundary, not the GPUs of the workers.
``VerifierClock`` measures each inspection's CPU time (``time.thread_time``: this thread's CPU
time, so other processes on the machine do not inflate it) and models each boundary's verifier as
one CPU serving messages first come, first served: a message arriving at virtual time t is
delivered at max(t, verifier free) + its CPU time. That delay, not the inspection's wall time, is
what a driver should add on the virtual clock; the GPU device model never sees it. The wall-clock
overhead of running verifiers in the simulator's process is a separate number (the bench's).

The hook a driver calls, right after ``Sentinel.inspect`` returned the message to deliver::

    delivery_s = sentinel.release_s(message, arrival_s)
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class VerifierClock:
    """Per-boundary CPU queues and CPU-time totals."""

    def __init__(self) -> None:
        self.free_at: dict[int, float] = {}  # boundary → virtual time its verifier is next free
        self.cpu_s: dict[int, float] = {}  # boundary → CPU seconds spent inspecting
        self.messages: dict[int, int] = {}
        self.queued_s = 0.0  # total virtual seconds messages waited for a busy verifier
        self.last_cpu_s = 0.0

    @contextmanager
    def measure(self, boundary: int):
        """Time one inspection on this thread's CPU clock."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.last_cpu_s = time.thread_time() - started
            self.cpu_s[boundary] = self.cpu_s.get(boundary, 0.0) + self.last_cpu_s
            self.messages[boundary] = self.messages.get(boundary, 0) + 1

    def release_s(self, boundary: int, arrival_s: float, cpu_s: float | None = None) -> float:
        """When a message that arrived at ``arrival_s`` leaves the boundary's verifier."""
        cpu_s = self.last_cpu_s if cpu_s is None else cpu_s
        start = max(arrival_s, self.free_at.get(boundary, 0.0))
        self.queued_s += start - arrival_s
        self.free_at[boundary] = start + cpu_s
        return start + cpu_s

    def summary(self) -> dict:
        total = sum(self.cpu_s.values())
        count = sum(self.messages.values())
        return {"cpu_s": total, "messages": count,
                "cpu_ms_per_message": 1e3 * total / count if count else None,
                "queued_s": self.queued_s,
                "cpu_s_per_boundary": {f"s{b}|s{b + 1}": s for b, s in sorted(self.cpu_s.items())}}

    def state_dict(self) -> dict:
        return {"free_at": dict(self.free_at), "cpu_s": dict(self.cpu_s),
                "messages": dict(self.messages), "queued_s": self.queued_s}

    def load_state_dict(self, state: dict) -> None:
        self.free_at = {int(b): t for b, t in state["free_at"].items()}
        self.cpu_s = {int(b): t for b, t in state["cpu_s"].items()}
        self.messages = {int(b): n for b, n in state["messages"].items()}
        self.queued_s = state["queued_s"]
