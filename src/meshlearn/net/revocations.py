"""Revocation while a run goes on: a listener notices that its revocation list changed, checks it,
and applies it without a restart.

Why: a listener reads ``ca.crl`` when it builds its TLS contexts (``RunTls``), so before this the
owner had to restart the coordinator to shut a revoked participant out, and a revoked
participant's open connections stayed up. ``RevocationWatch`` polls its sources — the list beside
the listener's key and, on a cluster host that is not the coordinator, the list the coordinator
publishes on its control service (``ListSource``) — and when one's bytes change it checks those
bytes (``crl.py``: bounded, signed by the run's CA, not older than the list in force) and builds
the contexts from them (``RunTls.reload``), so new handshakes check the new list, and hands the
revoked serial numbers to ``on_revoked``, which closes the connections they hold
(``cluster/control.py``). A list applied from a source other than the file is written atomically
over the file, so a process started later on the machine, or a resume, starts with it. A list it
refuses is refused in one line, counted (``refused``; ``list_refused`` in ``counters``) and the
one in force stays: whoever can write the file, or answer in the coordinator's place, must not be
able to revoke everyone, or no one, nor bring back an old list that predates a revocation.

The watch must outlive anything the file, the network or the machine does: a look that fails (the
file unreadable for a moment, the control service out of reach, OpenSSL refusing what it was
given, ``on_revoked`` failing) is counted (``failures``) and logged, the last good list stays in
force, and the same bytes are looked at again next time. A watch thread that died would stop
revocation silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshlearn.net.counters import Counters
from meshlearn.net.crl import ListRefused, checked, read_bounded
from meshlearn.net.keys import write_public
from meshlearn.net.tls import RunTls

CHECK_EVERY_S = 2.0  # how often a running listener looks at its list


@dataclass(frozen=True)
class ListSource:
    """Where a list comes from: ``where`` names it in the log, ``read`` gives its bytes now (None:
    no list there yet), ``sender``: the participant a list the CA did not sign is attributed to
    (None: the file; an older list is nobody's fault, an honest sender may not have the newer yet)."""

    where: str
    read: Callable[[], bytes | None]
    sender: str | None = None


class RevocationWatch:
    """Watches ``tls``'s revocation list, and each of ``sources``; ``on_revoked(serials)`` after each
    valid change; ``log`` one line per change (applied or refused) and per failed look; ``counters``
    (optional) counts each refused list (``list_refused``)."""

    def __init__(self, tls: RunTls, on_revoked: Callable[[set[int]], None],
                 log: Callable[[str], None] = lambda line: None, every_s: float = CHECK_EVERY_S,
                 sources: tuple[ListSource, ...] = (), counters: Counters | None = None):
        self.tls, self.on_revoked, self.log, self.every_s = tls, on_revoked, log, every_s
        self.path = Path(tls.credentials.crl)
        self._file = ListSource(str(self.path), lambda: read_bounded(self.path))
        self.sources = (self._file, *sources)
        self.counters = counters
        self.failures = 0  # looks that failed (the list in force stayed)
        self.refused = 0  # lists refused (the list in force stayed)
        self._seen = {source.where: tls.revocations.data for source in self.sources}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="revocation-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Look once at every source: apply a list that changed and is valid; whether one was
        applied. Raises what a failed look raised (OSError, ssl.SSLError, ...); ``look`` counts it."""
        applied = False
        for source in self.sources:
            applied = self._check(source) or applied
        return applied

    def look(self) -> bool:
        """``check``, surviving whatever a source's look raises: counted, logged, and tried again
        next time (one source failing does not keep the others from being looked at)."""
        applied = False
        for source in self.sources:
            try:
                applied = self._check(source) or applied
            except Exception as err:  # noqa: BLE001 — the watch must not die (revocation would stop)
                self.failures += 1
                self.log(f"meshlearn: could not look at the revocation list {source.where} "
                         f"({type(err).__name__}: {err}); the previous one stays in force, looking again "
                         f"in {self.every_s:g} s")
        return applied

    def _check(self, source: ListSource) -> bool:
        data = source.read()
        if data is None or data == self._seen[source.where]:
            return False
        try:
            new = checked(data, self.tls.credentials.ca, source.where)
        except ListRefused as err:  # not the CA's list: whoever sent it is to blame
            return self._refuse(source, data, err.why, source.sender)
        try:
            revocations = self.tls.reload(new)
        except ListRefused as err:  # older than the list in force: an honest source may lag behind
            return self._refuse(source, data, err.why, None)
        serials = set(revocations.serials)
        self.log(f"meshlearn: applied the new revocation list {source.where} ({len(serials)} serial(s) "
                 "revoked)")
        self.on_revoked(serials)
        if source is not self._file:  # what this machine starts with next time (and no change to apply)
            write_public(self.path, revocations.data)
            self._seen[self._file.where] = revocations.data
        self._seen[source.where] = data  # only now: a failure before is tried again at the next look
        return True

    def _refuse(self, source: ListSource, data: bytes, why: str, sender: str | None) -> bool:
        """Refuse ``data`` from ``source`` in one line, counted (under ``sender``, if anyone)."""
        self._seen[source.where] = data  # refused for what it is: said once, not at every look
        self.refused += 1
        if self.counters is not None:
            self.counters.add("list_refused", f"{source.where}: {why}", sender=sender)
        self.log(f"meshlearn: refused the new revocation list {source.where}: {why}; the previous one "
                 "stays in force")
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.look()
