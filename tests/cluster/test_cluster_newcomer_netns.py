"""A newcomer joins an elastic cluster run (issue 27 item 1, issue 26 item 4): a third network
namespace that is in no ``[cluster.hosts]`` placement, with only the joiner credential the owner
issued (``meshlearn keys --add carl``), the coordinator's address and its own one port
(``--address``), takes the slot of a worker killed on bob, heals and trains; a revoked credential
and a missing one are refused in one line, the revoked one on the coordinator's side too.

The two placement machines are ``test_cluster_elastic_netns``'s (alice: r0s0, r1s1; bob: r0s1,
r1s0); the newcomer is ``netns.stranger``'s namespace, which both reach. Root only, slow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from elastic_cluster import PORT, ElasticCluster, assert_identical, shard
from netns import missing, stranger
from test_cluster_elastic_netns import (  # noqa: F401 — the fixtures are used by name
    _kill_r1s0_and_wait_for_the_spectator,
    cluster,
    wan,
)

import meshlearn

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing())), pytest.mark.slow]

SUBNET = "10.232.11"
NEWCOMER = f"{SUBNET}.2"  # its address on the link to alice; bob reaches it by a route through .6


def _owner(run: ElasticCluster, *args: str) -> None:
    """The run owner's ``meshlearn keys`` on the owner's folder."""
    owner = str(run.tmp_path / "owner-keys")
    subprocess.run([sys.executable, "-m", "meshlearn", "keys", *args, "--out", owner],
                   check=True, capture_output=True, timeout=60, env=_env())


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(Path(meshlearn.__file__).parents[1]), "OMP_NUM_THREADS": "1"}


def _credential(run: ElasticCluster, name: str) -> Path:
    """``name``'s copy of its credential, as the owner hands it over (the list of that moment)."""
    folder = run.tmp_path / name / "keys"
    folder.mkdir(parents=True)
    for file in (f"{name}.key", f"{name}.crt", "ca.crt", "ca.crl"):
        shutil.copy(run.tmp_path / "owner-keys" / file, folder / file)
    shutil.copy(run.tmp_path / "alice" / "corpus.txt", run.tmp_path / name / "corpus.txt")
    return folder / f"{name}.key"


def _join(run: ElasticCluster, space: str, name: str, key: Path | None) -> subprocess.Popen:
    argv = ["ip", "netns", "exec", space, sys.executable, "-m", "meshlearn", "train", "--join",
            "--host", name, "--coordinator", run.coordinator, "--address", f"{NEWCOMER}:{PORT}",
            "--out", "runs/x", "--set", "data.corpus=corpus.txt", *(["--key", str(key)] if key else [])]
    with (run.tmp_path / f"join-{name}.log").open("w") as log:
        return subprocess.Popen(argv, env=_env(), cwd=run.tmp_path / name, stdout=log,
                                stderr=subprocess.STDOUT)


@pytest.fixture
def run(cluster: ElasticCluster) -> ElasticCluster:  # noqa: F811 — the imported fixture
    return cluster


def test_a_newcomer_outside_the_placement_joins_with_its_credential_and_heals(run: ElasticCluster) -> None:
    """carl, on a third machine, joins with ``keys --add`` credentials and the coordinator's address
    only: it takes r1s0 after r1s0 was killed on bob, heals from r0s0 and row 1 trains again; at the
    stop its r1s0 equals r0s0 bit for bit. mallory (revoked) and a joiner without a key are refused
    in one line; the coordinator counts mallory's handshake."""
    with stranger(run.wan, SUBNET) as space:
        subprocess.run(["ip", "-n", run.wan.namespaces[1], "route", "add", f"{NEWCOMER}/32", "via",
                        f"{SUBNET}.6"], check=True, timeout=10)
        _owner(run, "--add", "carl")
        _owner(run, "--add", "mallory")
        carl, mallory = _credential(run, "carl"), _credential(run, "mallory")
        _owner(run, "--revoke", "mallory")
        shutil.copy(run.tmp_path / "owner-keys" / "ca.crl", run.keys["alice"].parent / "ca.crl")
        broke = _kill_r1s0_and_wait_for_the_spectator(run)
        for name, key in (("mallory", mallory), ("nobody", None)):
            (run.tmp_path / name).mkdir(exist_ok=True)
            refused = _join(run, space, name, key)
            assert refused.wait(timeout=120) != 0
            said = [line for line in run.output(name).splitlines() if line.strip()]
            assert len(said) == 1 and said[0].startswith("meshlearn: error: --key = "), said
        newcomer = _join(run, space, "carl", carl)
        run.joiners.append(newcomer)
        run.wait(lambda: run.event("r1s0", "joined", 1) and run.event("r1s1", "contributes")
                 and run.event("r1s1", "contributes")["step"] > broke, 240, "row 1 training with carl")
        trains = run.event("r1s1", "contributes")["step"]
        run.wait(lambda: run.last_step() >= trains + 4, 120, "four steps with carl's row")
        assert run.members()["r1s0"]["host"] == "carl"
        codes = run.stop()
    assert codes == {"alice": 0, "bob": 0}
    assert newcomer.returncode == 128 + signal.SIGTERM, run.output("carl")
    assert "took slot r1s0 (generation 1)" in run.output("carl")
    rows = run.steps()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["rows"] == [0, 1] and rows[-1]["committed"]
    step = len(rows)
    assert_identical(shard(run.runs["alice"], step, "r0s0"),
                      shard(run.tmp_path / "carl" / "runs" / "x", step, "r1s0"), "stage 0")
    refused = json.loads((run.runs["alice"] / "summary.json").read_text())["refused"]["by_host"]["alice"]
    assert refused.get("handshake_failed", 0) + refused.get("certificate_refused", 0) >= 1, refused
