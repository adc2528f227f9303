"""Revocation reaches every machine of a cluster run (issue 27): the coordinator publishes the list
in force on its control service, and a host that is not the coordinator applies it — to its own
contexts, and over the ``ca.crl`` beside its key, which its workers and a resume read. Only the
coordinator's host may publish; a list the other host's checks refuse (another CA's, an older one,
an oversized one) is refused in one line, counted under the coordinator, and the last good stays.

Loopback, one real port agent for the coordinator; bob keeps his credentials in a folder of his own
(as a machine of his would), so what he learns can only come through the control service. The
watches are driven by hand (``look``/``check``), never by their timers."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from net.net_helpers import handshake_refusal

from meshlearn.cluster.authority import REVOCATIONS, Authority
from meshlearn.cluster.control import ControlService
from meshlearn.cluster.control_store import ControlLine, ControlStore, follow_revocations
from meshlearn.cluster.control_wire import ControlRefused
from meshlearn.net.counters import Counters
from meshlearn.net.crl import MAX_LIST_BYTES
from meshlearn.net.keys import Credentials, create_run, revoke
from meshlearn.net.port import PortAgent
from meshlearn.net.revocations import RevocationWatch
from meshlearn.net.tls import RunTls

HOSTS_OF = {"r0s0": "alice", "r0s1": "bob", "r1s0": "carol"}
RANKS = {"r0s0": 0, "r0s1": 1, "r1s0": 2}
FAR = 3600.0  # the watches' timers never fire in a test: each look is driven by hand


@dataclass
class Cluster:
    """The owner's folder (alice, the coordinator, keeps hers there), bob's own folder, the
    coordinator's port, service and watch, bob's launcher's contexts, watch, counters and log."""

    run: Path
    bob_folder: Path
    port: int
    service: ControlService
    coordinator: RevocationWatch
    bob: RunTls
    watch: RevocationWatch
    counters: Counters
    lines: list[str]

    def tls(self, name: str) -> RunTls:
        return RunTls(Credentials.in_folder(self.run, name))


@contextlib.contextmanager
def _cluster(tmp_path: Path) -> Iterator[Cluster]:
    run, bob_folder = tmp_path / "run", tmp_path / "bob"
    create_run(run, ["alice", "bob", "carol"], "feed-test")
    bob_folder.mkdir()
    for name in ("bob.key", "bob.crt", "ca.crt", "ca.crl"):
        shutil.copy2(run / name, bob_folder / name)  # with its mode: the key stays 0600
    socket_folder = Path(tempfile.mkdtemp(prefix="ml-feed-"))
    agent = PortAgent("127.0.0.1", 0, socket_folder / "agent.sock", Counters())
    agent.start()
    alice = RunTls(Credentials.in_folder(run, "alice"))
    service = ControlService(alice, Authority(HOSTS_OF, RANKS, "alice"), Counters(), handshake_timeout_s=3.0)
    service.serve(agent.socket_path)
    bob = RunTls(Credentials.in_folder(bob_folder, "bob"))
    counters, lines = Counters(), []
    line = ControlLine(bob, "127.0.0.1", agent.port, "alice", connect_timeout_s=1.0)  # a lost one: 1 s
    watch = follow_revocations(line, counters, lines.append, every_s=FAR)
    cluster = Cluster(run, bob_folder, agent.port, service, service.watch_revocations(every_s=FAR), bob,
                      watch, counters, lines)
    try:
        yield cluster
    finally:
        service.close()
        agent.close()
        shutil.rmtree(socket_folder)


def _revoke_carol(cluster: Cluster) -> None:
    """The owner revokes carol and replaces the coordinator's list (alice's folder is the run's)."""
    revoke(cluster.run, "carol")
    assert cluster.coordinator.check()


