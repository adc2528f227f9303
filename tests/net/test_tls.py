"""Mutual TLS 1.3 under the run's CA: both ends learn who the other is; a client with no
certificate, another run's certificate or a revoked one is refused in the handshake and counted;
a dialer refuses a server that is not who it expected; idle connections time out or are evicted
from the half-open slots, and an honest client still gets through."""

from __future__ import annotations

import queue
import socket
import ssl
import threading
import time

import pytest
from net_helpers import Keys, TcpFront, client_hello, closed_by_peer, stranger_context, trickle, wait_until

from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials, Identity, KeysError, add_joiner, create_run, revoke
from meshlearn.net.tls import Acceptor, Refused, RunTls


def test_both_ends_learn_who_the_other_is(keys: Keys) -> None:
    alice, bob = keys.tls("alice"), keys.tls("bob")
    a, b = socket.socketpair()
    server: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: server.put(bob.accept(b, time.monotonic() + 10)))
    thread.start()
    client_sock, server_identity = alice.connect(a, expect="bob", deadline=time.monotonic() + 10)
    thread.join()
    server_sock, client_identity = server.get()
    assert server_identity == Identity("bob", "host") and client_identity == Identity("alice", "host")
    assert client_sock.version() == "TLSv1.3"
    client_sock.sendall(b"ping")
    assert server_sock.recv(4) == b"ping"
    client_sock.close()
    server_sock.close()


class Server:
    """``bob`` accepting handshakes through an Acceptor; who got in, and what was counted."""

    def __init__(self, keys: Keys, timeout_s: float = 5.0, max_half_open: int = 8):
        self.counters = Counters()
        self.admitted: queue.Queue = queue.Queue()
        tls = keys.tls("bob")
        self.acceptor = Acceptor(tls.accept, self.counters, self.admitted.put, timeout_s, max_half_open)
        self.front = TcpFront(self.acceptor.submit)

    def honest_client_gets_through(self, keys: Keys) -> bool:
        sock, peer = keys.tls("alice").connect(self.front.dial(), "bob", time.monotonic() + 10)
        tls_sock, who = self.admitted.get(timeout=10)
        ok = peer.name == "bob" and who == Identity("alice", "host")
        sock.close()
        tls_sock.close()
        return ok


def _attempt(ctx: ssl.SSLContext, sock: socket.socket) -> None:
    """A stranger's handshake, then a read: in TLS 1.3 the server's verdict on the client's
    certificate arrives after the client's own handshake has ended."""
    with ctx.wrap_socket(sock) as tls:
        tls.recv(1)


@pytest.mark.parametrize("who, reason, detail", [
    ("no certificate", "handshake_failed", "peer did not return a certificate"),
    ("another run's certificate", "certificate_refused", "unable to get local issuer certificate"),
    ("a revoked joiner", "certificate_refused", "certificate revoked"),
])
def test_strangers_are_refused_and_counted(keys: Keys, who: str, reason: str, detail: str) -> None:
    server = Server(keys)
    trust = keys.run / "ca.crt"
    presents = {"no certificate": (None, None),
                "another run's certificate": (keys.other / "alice.crt", keys.other / "alice.key"),
                "a revoked joiner": (keys.run / "dave.crt", keys.run / "dave.key")}[who]
    ctx = stranger_context(trust, *presents)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _attempt(ctx, server.front.dial())
    assert wait_until(lambda: server.counters.total() == 1)
    assert server.counters.as_dict() == {reason: 1}
    assert detail in server.counters.recent()[0]
    assert server.admitted.empty()
    assert server.honest_client_gets_through(keys)  # the listener keeps serving
    server.front.close()


def test_revoked_credentials_fail_on_both_sides(keys: Keys) -> None:
    """dave's own RunTls (its CRL lists dave, but it only checks peers): the server refuses it, and
    dave learns why, in one line."""
    server = Server(keys)
    with pytest.raises(Refused, match="^refused_by_peer: bob refused us: sslv3 alert certificate revoked$"):
        keys.tls("dave").connect(server.front.dial(), "bob", time.monotonic() + 10)
    assert wait_until(lambda: server.counters.as_dict() == {"certificate_refused": 1})
    server.front.close()


def test_a_dialer_refuses_someone_else(keys: Keys) -> None:
    """bob answers where alice was expected: a valid certificate, but not the peer wanted."""
    server = Server(keys)
    with pytest.raises(Refused, match="identity_refused: the peer is bob \\(host\\), not alice") as err:
        keys.tls("carol").connect(server.front.dial(), "alice", time.monotonic() + 10)
    assert err.value.reason == "identity_refused"
    server.front.close()


