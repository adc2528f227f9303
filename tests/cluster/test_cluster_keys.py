"""``meshlearn train --host NAME --key FILE``: a cluster run without its host's valid key refuses
to start, in one line naming --key, before it makes a run folder."""

from __future__ import annotations

import os
import shutil

import pytest
from test_cluster_config import PLACEMENT

from meshlearn.cluster.identity import host_credentials
from meshlearn.config import ConfigError
from meshlearn.entry.cli import main
from meshlearn.net.keys import create_run, revoke


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "run"
    create_run(folder, ["alice", "bob", "carol"], "test-run")
    revoke(folder, "carol")
    other = folder.parent / "other"
    create_run(other, ["alice"], "another-run")
    return folder, other


def _train(tmp_path, corpus, *key: str) -> list[str]:
    config = tmp_path / "run.toml"
    config.write_text(PLACEMENT)
    return ["train", "--backend", "dist", "--config", str(config), "--host", "alice", "--out",
            str(tmp_path / "out"), "--set", f"data.corpus={corpus}", *key]


@pytest.mark.parametrize("case, expected", [
    ("missing", "--key = None: a [cluster] run needs this host's private key: --key DIR/alice.key"),
    ("bob", "its certificate is for bob (host), not host 'alice'"),
    ("loose", "a private key must be readable by its owner only (mode 0o644)"),
    ("no-crt", "alice.crt is missing"),
    ("other-ca", "alice.crt was not issued by"),
    ("other-crl", "the revocation list beside it cannot be used ("),
])
def test_a_cluster_run_without_its_hosts_valid_key_stops_in_one_line(keys, tmp_path, tiny_corpus, capsys,
                                                                     case, expected):
    run, other = keys
    folder = tmp_path / "keys"
    shutil.copytree(run, folder)
    named = {"missing": None, "bob": "bob.key"}.get(case, "alice.key")
    key = ["--key", str(folder / named)] if named else []
    if case == "loose":
        os.chmod(folder / "alice.key", 0o644)
    elif case == "no-crt":
        (folder / "alice.crt").unlink()
    elif case == "other-ca":
        shutil.copy(other / "ca.crt", folder / "ca.crt")
    elif case == "other-crl":  # a list the run's CA did not sign
        shutil.copy(other / "ca.crl", folder / "ca.crl")
    assert main(_train(tmp_path, tiny_corpus, *key)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlearn: error: --key") and expected in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_revoked_or_foreign_key_is_refused(keys, tmp_path):
    run, _ = keys
    with pytest.raises(ConfigError, match="host carol's certificate is revoked"):
        host_credentials("carol", str(run / "carol.key"))
    shutil.copytree(run, tmp_path / "k")
    shutil.copy(tmp_path / "k" / "bob.key", tmp_path / "k" / "alice.key")  # alice's certificate, bob's key
    with pytest.raises(ConfigError, match="the key does not belong to alice.crt"):
        host_credentials("alice", str(tmp_path / "k" / "alice.key"))
    assert host_credentials("alice", str(run / "alice.key")).cert == run / "alice.crt"


def test_key_without_host_is_refused(tmp_path, tiny_corpus, capsys):
    assert main(["train", "--backend", "dist", "--set", f"data.corpus={tiny_corpus}", "--key", "x.key",
                 "--out", str(tmp_path / "out")]) == 2
    assert "--key = 'x.key': only with --host" in capsys.readouterr().err
