"""A run's credentials: its own certificate authority, one key and certificate per participant,
and a signed revocation list.

Why a per-run CA: the run's owner is the only one who decides who takes part, so the owner's
CA is the only trust root every participant accepts (no system or public CA is ever loaded).
Admitting someone is issuing a certificate; expelling someone is revoking it. A certificate from
another run, or self-made, fails the TLS handshake.

Why Ed25519 (not ECDSA P-256): one curve with nothing to choose, deterministic signatures (no
per-signature random nonce, whose reuse or bias leaks an ECDSA key), 32-byte keys and fast
signing and checking; OpenSSL 1.1.1 and later accept it in TLS 1.3, the only version meshlearn
speaks. P-256 would matter for FIPS modules, hardware tokens or old TLS stacks, none of which a
run needs.

Identity: a certificate's subject carries the participant's name (``CN``: a host of
``[cluster.hosts]`` or a joiner's name) and its role (``OU``: ``host`` or ``joiner``); the
organisation (``O``) names the run. Names are never reissued: a revoked name stays revoked, so a
blame or an eviction recorded against a name keeps meaning the same holder.

The folder ``meshlearn keys`` writes (``--out DIR``):

- ``ca.key`` — the CA's private key. Only the owner needs it (to add and revoke); it should not
  travel to any machine of the run.
- ``ca.crt`` — the CA's certificate: every machine's trust root.
- ``ca.crl`` — the revocation list, signed by the CA (so a copy handed on by anyone, the
  coordinator included, cannot be altered). Revocation is by serial number; ``revoke`` lists
  every certificate ever issued to the name. Every machine loads it with its credentials; the
  owner gives the new one to the coordinator after a revocation.
- ``<name>.key`` / ``<name>.crt`` — one participant's credential: the key goes to that machine
  only.
- ``issued.json`` — the owner's ledger: each name's role, serials and whether it is revoked.

Private keys are written with mode 0600, every file atomically (a temporary file renamed over
the target), so a crash never leaves a half-written key.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlearn.atomic import atomic_path
from meshlearn.net.crl import ListRefused, read_list

ROLES = ("host", "joiner")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
RESERVED = ("ca", "issued")  # file stems the folder already uses
VALIDITY = timedelta(days=365)  # of the CA and every credential: a run outlives no year
CLOCK_SKEW = timedelta(hours=1)  # certificates are valid from this long before they are made


class KeysError(ValueError):
    """Bad input to the keys commands: names the field, the value and what is allowed (one line)."""

    def __init__(self, key: str, value: object, allowed: str):
        super().__init__(f"{key} = {value!r}: {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


@dataclass(frozen=True)
class Identity:
    """Who is at the other end of an authenticated connection: what its certificate says."""

    name: str
    role: str

    def __str__(self) -> str:
        return f"{self.name} ({self.role})"


@dataclass(frozen=True)
class Credentials:
    """The files one participant runs with: its key and certificate, the run's CA and CRL."""

    key: Path
    cert: Path
    ca: Path
    crl: Path

    @classmethod
    def in_folder(cls, folder: Path, name: str) -> Credentials:
        """``name``'s credentials as ``meshlearn keys`` lays them out in ``folder``."""
        folder = Path(folder)
        return cls(folder / f"{name}.key", folder / f"{name}.crt", folder / "ca.crt", folder / "ca.crl")


def check_private(path: Path, field: str = "--key") -> Path:
    """``path``, a private key file that no other user can read or write (as ssh refuses a key
    with loose permissions: a copy through a group or a shared account would let another
    account act as this participant); KeysError naming its mode otherwise."""
    mode = Path(path).stat().st_mode & 0o777
    if mode & 0o077:
        raise KeysError(field, str(path), f"a private key must be readable by its owner only (mode "
                                          f"{oct(mode)}): chmod 600 {path}")
    return Path(path)


