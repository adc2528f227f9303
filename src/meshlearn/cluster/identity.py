"""Which run identity this machine acts as in a cluster run: ``meshlearn train --key FILE``.

The key is the one ``meshlearn keys --config run.toml --out DIR`` wrote for this host
(``DIR/<host>.key``); the rest of the credential lies beside it (``<host>.crt``, ``ca.crt``,
``ca.crl``), which is how ``keys`` lays a folder out and what the owner copies to each machine.
Every check runs before the run folder is touched, each failure one line naming ``--key``: a
cluster run without a key, a key file others can read, a certificate that names another host or a
joiner, one the run's CA did not sign, one the revocation list names, a list the CA did not sign
(``net/crl.py``, as every listener reads it). Why here and not at the
first handshake: a machine started with the wrong file would otherwise wait out
``dist.init_timeout_s`` and end with a handshake error on another machine's screen.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from meshlearn.errors import ConfigError
from meshlearn.net.crl import ListRefused, read_list
from meshlearn.net.keys import Credentials, KeysError, check_private, identity_of


def host_credentials(host: str, key: str | None, role: str = "host") -> Credentials:
    """``host``'s credentials from ``--key`` (its private key file), checked; ConfigError otherwise.
    ``role``: ``joiner`` for a newcomer's credential (``meshlearn keys --add``)."""
    if not key:
        made = "--add NAME" if role == "joiner" else "--config RUN.toml"
        raise ConfigError("--key", None, f"a [cluster] run needs this {role}'s private key: --key "
                                         f"DIR/{host}.key, made by `meshlearn keys {made} --out DIR` "
                                         "(docs/security.md)")
    creds = credentials_beside(Path(key))
    for needed in (creds.key, creds.cert, creds.ca, creds.crl):
        if not needed.is_file():
            raise ConfigError("--key", key, f"{needed} is missing: the key's folder must hold what "
                                            f"`meshlearn keys` wrote beside it ({host}.crt, ca.crt, ca.crl)")
    try:
        check_private(creds.key)
    except KeysError as err:
        raise ConfigError("--key", key, err.allowed) from None
    cert, ca = _certificate(creds.cert, key), _certificate(creds.ca, key)
    try:
        who = identity_of(cert)
    except ValueError:
        who = None
    if who is None or who.name != host or who.role != role:
        raise ConfigError("--key", key, f"its certificate is for {who or 'no participant'}, not {role} "
                                        f"{host!r}: use the key `meshlearn keys` made for {host}")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as err:
        raise ConfigError("--key", key, f"{creds.cert.name} was not issued by {creds.ca} "
                                        f"({type(err).__name__}): credentials of another run") from None
    try:
        revoked = read_list(creds.crl, creds.ca).serials
    except (ListRefused, OSError) as err:
        raise ConfigError("--key", key, f"the revocation list beside it cannot be used ({err}): copy the "
                                        "run owner's current ca.crl") from None
    if cert.serial_number in revoked:
        raise ConfigError("--key", key, f"{role} {host}'s certificate is revoked in {creds.crl}: ask the "
                                        "run's owner for a new one")
    if _public(cert) != _public_of_key(creds.key, key):
        raise ConfigError("--key", key, f"the key does not belong to {creds.cert.name}")
    return creds


def credentials_beside(key: Path) -> Credentials:
    """The credential whose private key is ``key``, as ``meshlearn keys`` lays out its folder."""
    return Credentials.in_folder(key.parent, key.stem)


def _certificate(path: Path, key: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        raise ConfigError("--key", key, f"{path} is not a certificate written by meshlearn keys") from None


def _public(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _public_of_key(path: Path, key: str) -> bytes:
    try:
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise ConfigError("--key", key, "not a PEM private key written by meshlearn keys") from None
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
