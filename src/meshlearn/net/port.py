"""One inbound TCP port per machine: every connection into the machine arrives there and is handed,
as a socket, to the local process it is for.

How: the machine's agent (``PortAgent``) listens on (address, port). A connection's first
``PREAMBLE_BYTES`` bytes are a fixed-format routing preamble — ``PREAMBLE_MAGIC``, a length
byte, a destination name such as ``r0s1/links``, zero padding — read under a deadline. The agent
then passes the connection's file descriptor to the local process that registered that
destination (an ``Inbox``) over a Unix socket (``socket.send_fds``, SCM_RIGHTS) and closes its own
copy. The destination runs the mutual TLS handshake itself (``tls.py``) before it acts on any
byte. A preamble that is malformed, slow, for no registered destination, or one too many of the
half-open ones (``max_pending``: the oldest is closed) ends the connection, and each is counted
(``counters.py``), so the run can report them in summary.json.

Why hand over the socket rather than end TLS in the agent and route authenticated bytes: Python
cannot move a TLS session to another process, so an agent that ended TLS would have to proxy
every byte of every link — a copy and a context switch per chunk on the run's hottest path, and
one process holding every link's plaintext and the machine's key in use for all of them. Handing
the socket over keeps the data path as direct as a private port's, each process authenticates
its own peers and sees only its own traffic, and the agent's whole exposure to a stranger is one
fixed-size, 64-byte record it compares against a table. What it costs: the destination's name
crosses the network in clear before the handshake (it says which worker a connection is for,
which the placement in the config says anyway), and each destination process authenticates for
itself (``tls.Acceptor``).

Local trust: the Unix socket lives in a folder only this user can enter (mode 0700), and the
agent also checks each registering process's uid (SO_PEERCRED); a destination name is taken by
the first live registration. Linux only (SOCK_SEQPACKET, SO_PEERCRED), like the rest of the
multi-machine runtime.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshlearn.net.counters import Counters

PREAMBLE_BYTES = 64
PREAMBLE_MAGIC = b"MLR1"
DESTINATION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,58}$")  # fits 64 - magic - length byte
PREAMBLE_TIMEOUT_S = 5.0
"""Seconds from accepting a connection to its complete routing preamble. An honest dialer sends
it with its first packet; raise it only for an RTT of seconds (counted as ``preamble_timeout``)."""
MAX_PENDING = 64
"""Connections whose preamble the agent waits for at once; beyond it the oldest is closed
(``half_open_evicted``)."""
ACCEPTED, REFUSED = b"\x01", b"\x00"  # the agent's answer to a registration
_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class PortError(OSError):
    """A destination that could not register, or an agent that could not start."""


def preamble(destination: str) -> bytes:
    """The routing preamble a dialer sends first, for ``destination`` (a registered name)."""
    if not DESTINATION_RE.match(destination):
        raise ValueError(f"destination {destination!r}: 1-59 letters, digits, '.', '_', '/' or '-'")
    name = destination.encode()
    return (PREAMBLE_MAGIC + bytes([len(name)]) + name).ljust(PREAMBLE_BYTES, b"\0")


def parse_preamble(data: bytes) -> str | None:
    """The destination a complete preamble names, or None for bytes that are no preamble."""
    magic = len(PREAMBLE_MAGIC)
    if len(data) != PREAMBLE_BYTES or not data.startswith(PREAMBLE_MAGIC):
        return None
    length = data[magic]
    name, padding = data[magic + 1:magic + 1 + length], data[magic + 1 + length:]
    text = name.decode("ascii", errors="replace")
    if padding.strip(b"\0") or not DESTINATION_RE.match(text):
        return None
    return text


def dial(address: str, port: int, destination: str, timeout_s: float) -> socket.socket:
    """A TCP connection to a machine's port, routed to ``destination`` there (the TLS handshake
    comes next, by the caller)."""
    sock = socket.create_connection((address, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(preamble(destination))
    return sock


@dataclass
class _Pending:
    """A connection whose preamble is still arriving."""

    peer: str
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class PortAgent:
    """The machine's one listening TCP port, and the table of local destinations it routes to.

    >>> agent = PortAgent("10.0.0.1", 29500, Path("run/sockets/agent.sock"))
    >>> agent.start()           # a thread; or agent.serve() as a process's main loop
    >>> ... agent.counters.as_dict() ... agent.close()
    """

    def __init__(self, address: str, port: int, socket_path: Path, counters: Counters | None = None,
                 preamble_timeout_s: float = PREAMBLE_TIMEOUT_S, max_pending: int = MAX_PENDING):
        self.counters = counters if counters is not None else Counters()
        self.routed = 0  # connections handed to a destination
        self.preamble_timeout_s, self.max_pending = preamble_timeout_s, max_pending
        self.socket_path = Path(socket_path)
        _private_folder(self.socket_path.parent)
        with contextlib.suppress(FileNotFoundError):  # a socket left by an agent that died
            self.socket_path.unlink()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._tcp = socket.create_server((address, port), family=family, backlog=max_pending)
        self.address, self.port = self._tcp.getsockname()[:2]
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._unix.bind(str(self.socket_path))
        self._unix.listen()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[socket.socket, _Pending] = {}  # in arrival order
        self._destinations: dict[str, socket.socket] = {}
        self._lock = threading.Lock()  # guards _destinations for ``destinations()`` from other threads
        self._closing = False
        self._select = selectors.DefaultSelector()
        for sock, handler in ((self._tcp, self._accept), (self._unix, self._register),
                              (self._wake_r, None)):
            sock.setblocking(False)
            self._select.register(sock, selectors.EVENT_READ, handler)
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve, name="net-port-agent", daemon=True)
        self._thread.start()
        return self._thread

    def destinations(self) -> list[str]:
        with self._lock:
            return sorted(self._destinations)

    def serve(self) -> None:
        """Route connections until ``close``."""
        try:
            while not self._closing:
                for key, _ in self._select.select(self._next_timeout()):
                    if key.data is None:  # woken by close()
                        continue
                    key.data(key.fileobj)
                self._expire()
        finally:
            self._shut_down()

    def close(self) -> None:
        """Stop serving: every socket closed, the Unix socket's file removed."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not None:
            self._thread.join()

    def _next_timeout(self) -> float | None:
        if not self._pending:
            return None
        first = min(p.deadline for p in self._pending.values())
        return max(0.0, first - time.monotonic())

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(self.max_pending):  # what the backlog holds now, at most a cap's worth per wake
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors, say: the connection is lost, not the agent
                self.counters.add("accept_failed", f"{type(err).__name__}: {err}")
                return
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                self._refuse(oldest, "half_open_evicted", f"from {self._pending[oldest].peer}")
            conn.setblocking(False)
            self._pending[conn] = _Pending(f"{addr[0]}:{addr[1]}", time.monotonic() + self.preamble_timeout_s)
            self._select.register(conn, selectors.EVENT_READ, self._read_preamble)

    def _read_preamble(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:  # evicted by an accept earlier in the same wake-up
            return
        try:
            got = conn.recv(PREAMBLE_BYTES - len(pending.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._refuse(conn, "preamble_closed", f"{pending.peer}: {type(err).__name__}")
            return
        if not got:
            self._refuse(conn, "preamble_closed", f"{pending.peer} closed before its preamble")
            return
        pending.data += got
        head = bytes(pending.data[:len(PREAMBLE_MAGIC)])
        if not PREAMBLE_MAGIC.startswith(head):  # an HTTP request or a TCPStore client fails here
            self._refuse(conn, "preamble_malformed", f"{pending.peer} sent {head!r}")
            return
        if len(pending.data) < PREAMBLE_BYTES:
            return
        destination = parse_preamble(bytes(pending.data))
        if destination is None:
            self._refuse(conn, "preamble_malformed", f"{pending.peer}: not a preamble")
        elif destination not in self._destinations:
            self._refuse(conn, "unknown_destination", f"{pending.peer} asked for {destination!r}")
        else:
            self._hand_over(conn, destination)

    def _hand_over(self, conn: socket.socket, destination: str) -> None:
        peer = self._pending.pop(conn).peer
        self._select.unregister(conn)
        conn.setblocking(True)  # the flag belongs to the connection, which the destination receives
        try:
            socket.send_fds(self._destinations[destination], [peer.encode()], [conn.fileno()])
            self.routed += 1
        except BlockingIOError:
            self.counters.add("destination_busy", f"{destination} takes no more connections now ({peer})")
        except OSError as err:
            self._drop_destination(self._destinations[destination])
            self.counters.add("destination_gone", f"{destination}: {type(err).__name__} ({peer})")
        conn.close()

    def _refuse(self, conn: socket.socket, reason: str, detail: str) -> None:
        self._pending.pop(conn, None)
        self._select.unregister(conn)
        self.counters.add(reason, detail)  # counted before the peer can see the close
        conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, late in [(c, p) for c, p in self._pending.items() if p.deadline <= now]:
            self._refuse(conn, "preamble_timeout",
                         f"{late.peer} sent {len(late.data)} of {PREAMBLE_BYTES} bytes")

    def _register(self, listener: socket.socket) -> None:
        """A local process names the destination it receives for (one SEQPACKET message)."""
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.settimeout(1.0)  # a process of this user that connects sends its name at once
        try:
            _, uid, _ = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            _CREDENTIALS.size))
            name = conn.recv(PREAMBLE_BYTES).decode("ascii", errors="replace") if uid == os.getuid() else ""
        except OSError as err:
            self.counters.add("local_refused", f"no registration ({type(err).__name__})")
            conn.close()
            return
        with self._lock:
            refused = ("another user's process" if uid != os.getuid()
                       else "not a destination name" if not DESTINATION_RE.match(name)
                       else "taken" if name in self._destinations else None)
            if refused is None:
                self._destinations[name] = conn
        if refused is not None:
            self.counters.add("local_refused", f"{name!r}: {refused}")
            with contextlib.suppress(OSError):
                conn.sendall(REFUSED)
            conn.close()
            return
        conn.sendall(ACCEPTED)
        conn.setblocking(False)  # a destination that stops receiving must not stall the agent
        self._select.register(conn, selectors.EVENT_READ, self._drop_destination)

    def _drop_destination(self, conn: socket.socket) -> None:
        """A destination's process ended (its socket became readable: closed), or cannot be reached."""
        with self._lock:
            for name in [n for n, c in self._destinations.items() if c is conn]:
                del self._destinations[name]
        with contextlib.suppress(KeyError, ValueError):
            self._select.unregister(conn)
        conn.close()

    def _shut_down(self) -> None:
        for conn in list(self._pending):
            conn.close()
        self._pending.clear()
        with self._lock:
            for conn in self._destinations.values():
                conn.close()
            self._destinations.clear()
        for sock in (self._tcp, self._unix, self._wake_r, self._wake_w):
            sock.close()
        self._select.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


def _private_folder(folder: Path) -> None:
    """Create ``folder`` for this user only, or check that it is (never loosen or tighten a folder
    someone else made: /tmp is no place for the agent's socket)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PortError(f"{folder}: the port agent's socket needs a folder only this user can enter "
                        f"(mode 0700, owned by uid {os.getuid()}); it has mode {oct(info.st_mode & 0o777)}")


class Inbox:
    """A local process's end of the agent: it registers ``name`` and receives the connections
    dialed to it, each still unauthenticated (run the TLS handshake before reading a byte)."""

    def __init__(self, socket_path: Path, name: str, timeout_s: float = 10.0):
        if not DESTINATION_RE.match(name):
            raise ValueError(f"destination {name!r}: 1-59 letters, digits, '.', '_', '/' or '-'")
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(socket_path))
            self.sock.sendall(name.encode())
            answer = self.sock.recv(1)
        except OSError as err:
            self.sock.close()
            raise PortError(f"destination {name!r}: the port agent at {socket_path} did not answer "
                            f"({type(err).__name__}: {err})") from None
        if answer != ACCEPTED:
            self.sock.close()
            raise PortError(f"destination {name!r}: the port agent refused it (taken by another process)")

    def receive(self, timeout_s: float | None = None) -> tuple[socket.socket, str]:
        """The next connection for this destination and the address it came from; TimeoutError
        after ``timeout_s``, ConnectionError if the agent is gone."""
        self.sock.settimeout(timeout_s)
        message, fds, _, _ = socket.recv_fds(self.sock, PREAMBLE_BYTES, 1)
        if not fds:
            raise ConnectionError(f"destination {self.name!r}: the port agent closed")
        return socket.socket(fileno=fds[0]), message.decode("ascii", errors="replace")

    def serve_into(self, submit: Callable[[socket.socket], None]) -> threading.Thread:
        """Pass every connection received to ``submit`` (a ``tls.Acceptor``'s), in a daemon thread
        that ends when the agent or this inbox closes."""

        def pump() -> None:
            with contextlib.suppress(OSError):  # the agent or this inbox closed
                while True:
                    submit(self.receive()[0])

        thread = threading.Thread(target=pump, name=f"net-inbox-{self.name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the pump blocked receiving
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