def identity_of(cert: x509.Certificate) -> Identity:
    """The name and role a run's certificate states (ValueError if it states neither)."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(names) != 1 or len(roles) != 1 or roles[0].value not in ROLES:
        raise ValueError(f"a certificate whose subject {cert.subject.rfc4514_string()!r} names no "
                         f"participant of a run")
    return Identity(str(names[0].value), str(roles[0].value))


def check_name(name: str, field: str = "name") -> str:
    if not NAME_RE.match(name) or name in RESERVED:
        raise KeysError(field, name, "a name of 1-63 letters, digits, '.', '_' or '-', starting with a "
                                     f"letter or digit, and not {' or '.join(RESERVED)}")
    return name


def create_run(folder: Path, hosts: list[str], run_name: str) -> list[str]:
    """A new CA in ``folder`` (created if missing), an empty revocation list, and one credential per
    host. Refuses a folder that already holds a CA: replacing it would lock out every credential
    issued under it (use ``add_joiner`` to issue more). Returns the names issued."""
    folder = Path(folder)
    for host in hosts:
        check_name(host, "cluster.hosts")
    if not hosts or len(set(hosts)) != len(hosts):
        raise KeysError("cluster.hosts", hosts, "one or more hosts, each named once")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # it will hold the CA's key
    with _locked(folder):
        if (folder / "ca.key").exists():
            raise KeysError("--out", str(folder), "already holds a run's CA (ca.key); issue more with "
                                                  "--add NAME, or choose a new folder for a new run")
        ca_key = ed25519.Ed25519PrivateKey.generate()
        now = datetime.now(UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, run_name),
                             x509.NameAttribute(NameOID.COMMON_NAME, f"{run_name} CA")])
        ca_cert = (_builder(subject, subject, ca_key.public_key(), now)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(_usage(ca=True), critical=True)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False)
                   .sign(ca_key, None))
        _write_key(folder / "ca.key", ca_key)
        write_public(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
        ledger: dict[str, dict] = {}
        _write_crl(folder, ca_key, ca_cert, ledger)
        for host in hosts:
            _issue(folder, ca_key, ca_cert, ledger, host, "host")
        _write_ledger(folder, ledger)
    return list(hosts)


def add_joiner(folder: Path, name: str) -> Credentials:
    """Issue a joiner's credential under the run's CA in ``folder``. A name is issued once: an
    existing or revoked name is refused (choose another)."""
    check_name(name, "--add")
    folder = Path(folder)
    _require_ca(folder)
    with _locked(folder):
        ca_key, ca_cert = _load_ca(folder)
        ledger = _read_ledger(folder)
        if name in ledger:
            state = "revoked" if ledger[name]["revoked"] else f"issued to a {ledger[name]['role']}"
            raise KeysError("--add", name, f"this name is already {state}; a name is issued once, "
                                           f"choose another")
        _issue(folder, ca_key, ca_cert, ledger, name, "joiner")
        _write_ledger(folder, ledger)
    return Credentials.in_folder(folder, name)


def revoke(folder: Path, name: str) -> list[str]:
    """Revoke every certificate ever issued to ``name`` and rewrite ``ca.crl``; returns their serials
    (hex). The name's key files stay (they are worthless now); the name is never issued again."""
    folder = Path(folder)
    _require_ca(folder)
    with _locked(folder):
        ca_key, ca_cert = _load_ca(folder)
        ledger = _read_ledger(folder)
        if name not in ledger:
            raise KeysError("--revoke", name, f"no credential of that name was issued; issued: "
                                              f"{sorted(ledger) or 'none'}")
        ledger[name]["revoked"] = True
        _write_crl(folder, ca_key, ca_cert, ledger)
        _write_ledger(folder, ledger)
    return list(ledger[name]["serials"])


def revoked_serials(crl_path: Path) -> set[int]:
    """The serial numbers a revocation list names (its signature is checked by whoever loads it
    for TLS; this is for reports)."""
    crl = x509.load_pem_x509_crl(Path(crl_path).read_bytes())
    return {entry.serial_number for entry in crl}


def _issue(folder: Path, ca_key, ca_cert: x509.Certificate, ledger: dict, name: str, role: str) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME,
                                            ca_cert.subject.get_attributes_for_oid(
                                                NameOID.ORGANIZATION_NAME)[0].value),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, ca_cert.subject, key.public_key(), datetime.now(UTC))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(ca=False), critical=True)
            # every participant both dials and accepts, so both ends' usages
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, None))
    _write_key(folder / f"{name}.key", key)
    write_public(folder / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    ledger[name] = {"role": role, "serials": [*ledger.get(name, {}).get("serials", []),
                                              format(cert.serial_number, "x")], "revoked": False}


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


def _write_crl(folder: Path, ca_key, ca_cert: x509.Certificate, ledger: dict) -> None:
    """The signed list of every serial of every revoked name; valid as long as the CA (OpenSSL
    refuses a handshake against an expired list). Numbered one above the list it replaces, so a
    listener can refuse an older one (``crl.py``: its signature alone does not say it is the latest)."""
    now = datetime.now(UTC)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - CLOCK_SKEW).next_update(ca_cert.not_valid_after_utc)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False)
               .add_extension(x509.CRLNumber(_previous_number(folder) + 1), critical=False))
    for entry in ledger.values():
        if entry["revoked"]:
            for serial in entry["serials"]:
                revoked = x509.RevokedCertificateBuilder().serial_number(int(serial, 16)).revocation_date(now)
                builder = builder.add_revoked_certificate(revoked.build())
    write_public(folder / "ca.crl", builder.sign(ca_key, None).public_bytes(serialization.Encoding.PEM))


def _previous_number(folder: Path) -> int:
    """The number of the list in ``folder`` (0: none, or one written before lists were numbered)."""
    try:
        return read_list(folder / "ca.crl", folder / "ca.crt").number or 0
    except (OSError, ListRefused):
        return 0


def _require_ca(folder: Path) -> None:
    if not (folder / "ca.key").is_file():
        raise KeysError("--out", str(folder), "holds no run CA (ca.key); create one with "
                                              "meshlearn keys --config RUN.toml --out DIR")


def _load_ca(folder: Path) -> tuple[ed25519.Ed25519PrivateKey, x509.Certificate]:
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise KeysError("--out", str(folder), "ca.key is not an Ed25519 key written by meshlearn keys")
    return key, x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())


def _read_ledger(folder: Path) -> dict[str, dict]:
    return json.loads((folder / "issued.json").read_text())["names"]


def _write_ledger(folder: Path, ledger: dict) -> None:
    write_public(folder / "issued.json", (json.dumps({"names": ledger}, indent=2, sort_keys=True)
                                           + "\n").encode())


def _write_key(path: Path, key: ed25519.Ed25519PrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    _write(path, pem, 0o600)


def write_public(path: Path, data: bytes) -> None:
    """``data`` into ``path`` atomically, readable by all (a certificate, a list, the ledger)."""
    _write(path, data, 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    with atomic_path(path) as tmp:  # mkstemp made it 0600: no moment where a key is readable by others
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One keys command at a time on a folder (two ``--add`` at once would lose a ledger entry)."""
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
