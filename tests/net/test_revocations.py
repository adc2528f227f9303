"""A listener's revocation list (``net/crl.py``, ``RunTls.reload``, ``net/revocations.py``): an older
list, validly signed in its day, never replaces a newer one (it would un-revoke whoever was revoked
since); every reload checks the bytes it loads (signature, size); and the watch thread survives a
look that fails, keeping the last good list and trying again."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest
from net_helpers import handshake_refusal, wait_until

from meshlearn.net.crl import MAX_LIST_BYTES, ListRefused, read_list
from meshlearn.net.keys import Credentials, add_joiner, create_run, revoke
from meshlearn.net.revocations import RevocationWatch
from meshlearn.net.tls import RunTls


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run with host bob and joiners carol and dave, nobody revoked yet."""
    folder = tmp_path / "run"
    create_run(folder, ["bob"], "revocations-test")
    add_joiner(folder, "carol")
    add_joiner(folder, "dave")
    create_run(tmp_path / "other", ["bob"], "another-run")
    return folder


def _tls(folder: Path, name: str) -> RunTls:
    return RunTls(Credentials.in_folder(folder, name))


def _admitted(server: RunTls, client: RunTls) -> bool:
    return handshake_refusal(server, client) is None


def test_lists_are_numbered_and_an_older_one_is_refused(run: Path, tmp_path: Path) -> None:
    """carol is revoked, then dave (within the same second, most likely: the number orders them);
    someone copies carol's list back over the newer one. It is signed by the run's CA, but older:
    refused, and dave stays revoked."""
    bob = _tls(run, "bob")
    assert read_list(run / "ca.crl", run / "ca.crt").number == 1
    revoke(run, "carol")
    shutil.copy(run / "ca.crl", tmp_path / "carol-only.crl")
    revoke(run, "dave")
    assert read_list(run / "ca.crl", run / "ca.crt").number == 3
    lines: list[str] = []
    watch = RevocationWatch(bob, lambda serials: None, lines.append, every_s=3600.0)
    assert watch.check() and not _admitted(bob, _tls(run, "dave"))
    shutil.copy(tmp_path / "carol-only.crl", run / "ca.crl")
    assert not watch.check() and "its number 2 is below the list in force's (3)" in lines[-1], lines
    assert not _admitted(bob, _tls(run, "dave")) and not _admitted(bob, _tls(run, "carol"))
    with pytest.raises(ListRefused, match="below the list in force"):
        bob.reload()  # by hand, the same
    assert bob.revocations.number == 3


def test_a_reload_checks_the_bytes_it_loads(run: Path, tmp_path: Path) -> None:
    """Another CA's list, or a file far beyond any list, is refused by every reload (by hand or by
    the watch), and the list in force stays: honest peers still get in."""
    bob, carol = _tls(run, "bob"), _tls(run, "carol")
    lines: list[str] = []
    watch = RevocationWatch(bob, lambda serials: None, lines.append, every_s=3600.0)
    shutil.copy(tmp_path / "other" / "ca.crl", run / "ca.crl")
    with pytest.raises(ListRefused, match="not signed by the run's CA"):
        bob.reload()
    assert _admitted(bob, carol)
    (run / "ca.crl").write_bytes(b"-----BEGIN X509 CRL-----\n" + b"A" * (4 * MAX_LIST_BYTES))
    assert not watch.check() and f"larger than {MAX_LIST_BYTES} bytes" in lines[-1], lines
    assert _admitted(bob, carol)


def test_the_watch_survives_a_failed_look_and_applies_the_list_next_time(run: Path, monkeypatch) -> None:
    """The first look after carol's revocation fails twice: OpenSSL refuses the contexts, then
    closing carol's connections fails. Each is counted and logged, the last good list stays in
    force until the list applies, and the thread goes on to apply it."""
    bob = _tls(run, "bob")
    build, faults = bob._build, [ssl.SSLError("simulated"), OSError("simulated")]

    def flaky_build(revocations) -> None:
        if len(faults) == 2:
            raise faults.pop(0)
        build(revocations)

    cut: list[set[int]] = []

    def flaky_cut_off(serials: set[int]) -> None:
        if faults:
            raise faults.pop(0)
        cut.append(serials)

    monkeypatch.setattr(bob, "_build", flaky_build)
    lines: list[str] = []
    watch = RevocationWatch(bob, flaky_cut_off, lines.append, every_s=0.01)
    revoke(run, "carol")
    watch.start()
    try:
        assert wait_until(lambda: bool(cut)), lines
    finally:
        watch.close()
    assert watch.failures == 2 and "SSLError" in lines[0] and "OSError" in "\n".join(lines), lines
    assert cut == [set(read_list(run / "ca.crl", run / "ca.crt").serials)]
    assert not _admitted(bob, _tls(run, "carol"))
