"""One inbound port per machine: the agent reads a fixed 64-byte routing preamble under a deadline
and hands the connection's socket to the local process that registered its destination (a
second process here), which authenticates it. A stranger's random bytes, a TCPStore client, an
HTTP request, an unknown destination and 100 idle connections are each refused and counted, and
an honest link gets through during and after."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from net_helpers import (
    BOUND,
    HEADER_ROOM,
    LINK,
    OWNERS,
    Keys,
    LinkServer,
    closed_by_peer,
    destination_process,
    frame_tensor,
    trickle,
    wait_until,
)

from meshlearn.net.links import dial_link
from meshlearn.net.port import PREAMBLE_BYTES, Inbox, PortAgent, PortError, dial, parse_preamble, preamble

TCPSTORE_HELLO = b"\x00\xce\xf7\x85<"  # what torch's TCPStore client sends first (its VALIDATE query, magic)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    """A short private folder for the agent's Unix socket (AF_UNIX paths stop at 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="ml-port-"))
    yield folder / "agent.sock"
    shutil.rmtree(folder)


def _agent(socket_path: Path, **kwargs) -> PortAgent:
    agent = PortAgent("127.0.0.1", 0, socket_path, **kwargs)
    agent.start()
    return agent


def _link_through(agent: PortAgent, keys: Keys, name: str = "alice", link: tuple[str, str] = LINK):
    sock = dial("127.0.0.1", agent.port, "r0s1/links", timeout_s=10)
    return dial_link(sock, keys.tls(name), link, OWNERS, time.monotonic() + 10, HEADER_ROOM)


def test_a_preamble_is_64_bytes_and_strict() -> None:
    data = preamble("r0s1/links")
    assert len(data) == PREAMBLE_BYTES and parse_preamble(data) == "r0s1/links"
    assert parse_preamble(data[:-1] + b"x") is None  # padding must be zeros
    assert parse_preamble(b"GET " + data[4:]) is None
    assert parse_preamble(data[:4] + bytes([70]) + data[5:]) is None  # a length past the name
    for bad in ("", "/r0s1", "a" * 60, "r0s1 links", "r0s1/../x\0"):
        with pytest.raises(ValueError):
            preamble(bad)


def test_the_agent_hands_over_the_socket_untouched(socket_path: Path) -> None:
    """Routed by name, the bytes after the preamble reach the destination unread by the agent."""
    agent = _agent(socket_path)
    links, health = Inbox(socket_path, "r0s1/links"), Inbox(socket_path, "r0s1/health")
    assert wait_until(lambda: agent.destinations() == ["r0s1/health", "r0s1/links"])
    sock = dial("127.0.0.1", agent.port, "r0s1/links", timeout_s=10)
    sock.sendall(b"the first bytes after the preamble")
    received, peer = links.receive(timeout_s=10)
    assert peer == f"127.0.0.1:{sock.getsockname()[1]}"
    received.settimeout(10)
    assert received.recv(100) == b"the first bytes after the preamble"
    with pytest.raises(TimeoutError):
        health.receive(timeout_s=0.2)
    assert agent.routed == 1 and agent.counters.total() == 0
    for s in (sock, received):
        s.close()
    links.close()
    health.close()
    agent.close()


def test_destinations_are_registered_once_and_leave_with_their_process(socket_path: Path) -> None:
    agent = _agent(socket_path)
    inbox = Inbox(socket_path, "r0s1/links")
    with pytest.raises(PortError, match="refused it"):
        Inbox(socket_path, "r0s1/links")
    inbox.close()
    assert wait_until(lambda: agent.destinations() == [])
    sock = dial("127.0.0.1", agent.port, "r0s1/links", timeout_s=10)
    assert closed_by_peer(sock)
    assert wait_until(lambda: agent.counters.as_dict() == {"local_refused": 1, "unknown_destination": 1})
    sock.close()
    agent.close()
    assert not socket_path.exists()


def test_the_agent_wants_a_private_folder() -> None:
    with pytest.raises(PortError, match="only this user can enter"):
        PortAgent("127.0.0.1", 0, Path(tempfile.gettempdir()) / "agent.sock")


