"""Revocation while a run goes on: a listener notices that its revocation list changed, checks it,
and applies it without a restart.

Why: a listener reads ``ca.crl`` when it builds its TLS contexts (``RunTls``), so before this the
owner had to restart the coordinator to shut a revoked participant out, and a revoked
participant's open connections stayed up. ``RevocationWatch`` polls the list beside the
listener's key; when its bytes change it checks those bytes (``crl.py``: bounded, signed by the
run's CA, not older than the list in force) and builds the contexts from them
(``RunTls.reload``), so new handshakes check the new list, and hands the revoked serial numbers to
``on_revoked``, which closes the connections they hold (``cluster/control.py``). A list it refuses
is refused in one line and the one in force stays: whoever can write the file must not be able to
revoke everyone, or no one, nor bring back an old list that predates a revocation.

The watch must outlive anything the file or the machine does: a look that fails (the file
unreadable for a moment, OpenSSL refusing what it was given, ``on_revoked`` failing) is counted
(``failures``) and logged, the last good list stays in force, and the same bytes are looked at
again next time. A watch thread that died would stop revocation silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from meshlearn.net.crl import ListRefused, checked, read_bounded
from meshlearn.net.tls import RunTls

CHECK_EVERY_S = 2.0  # how often a running listener looks at its list


class RevocationWatch:
    """Watches ``tls``'s revocation list; ``on_revoked(serials)`` after each valid change; ``log``
    one line per change (applied or refused) and per failed look."""

    def __init__(self, tls: RunTls, on_revoked: Callable[[set[int]], None],
                 log: Callable[[str], None] = lambda line: None, every_s: float = CHECK_EVERY_S):
        self.tls, self.on_revoked, self.log, self.every_s = tls, on_revoked, log, every_s
        self.path = Path(tls.credentials.crl)
        self.failures = 0  # looks that failed (the list in force stayed)
        self._seen = tls.revocations.data
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="revocation-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Look once: apply the list if it changed and is valid; whether it was applied. Raises
        what a failed look raised (OSError, ssl.SSLError, ...); ``look`` counts it instead."""
        data = read_bounded(self.path)
        if data == self._seen:
            return False
        try:
            revocations = self.tls.reload(checked(data, self.tls.credentials.ca, self.path))
        except ListRefused as err:
            self._seen = data  # refused for what it is: said once, not at every look
            self.log(f"meshlearn: refused the new revocation list {self.path}: {err.why}; the previous one "
                     "stays in force")
            return False
        serials = set(revocations.serials)
        self.log(f"meshlearn: applied the new revocation list {self.path} ({len(serials)} serial(s) revoked)")
        self.on_revoked(serials)
        self._seen = data  # only now: a failure before is tried again at the next look
        return True

    def look(self) -> bool:
        """``check``, surviving whatever it raises: counted, logged, and tried again next time."""
        try:
            return self.check()
        except Exception as err:  # noqa: BLE001 — the watch must not die (revocation would stop)
            self.failures += 1
            self.log(f"meshlearn: could not look at the revocation list {self.path} ({type(err).__name__}: "
                     f"{err}); the previous one stays in force, looking again in {self.every_s:g} s")
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.look()
