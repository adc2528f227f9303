"""A run's credentials: ``meshlearn keys`` makes a CA and one credential per host of
[cluster.hosts], private keys 0600; ``--add`` admits a joiner once; ``--revoke`` lists every
certificate of a name in the signed CRL; bad input is one line and exit code 2."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from meshlearn.entry.cli import main
from meshlearn.net.keys import KeysError, add_joiner, create_run, identity_of, revoke, revoked_serials

RUN_TOML = """
name = "demo"
[mesh]
stages = 2
replicas = 1
[cluster]
coordinator = "alice"
[cluster.hosts.alice]
address = "10.0.0.1"
port = 29500
workers = ["r0s0"]
[cluster.hosts.bob]
address = "10.0.0.2"
port = 29500
workers = ["r0s1"]
"""


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cli_issues_one_credential_per_host(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.toml"
    config.write_text(RUN_TOML)
    out = tmp_path / "keys"
    assert main(["keys", "--config", str(config), "--out", str(out)]) == 0
    assert "credentials for alice, bob" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "alice.crt", "alice.key", "bob.crt", "bob.key", "ca.crl", "ca.crt", "ca.key", "issued.json"]
    for key in ("alice.key", "bob.key", "ca.key"):
        assert _mode(out / key) == 0o600
    ca = _cert(out / "ca.crt")
    for host in ("alice", "bob"):
        cert = _cert(out / f"{host}.crt")
        cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
        assert identity_of(cert).name == host and identity_of(cert).role == "host"
        assert cert.subject.rfc4514_string().endswith("O=demo")
    assert revoked_serials(out / "ca.crl") == set()


def test_cli_admits_and_revokes_a_joiner(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "keys"
    create_run(out, ["alice"], "demo")
    assert main(["keys", "--add", "carol", "--out", str(out)]) == 0
    carol = _cert(out / "carol.crt")
    assert identity_of(carol).role == "joiner" and _mode(out / "carol.key") == 0o600
    assert main(["keys", "--revoke", "carol", "--out", str(out)]) == 0
    assert revoked_serials(out / "ca.crl") == {carol.serial_number}
    crl = x509.load_pem_x509_crl((out / "ca.crl").read_bytes())
    assert crl.is_signature_valid(_cert(out / "ca.crt").public_key())
    assert "revoked 'carol'" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--add", "carol"], "--add = 'carol': this name is already revoked"),
    (["--add", "alice"], "--add = 'alice': this name is already issued to a host"),
    (["--add", "../etc"], "--add = '../etc': a name of 1-63 letters"),
    (["--add", "ca"], "--add = 'ca': a name of"),
    (["--revoke", "zed"], "--revoke = 'zed': no credential of that name was issued"),
    (["--add", "x", "--revoke", "y"], "exactly one of --config RUN.toml, --add NAME, --revoke NAME"),
])
def test_cli_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                 message: str) -> None:
    out = tmp_path / "keys"
    create_run(out, ["alice"], "demo")
    add_joiner(out, "carol")
    revoke(out, "carol")
    before = sorted(p.name for p in out.iterdir())
    assert main(["keys", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshlearn: error: ") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_folder_keeps_its_ca(tmp_path: Path) -> None:
    """A second create would replace the CA and lock out everyone issued under the first."""
    out = tmp_path / "keys"
    create_run(out, ["alice"], "demo")
    ca = (out / "ca.crt").read_bytes()
    with pytest.raises(KeysError, match="already holds a run's CA"):
        create_run(out, ["alice", "bob"], "demo")
    assert (out / "ca.crt").read_bytes() == ca and not (out / "bob.key").exists()


def test_cli_needs_cluster_hosts_and_a_ca(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.toml"
    config.write_text('name = "demo"\n')
    assert main(["keys", "--config", str(config), "--out", str(tmp_path / "k")]) == 2
    assert "cluster.hosts = {}: " in capsys.readouterr().err
    assert main(["keys", "--add", "carol", "--out", str(tmp_path / "empty")]) == 2
    assert "holds no run CA" in capsys.readouterr().err
    config.write_text(RUN_TOML.replace("hosts.bob", "hosts.'bob smith'"))
    assert main(["keys", "--config", str(config), "--out", str(tmp_path / "k2")]) == 2
    assert "cluster.hosts.bob smith = 'bob smith': host names are letters" in capsys.readouterr().err