def test_strangers_at_the_port_are_refused_and_counted(keys: Keys, socket_path: Path) -> None:
    agent = _agent(socket_path, preamble_timeout_s=5.0)
    server = LinkServer(keys)
    inbox = Inbox(socket_path, "r0s1/links")
    inbox.serve_into(server.acceptor.submit)
    attempts = {
        "random bytes": random.Random(0).randbytes(4096),
        "a TCPStore client": TCPSTORE_HELLO,
        "an HTTP request": b"POST /replica/r0s0/kill HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        "an unknown destination": preamble("r9s9/links"),
        "a routed stranger": preamble("r0s1/links") + b"\x16\x03\x01" + random.Random(1).randbytes(600),
    }
    for what, data in attempts.items():
        sock = socket.create_connection(("127.0.0.1", agent.port), timeout=10)
        sock.sendall(data)
        assert closed_by_peer(sock), what
        sock.close()
    assert wait_until(lambda: agent.counters.total() == 4 and server.counters.total() == 1)
    assert agent.counters.as_dict() == {"preamble_malformed": 3, "unknown_destination": 1}
    assert server.counters.as_dict() == {"handshake_failed": 1}  # the routed stranger: no TLS
    stream = _link_through(agent, keys)  # the port keeps serving
    assert stream.peer.name == "bob" and agent.routed == 2
    stream.close()
    inbox.close()
    agent.close()


def test_a_trickled_preamble_meets_one_deadline(socket_path: Path) -> None:
    """A byte every 0.1 s: each read comes in time, the 64 bytes do not (6.4 s > 1 s)."""
    agent = _agent(socket_path, preamble_timeout_s=1.0)
    inbox = Inbox(socket_path, "r0s1/links")
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=10)
    assert trickle(sock, preamble("r0s1/links"))
    assert wait_until(lambda: agent.counters.as_dict() == {"preamble_timeout": 1})
    assert agent.routed == 0
    sock.close()
    inbox.close()
    agent.close()


def test_idle_connections_cannot_keep_an_honest_link_out(keys: Keys, socket_path: Path) -> None:
    agent = _agent(socket_path, preamble_timeout_s=3.0, max_pending=32)
    server = LinkServer(keys)
    inbox = Inbox(socket_path, "r0s1/links")
    inbox.serve_into(server.acceptor.submit)
    idle = [socket.create_connection(("127.0.0.1", agent.port), timeout=10) for _ in range(100)]
    idle[-1].sendall(preamble("r0s1/links")[:10])  # a slow one: part of a preamble, then nothing
    assert wait_until(lambda: agent.counters.as_dict().get("half_open_evicted", 0) >= 68)
    during = _link_through(agent, keys)  # evicts the oldest idle connection (if none timed out yet)
    assert all(closed_by_peer(sock) for sock in idle)
    assert wait_until(lambda: agent.counters.total() == 100)
    counts = agent.counters.as_dict()
    assert set(counts) == {"half_open_evicted", "preamble_timeout"} and counts["half_open_evicted"] >= 68
    after = _link_through(agent, keys, "carol", ("r1s0", "r0s1"))
    assert (during.peer.name, after.peer.name) == ("bob", "bob") and agent.routed == 2
    assert server.counters.total() == 0  # nothing idle ever reached the destination
    for sock in idle:
        sock.close()
    inbox.close()
    agent.close()


def test_the_agent_routes_to_another_process(keys: Keys, socket_path: Path) -> None:
    agent = _agent(socket_path)
    decoy = Inbox(socket_path, "r0s0/links")  # this process: must receive nothing
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=destination_process, args=(str(socket_path), str(keys.run), results))
    child.start()
    try:
        kind, child_pid = results.get(timeout=60)
        assert kind == "registered" and child_pid != os.getpid()
        stream = _link_through(agent, keys)
        stream.send(frame_tensor(b'{"step": 7}', b"activations"))
        kind, pid, peer, body, counts = results.get(timeout=30)
        assert (kind, pid, peer) == ("received", child_pid, "alice (host)")
        assert body[16:] == b'{"step": 7}activations' and counts == {}
        assert len(body) <= BOUND
        with pytest.raises(TimeoutError):
            decoy.receive(timeout_s=0.1)
        child.join(timeout=30)
        assert child.exitcode == 0
        stream.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        decoy.close()
        agent.close()
