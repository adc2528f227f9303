"""SIGINT / SIGTERM stop a run at the first drain point after the step in flight, with a
checkpoint, in every process.

A signal only sets a flag (``GracefulStop.request``); the trainer turns it into a drain point the
next time it answers ``next_drain``, which it does at least at every step's end, before it decides
whether that step drains (``Trainer._settle_stop``). Which step may drain depends on what has been
started already: a driver feeds every step up to ``min(next_drain(t), t + lookahead)`` and lets
forwards of all of them start, so a drain after step S is safe only if no process has started a
step beyond S. The rule: **stop after S = the highest step any process has claimed**, where a
process claims every step before it starts it — the steps it feeds, and, at the end of a step
that does not drain, the next one.

- Flushing schedules (GPipe, 1F1B) feed no step ahead (``mesh.schedule.feed_lookahead``): a
  signal that comes while step N runs stops the run after step N, unless another process had
  already finished N and claimed N + 1 (under ``--backend dist``; then after N + 1).
- ``async`` feeds up to ``lookahead`` steps ahead, whose microbatches are in flight: the run stops
  after the highest step already fed.

Claims and the stop go through one key of a store with compare-and-set (``drain``: ``f:<F>``, the
highest claimed step, or ``s:<S>:<signal>``, stop after step S). A process must win the key before
it starts a step past F, and the stop replaces F by ``s:F`` in one swap, so once the stop is in
the key no process can start a step past S, and none already has. Every process reads the key each
time it answers ``next_drain`` and so learns S before it decides whether step S drains (it has
claimed S, at least, before it ran it). Under the simulator the store is a dict in this process;
under ``--backend dist`` it is the rendezvous store, so all processes agree on S whichever of them
got the signal first.

Repeated signals: the first asks for the graceful stop; in a single process a second one stops at
once (``KeyboardInterrupt``); dist workers ignore repeats (the terminal and the launcher may both
deliver the same Ctrl-C) and leave the hard stop to the launcher.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

KEY = "drain"
STOPPING = ("stopping with a checkpoint at the first drain point after the step in flight "
            "(async: after the last step already fed)")
"""What a signal's handler says it will do (the launcher of a dist run says the same)."""
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LocalStore:
    """The part of torch.distributed.Store's interface the agreement uses, in one process."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.data.get(key)
        if (current is None and expected == "") or current == expected.encode():
            self.data[key] = desired.encode()
            return self.data[key]
        return current if current is not None else b""


class GracefulStop:
    """The run's stop request and the step it stops after (``stop_after``, 0-based, or None).

    ``store``: a torch.distributed Store shared by every process of the run (None: this process
    only). ``repeat``: what a second signal does — ``"raise"`` (KeyboardInterrupt: stop now) or
    ``"ignore"``.
    """

    def __init__(self, store: Any = None, repeat: str = "raise"):
        self.store = store if store is not None else LocalStore()
        self.repeat = repeat
        self.signum: int | None = None
        self.stop_after: int | None = None
        self.claimed = -1
        self._previous: dict[int, Any] = {}

    # --- signals -------------------------------------------------------------------------------

    def install(self) -> GracefulStop:
        """Handle SIGINT/SIGTERM from now on (only the main thread may; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.request(signum)
            print(f"\nmeshlearn: {signal.Signals(signum).name}: {STOPPING}"
                  + (" (again to stop at once, losing the steps since the last checkpoint)"
                     if self.repeat == "raise" else ""), file=sys.stderr, flush=True)
        elif self.repeat == "raise":
            raise KeyboardInterrupt

    def request(self, signum: int = signal.SIGINT) -> None:
        """Ask for the stop (what the handler does; tests call it directly)."""
        if self.signum is None:
            self.signum = int(signum)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports death by that signal (130, 143)."""
        return 128 + (self.signum or 0)

    # --- the agreement -------------------------------------------------------------------------

    def observe(self, step: int, frontier: int) -> bool:
        """At ``next_drain(step)``: claim ``frontier`` (the last step this process would feed
        now), or, with a signal pending, stop after the highest step claimed so far (at least
        ``step``); learn of another process's stop. Returns True when this call latched it."""
        if self.stop_after is not None:
            return False
        if self.signum is not None:
            value = self._exchange(max(self.claimed, step), stop=True)
        else:
            value = self._exchange(max(frontier, self.claimed), stop=False)
        if value.startswith("s:"):
            _, step, signum = value.split(":")
            self.stop_after = int(step)
            self.signum = self.signum or int(signum)  # another process may have got the signal
            return True
        self.claimed = int(value[2:])
        return False

    def _exchange(self, frontier: int, stop: bool) -> str:
        """The swap of the key that claims ``frontier`` (or stops), and the value it leaves.

        The first swap expects the value this process read last (``claimed``: in a steady run, its
        claim of the step it has just run), so claiming the next step is one request, not a read and
        then a swap: each a round trip to a store across a WAN link, at every step's end, before
        the next step may start. Where the guess is wrong the swap returns what the key holds, and
        the loop goes on from that as it would from a read."""
        current, read = f"f:{self.claimed}" if self.claimed >= 0 else "", False
        while True:
            if current.startswith("s:"):
                return current
            highest = int(current[2:]) if current else -1
            if stop:
                desired = f"s:{max(highest, frontier)}:{self.signum}"
            elif frontier > highest:
                desired = f"f:{frontier}"
            elif read:
                return current
            else:
                desired = current  # nothing to claim: the swap only reads the key (a stop may be in it)
            got = self._decode(self.store.compare_set(KEY, current, desired))
            if got == desired:
                return got
            # a TCPStore answers a swap of a key it does not hold with the value expected: the key
            # is empty then, not ``current`` (else the loop would ask the same forever)
            current, read = ("" if got == current else got), True

    @staticmethod
    def _decode(value: bytes | str) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)