def test_a_client_of_another_run_refuses_our_server(keys: Keys) -> None:
    """The other run's alice trusts only its own CA: bob's certificate fails on her side."""
    server = Server(keys)
    other_alice = keys.tls("alice", keys.other)
    with pytest.raises(Refused, match="certificate_refused"):
        other_alice.connect(server.front.dial(), "bob", time.monotonic() + 10)
    assert wait_until(lambda: server.counters.as_dict() == {"handshake_failed": 1})
    server.front.close()


def test_idle_connections_time_out_and_excess_ones_are_evicted(keys: Keys) -> None:
    server = Server(keys, timeout_s=4.0, max_half_open=4)
    idle = [server.front.dial() for _ in range(6)]
    assert wait_until(lambda: server.counters.as_dict().get("half_open_evicted", 0) >= 2)
    assert server.honest_client_gets_through(keys)  # evicts one more idle connection, unless it timed out
    assert all(closed_by_peer(sock) for sock in idle)
    assert wait_until(lambda: server.counters.total() == 6)
    counts = server.counters.as_dict()
    assert set(counts) == {"half_open_evicted", "handshake_timeout"} and counts["half_open_evicted"] >= 2
    assert server.acceptor.half_open() == 0
    for sock in idle:
        sock.close()
    server.front.close()


def test_credentials_name_their_files(keys: Keys) -> None:
    creds = Credentials.in_folder(keys.run, "carol")
    assert (creds.key.name, creds.cert.name, creds.ca.name, creds.crl.name) == (
        "carol.key", "carol.crt", "ca.crt", "ca.crl")
    assert keys.tls("carol").identity == Identity("carol", "joiner")


def test_a_key_file_other_users_can_read_is_refused_in_one_line(tmp_path) -> None:
    create_run(tmp_path, ["alice"], "test-run")
    key = tmp_path / "alice.key"
    assert key.stat().st_mode & 0o777 == 0o600
    RunTls(Credentials.in_folder(tmp_path, "alice"))  # as written: accepted
    key.chmod(0o640)
    with pytest.raises(KeysError, match=r"--key = .*alice.key.*mode 0o640.*chmod 600"):
        RunTls(Credentials.in_folder(tmp_path, "alice"))


def test_a_revocation_takes_effect_at_the_next_handshake_after_reload(tmp_path) -> None:
    """The owner revokes carol while bob runs: bob's contexts read the new ca.crl on reload."""
    folder = tmp_path / "keys"
    create_run(folder, ["bob"], "demo")
    add_joiner(folder, "carol")
    bob = RunTls(Credentials.in_folder(folder, "bob"))
    carol = RunTls(Credentials.in_folder(folder, "carol"))

    def attempt() -> Identity:
        a, b = socket.socketpair()
        server: queue.Queue = queue.Queue()
        thread = threading.Thread(target=lambda: server.put(_outcome(bob.accept, b)))
        thread.start()
        client = _outcome(lambda s, d: carol.connect(s, "bob", d), a)
        thread.join()
        outcome = server.get()
        for end in (client, outcome):
            if isinstance(end, tuple):
                end[0].close()
        if isinstance(outcome, Refused):
            raise outcome
        return outcome[1]

    assert attempt() == Identity("carol", "joiner")
    revoke(folder, "carol")
    assert attempt() == Identity("carol", "joiner")  # bob has not read the new list yet
    bob.reload()
    with pytest.raises(Refused, match="certificate_refused: certificate revoked"):
        attempt()


def _outcome(handshake, sock: socket.socket):
    try:
        return handshake(sock, time.monotonic() + 10)
    except Refused as err:
        return err


def test_a_trickled_handshake_meets_one_deadline(keys: Keys) -> None:
    """A peer sending its ClientHello a byte every 0.1 s: each read would come in time, the whole
    does not (the hello is hundreds of bytes), and the deadline is the whole's."""
    server = Server(keys, timeout_s=1.0)
    hello = client_hello(keys.run / "ca.crt")
    assert len(hello) > 100
    sock = server.front.dial()
    assert trickle(sock, hello)
    assert wait_until(lambda: server.counters.as_dict() == {"handshake_timeout": 1})
    sock.close()
    assert server.honest_client_gets_through(keys)
    server.front.close()
