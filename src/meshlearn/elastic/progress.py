"""This worker's last step on the run's store (``progress/<worker>``), set off the step's path.

Why a thread: the key is read by the launcher when the worker's process has ended (the step
``workers.json`` says it finished or left after, and the step its freed slot names:
``membership.py``); nobody reads it during a step. Set at the end of every step, it cost a worker
away from the store one round trip of the link before its next step: over an 80 ms RTT pair that
delayed its pipeline row by 80 ms a step, the whole of the elastic step's overhead against the
fixed membership's (docs/elastic.md, "Measured: where an elastic step's time goes"). Here the step
hands its count to a thread with a store client of its own, which sets the newest count it has
not set yet (counts that came while it was setting are not sent one by one).

What changes for a worker that is killed: its key may name the step before its last (the set of
the last was still in flight). A worker that ends normally sets its last count in ``close``,
before it says it finished; one that leaves on an eviction, before it exits
(``Evictions.check_eviction``). A failed set (a lost store, a refusal) is raised in the step that
follows it, as the step's own set would have been.
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class ProgressBeacon:
    """Sets ``key`` on ``store`` (a client no other thread uses) to the newest ``report``ed count."""

    def __init__(self, store: dist.Store, key: str):
        self.store, self.key = store, key
        self.changed = threading.Condition()
        self.newest: int | None = None  # the newest count reported
        self.sent: int | None = None  # the newest count set on the store
        self.error: Exception | None = None  # a set that failed: raised in the main thread
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=f"meshlearn {key}", daemon=True)
        self.thread.start()

    def report(self, count: int) -> None:
        """``count`` steps done: set on the store soon, without waiting for it."""
        with self.changed:
            self._raise()
            self.newest = count
            self.changed.notify()

    def close(self, timeout_s: float) -> None:
        """Set the newest count, waiting up to ``timeout_s`` for it; then the thread ends."""
        with self.changed:
            self.closing = True
            self.changed.notify()
        self.thread.join(timeout_s)
        with self.changed:
            self._raise()
            if self.thread.is_alive():
                raise TimeoutError(f"{self.key} = {self.newest} was not set on the run's store within "
                                   f"{timeout_s:g} s")

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"setting {self.key} on the run's store failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            with self.changed:
                while self.newest == self.sent and not self.closing:
                    self.changed.wait()
                if self.newest == self.sent:  # closing, and everything is set
                    return
                count = self.newest
            try:
                self.store.set(self.key, str(count))
            except Exception as err:  # noqa: BLE001 — any failure is the main thread's to raise
                with self.changed:
                    self.error = err
                return
            with self.changed:
                self.sent = count
