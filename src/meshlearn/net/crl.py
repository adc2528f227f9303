"""A revocation list, checked before any listener uses it: bounded in size, signed by the run's CA,
and not older than the list already in force.

Why every use goes through here: the list decides who may connect, and the file it comes from may
be replaced at any moment (the owner copies a new one over it while the run goes on). A list the
CA did not sign would let whoever can write the file revoke everyone, or no one; an *older* list,
signed by the CA in its day, would un-revoke whoever was revoked since (the CA's signature says
who issued a list, not that it is the latest). So a listener reads the file once, checks those
bytes, and builds its TLS contexts from the very bytes it checked (``RunTls.reload``), never from
the file a second time. A list is newer when its ``CRLNumber`` (which ``keys.revoke`` raises by one
on every rewrite) is higher; a list without one (written before meshlearn numbered them) is ordered
by its ``last_update`` alone, and is never newer than a numbered one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509

MAX_LIST_BYTES = 1 << 20
"""The largest revocation list read: each revoked serial takes about 40 bytes of PEM, so a run could
revoke some 25,000 certificates before reaching it."""


class ListRefused(ValueError):
    """A revocation list that may not be used; ``why`` says why, in a few words."""

    def __init__(self, path: Path | str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


@dataclass(frozen=True)
class RevocationList:
    """A list whose signature was checked: its bytes (PEM), the serials it revokes, its number
    (None: unnumbered) and when it was made."""

    data: bytes
    serials: frozenset[int]
    number: int | None
    last_update: datetime

    def older_than(self, current: RevocationList) -> str | None:
        """Why this list may not replace ``current`` (None: it may)."""
        if self.last_update < current.last_update:
            return (f"it was made at {self.last_update:%Y-%m-%d %H:%M:%S}, before the list in force "
                    f"({current.last_update:%Y-%m-%d %H:%M:%S})")
        if current.number is not None and (self.number is None or self.number < current.number):
            return f"its number {self.number} is below the list in force's ({current.number})"
        return None


def read_bounded(path: Path) -> bytes:
    """At most ``MAX_LIST_BYTES`` + 1 bytes of ``path`` (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(MAX_LIST_BYTES + 1)


def checked(data: bytes, ca_path: Path, path: Path | str) -> RevocationList:
    """``data`` (read from ``path``) as a list signed by the CA in ``ca_path``; ListRefused otherwise."""
    if len(data) > MAX_LIST_BYTES:
        raise ListRefused(path, f"larger than {MAX_LIST_BYTES} bytes")
    try:
        crl = x509.load_pem_x509_crl(data)
        ca = x509.load_pem_x509_certificate(Path(ca_path).read_bytes())
        signed = crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key())
        serials = frozenset(entry.serial_number for entry in crl)
        numbers = [e.value.crl_number for e in crl.extensions if isinstance(e.value, x509.CRLNumber)]
    except (ValueError, TypeError) as err:
        raise ListRefused(path, f"not a revocation list ({err})") from None
    if not signed:
        raise ListRefused(path, "not signed by the run's CA")
    return RevocationList(data, serials, numbers[0] if numbers else None, crl.last_update_utc)


def read_list(path: Path, ca_path: Path) -> RevocationList:
    """The list in ``path``, checked (ListRefused; OSError when it cannot be read)."""
    return checked(read_bounded(path), ca_path, path)
