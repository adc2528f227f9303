"""Revocation while a run goes on: a listener notices that its revocation list changed, checks it,
and applies it without a restart.

Why: a listener reads ``ca.crl`` when it builds its TLS contexts (``RunTls.reload``), so before
this the owner had to restart the coordinator to shut a revoked participant out, and a revoked
participant's open connections stayed up. ``RevocationWatch`` polls the list beside the
listener's key; when its bytes change it loads it and checks its signature under the run's CA
(a list the CA did not sign is refused in one line, and the old one stays in force: whoever can
write the file must not be able to revoke everyone, or no one), rebuilds the contexts (new
handshakes check the new list), and hands the revoked serial numbers to ``on_revoked``, which
closes the connections they hold (``cluster/control.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from meshlearn.net.tls import RunTls

CHECK_EVERY_S = 2.0  # how often a running listener looks at its list


class RevocationWatch:
    """Watches ``tls``'s revocation list; ``on_revoked(serials)`` after each valid change; ``log``
    one line per change (applied or refused)."""

    def __init__(self, tls: RunTls, on_revoked: Callable[[set[int]], None],
                 log: Callable[[str], None] = lambda line: None, every_s: float = CHECK_EVERY_S):
        self.tls, self.on_revoked, self.log, self.every_s = tls, on_revoked, log, every_s
        self.path = Path(tls.credentials.crl)
        self._seen = self._read()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="revocation-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Look once: apply the list if it changed and is valid; whether it was applied."""
        data = self._read()
        if data is None or data == self._seen:
            return False
        self._seen = data
        try:
            crl = x509.load_pem_x509_crl(data)
            ca = x509.load_pem_x509_certificate(Path(self.tls.credentials.ca).read_bytes())
            valid = crl.is_signature_valid(ca.public_key()) and crl.issuer == ca.subject
        except ValueError as err:
            valid, why = False, f"not a revocation list ({err})"
        else:
            why = "not signed by the run's CA"
        if not valid:
            self.log(f"meshlearn: refused the new revocation list {self.path}: {why}; the previous one "
                     "stays in force")
            return False
        self.tls.reload()
        serials = {entry.serial_number for entry in crl}
        self.log(f"meshlearn: applied the new revocation list {self.path} ({len(serials)} serial(s) revoked)")
        self.on_revoked(serials)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None  # being replaced: the next look sees it