def test_a_host_revoked_at_the_coordinator_is_refused_by_another_host(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        carol = cluster.tls("carol")
        assert not cluster.watch.look() and handshake_refusal(cluster.bob, carol) is None
        revoke(cluster.run, "carol")  # in the owner's folder, not yet applied by the coordinator
        assert not cluster.watch.look() and handshake_refusal(cluster.bob, carol) is None
        assert cluster.coordinator.check()  # applied and published by the coordinator
        assert cluster.watch.look(), cluster.lines
        assert "applied the new revocation list published by the coordinator alice" in cluster.lines[-1]
        refused = handshake_refusal(cluster.bob, carol)
        assert refused is not None and refused.reason == "certificate_refused", refused
        assert "certificate revoked" in refused.detail
        assert handshake_refusal(cluster.bob, cluster.tls("alice")) is None  # the others still get in
        assert cluster.watch.failures == 0 and cluster.watch.refused == 0


def test_the_list_kept_beside_the_key_is_what_the_host_starts_with(tmp_path: Path) -> None:
    """What bob's workers (which build their contexts when they start) and a resume on bob's
    machine read: the published list, written atomically over bob's ca.crl."""
    with _cluster(tmp_path) as cluster:
        _revoke_carol(cluster)
        assert cluster.watch.look()
        assert (cluster.bob_folder / "ca.crl").read_bytes() == (cluster.run / "ca.crl").read_bytes()
        assert (cluster.bob_folder / "ca.crl").stat().st_mode & 0o777 == 0o644
        restarted = RunTls(Credentials.in_folder(cluster.bob_folder, "bob"))
        assert restarted.revocations.number == 2
        refused = handshake_refusal(restarted, cluster.tls("carol"))
        assert refused is not None and refused.reason == "certificate_refused", refused
        assert not cluster.watch.look()  # nothing new: the file it wrote is not a change to apply


def test_only_the_coordinator_publishes_the_list(tmp_path: Path) -> None:
    """bob (or carol, about to be revoked) writing the published list is refused by the owner
    rules, counted under the writer, and what the other hosts read stays the coordinator's."""
    with _cluster(tmp_path) as cluster:
        published = cluster.service.state.wait([REVOCATIONS], 0)
        line = cluster.watch.sources[1]  # bob's view of the published list
        for writer in ("bob", "carol"):
            store = ControlStore(ControlLine(cluster.tls(writer), "127.0.0.1", cluster.port, "alice"), 5.0)
            with pytest.raises(ControlRefused, match=f"authority: host {writer} may not set"):
                store.set(REVOCATIONS, (tmp_path / "run" / "ca.crl").read_bytes() + b"\n")
        assert cluster.service.counters.by_sender() == {"bob": 1, "carol": 1}
        assert cluster.service.state.wait([REVOCATIONS], 0) == published
        assert line.read() == published[0]


@pytest.mark.parametrize(("forged", "why", "blamed"), [
    # a coordinator may lag behind; made in an earlier second, the older list is refused for its date
    ("older", r"(its number 1 is below the list in force's \(2\)|it was made at .+, before the list in "
              r"force \(.+\))", {}),
    ("another CA's", "not signed by the run's CA", {"alice": 1}),
    ("oversized", f"larger than {MAX_LIST_BYTES} bytes", {"alice": 1}),
])
def test_a_published_list_that_fails_the_checks_is_refused(tmp_path: Path, forged: str, why: str,
                                                           blamed: dict) -> None:
    """The coordinator's service publishes a list bob's checks refuse (a coordinator that lies, or
    one behind bob's own list): refused in one line and counted (under the coordinator when the CA
    did not sign it), carol stays revoked on bob's machine and bob's ca.crl keeps the good list."""
    create_run(tmp_path / "other", ["alice"], "another-run")
    with _cluster(tmp_path) as cluster:
        bad = {"older": (cluster.run / "ca.crl").read_bytes(),
               "another CA's": (tmp_path / "other" / "ca.crl").read_bytes(),
               "oversized": b"-----BEGIN X509 CRL-----\n" + b"A" * MAX_LIST_BYTES}[forged]
        _revoke_carol(cluster)
        assert cluster.watch.look()
        good = (cluster.bob_folder / "ca.crl").read_bytes()
        cluster.service.state.set(REVOCATIONS, bad)  # what the service now answers
        assert not cluster.watch.look()
        said = "meshlearn: refused the new revocation list published by the coordinator alice: "
        assert re.fullmatch(f"{said}{why}; the previous one stays in force", cluster.lines[-1]), cluster.lines
        assert cluster.watch.refused == 1 and cluster.counters.by_sender() == blamed
        assert cluster.counters.as_dict() == {"list_refused": 1}
        assert not cluster.watch.look() and cluster.watch.refused == 1  # said once, not at every look
        assert handshake_refusal(cluster.bob, cluster.tls("carol")) is not None
        assert (cluster.bob_folder / "ca.crl").read_bytes() == good



def test_a_coordinator_out_of_reach_does_not_keep_the_file_from_being_looked_at(tmp_path: Path) -> None:
    """The coordinator's service goes away: each look counts the failure and says so, and a list
    the owner copies to bob's machine directly still applies."""
    with _cluster(tmp_path) as cluster:
        assert not cluster.watch.look()
        cluster.service.close()
        revoke(cluster.run, "carol")
        shutil.copy(cluster.run / "ca.crl", cluster.bob_folder / "ca.crl")
        assert cluster.watch.look() and cluster.watch.failures == 1, cluster.lines
        assert f"applied the new revocation list {cluster.bob_folder / 'ca.crl'}" in cluster.lines[0]
        assert "could not look at the revocation list published by the coordinator alice" in cluster.lines[1]
        assert handshake_refusal(cluster.bob, cluster.tls("carol")) is not None
