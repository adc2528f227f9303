"""Shared by the net tests (and importable by their spawned processes): a run's credentials, a
listener that authenticates links, and a polling wait for counters that other threads update."""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlearn.net.counters import Counters
from meshlearn.net.frames import frame
from meshlearn.net.keys import Credentials, add_joiner, create_run, revoke
from meshlearn.net.links import Link, LinkGate
from meshlearn.net.tls import Acceptor, Refused, RunTls

OWNERS = {"r0s0": "alice", "r0s1": "bob", "r1s0": "carol", "r1s1": "dave"}  # dave: revoked joiner
LINK: Link = ("r0s0", "r0s1")  # alice -> bob
HEADER_ROOM = 1024
BOUND = 1 << 16


@dataclass(frozen=True)
class Keys:
    """Two runs' credential folders: ``run`` (hosts alice and bob, joiners carol and the revoked
    dave) and ``other`` (a second run's CA, whose host is also called alice)."""

    run: Path
    other: Path

    def tls(self, name: str, folder: Path | None = None) -> RunTls:
        return RunTls(Credentials.in_folder(folder or self.run, name))


def make_keys(root: Path) -> Keys:
    run, other = root / "run", root / "other"
    create_run(run, ["alice", "bob"], "test-run")
    add_joiner(run, "carol")
    add_joiner(run, "dave")
    revoke(run, "dave")
    create_run(other, ["alice"], "another-run")
    return Keys(run, other)


class LinkServer:
    """``bob``'s listener for links into r0s1 (from r0s0 and r1s0), its counters and its acceptor."""

    def __init__(self, keys: Keys, timeout_s: float = 5.0, max_half_open: int = 8):
        self.counters = Counters()
        self.gate = LinkGate(keys.tls("bob"), {LINK, ("r1s0", "r0s1")}, OWNERS, HEADER_ROOM)
        self.acceptor = Acceptor(self.gate.authenticate, self.counters, timeout_s=timeout_s,
                                 max_half_open=max_half_open)


def handshake_refusal(server: RunTls, client: RunTls) -> Refused | None:
    """Why ``server`` refuses ``client`` in a handshake (None: it admits it), as the server says."""
    a, b = socket.socketpair()
    outcome: queue.Queue = queue.Queue()

    def accept() -> None:
        try:
            outcome.put(server.accept(b, time.monotonic() + 10)[0])
        except Refused as err:
            outcome.put(err)

    thread = threading.Thread(target=accept)
    thread.start()
    with contextlib.suppress(Refused):
        client.connect(a, server.identity.name, time.monotonic() + 10)[0].close()
    thread.join()
    got = outcome.get()
    if isinstance(got, Refused):
        return got
    got.close()
    return None


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until true (another thread updates what it reads); False at the timeout."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def closed_by_peer(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """True once the other end closed ``sock`` (EOF or reset), reading and dropping what it sent."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def frame_tensor(header: bytes, body: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(frame(header, body)), dtype=torch.uint8)


class TcpFront:
    """A plain loopback listener that hands every connection to ``submit`` (what the port agent
    does across processes; these tests need only the authentication behind it)."""

    def __init__(self, submit: Callable[[socket.socket], None]):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.submit = submit
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def dial(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self.submit(self.listener.accept()[0])

    def close(self) -> None:
        self.listener.close()


def stranger_context(trust: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A TLS 1.3 client that trusts ``trust`` (so it gets as far as the server's verdict on it) and
    presents ``cert`` if given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(trust))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def destination_process(socket_path: str, keys_run: str, results) -> None:
    """A second local process: registers ``r0s1/links`` with the port agent as bob, admits the
    authenticated link from r0s0 through it, and reports its pid, its peer and the first frame."""
    from meshlearn.net.port import Inbox

    keys = Keys(Path(keys_run), Path(keys_run))
    server = LinkServer(keys)
    inbox = Inbox(Path(socket_path), "r0s1/links")
    inbox.serve_into(server.acceptor.submit)
    results.put(("registered", os.getpid()))
    assert wait_until(lambda: LINK in server.gate.streams, timeout_s=30)
    stream = server.gate.streams[LINK]
    stream.set_timeout(30)
    body = bytes(stream.read_frame(BOUND).numpy())
    results.put(("received", os.getpid(), str(stream.peer), body, server.counters.as_dict()))
    stream.close()
    inbox.close()


def trickle(sock: socket.socket, data: bytes, every_s: float = 0.1) -> bool:
    """Send ``data`` a byte at a time, ``every_s`` apart (a slow-loris peer); True if the other end
    closed the connection before the last byte, False if it took them all."""
    for i in range(len(data)):
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:  # the other end closed (a byte from it instead would be no refusal)
            try:
                return sock.recv(1) == b""
            except ConnectionResetError:
                return True
        try:
            sock.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def client_hello(trust: Path) -> bytes:
    """A real TLS 1.3 ClientHello, as a stranger's first bytes."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = stranger_context(trust).wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()
