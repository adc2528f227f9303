"""Pipeline links over framed TCP streams of our own (``dist.links = "tcp"``).

Why: under gloo, a peer that sends more bytes than the receive it meets kills the receiving
process (``gloo::EnforceNotMet``, SIGABRT in gloo's own thread, which nothing can catch), so one
lying worker could end a verified run with one oversized buffer. On a stream the receiver decides
how much it reads: it reads a frame's 16-byte prefix (``wire.py``: header length, body length),
and allocates only if the header fits ``HEADER_ROOM`` and the whole frame the link's bound
(``wire.message_bound``); a frame beyond that is read and thrown away, so the stream stays in step
and the link up, and the transport refuses it as ``Forged`` (``net/frames.py``, shared with the
authenticated streams of ``net/links.py``).

Connections (``connect_streams``): every process that receives on a link listens on one port,
bound to its host's address in a cluster placement, else to the address this host uses to reach
the rendezvous store (``listen_address``; on one machine that is the store's own, 127.0.0.1 under
the launcher) — never every interface — and
publishes it on the store (``links/<rank>``). A sender connects and says which logical link the
connection carries (a hello: ``HELLO_MAGIC``, a 2-byte length, ``"r0s0->r0s1"``); the listener
accepts each link it expects once, acknowledges it with one byte, and closes any other
connection (an unknown link, or a link already taken) unanswered. It stops listening once every
expected link is in. The hello is the only identity: a process that can reach the port and
speaks first could take a link in its peer's place (nothing is authenticated; see
docs/distributed.md) — the real peer is then refused and its failure stops the run at start-up.
Hellos are read one connection at a time, each within the set-up deadline.

Who connects (``StreamConnector``): ``build_groups`` asks a connector for every set of streams
(``links``, ``collectives``), so the runtime never knows how they are made. ``PlainConnector`` is
the above; a cluster run with credentials gets ``cluster/links.py``'s, which dials through each
host's one port and authenticates both ends with the run's certificates, given by the entry point.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from meshlearn.distributed.wire import HEADER_ROOM
from meshlearn.mesh.topology import WorkerId
from meshlearn.net.counters import Counters
from meshlearn.net.frames import FramedStream, recv_exact
from meshlearn.net.frames import FrameRefused as FrameRefused  # the transport's name for it

Link = tuple[WorkerId, WorkerId]
Hop = tuple[Link, int, int]  # a logical link, the rank that sends on this connection, the one that receives

HELLO_MAGIC = b"MLNK"
HELLO_MAX = 256  # bytes a link's name may take in a hello
ACK = b"\x01"


def link_name(link: Link) -> str:
    return f"{link[0]}->{link[1]}"


class Stream(FramedStream):
    """One connected socket carrying one logical link in one direction: the sender writes whole
    frames, the receiver reads them one by one against its bound (``net/frames.py``)."""

    def __init__(self, sock: socket.socket, link: Link):
        super().__init__(sock, link_name(link), HEADER_ROOM)
        self.link = link


BIND_ADDRESS_ENV = "MESHLEARN_BIND_ADDRESS"  # set by a cluster host's launcher: its placement's address


def listen_address(store_host: str, store_port: int) -> str:
    """Where this process's link listeners bind: its host's address in a cluster placement, else
    the interface toward the rendezvous store."""
    return os.environ.get(BIND_ADDRESS_ENV) or local_address(store_host, store_port)


def local_address(store_host: str, store_port: int) -> str:
    """The address of this host's interface toward the rendezvous store: the one its peers reach
    it on (a UDP ``connect`` only picks the route; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((store_host, store_port))
        return probe.getsockname()[0]


def hello(link: Link) -> bytes:
    name = link_name(link).encode()
    return HELLO_MAGIC + struct.pack("!H", len(name)) + name


class Listener:
    """This process's port for the links it receives on: accepts each expected link once."""

    def __init__(self, address: str, expected: set[Link]):
        self.expected = {link_name(link): link for link in expected}
        self.streams: dict[Link, Stream] = {}
        self.refused: list[str] = []  # why each other connection was closed (for the tests' eyes)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((address, 0))
        self.sock.listen(len(expected) + 8)
        host, port = self.sock.getsockname()[:2]  # what the socket is bound to, not what was asked
        self.address = f"{host}:{port}"

    def accept_all(self, deadline: float) -> None:
        """Until every expected link is connected (or ``deadline``, a monotonic time: TimeoutError)."""
        try:
            while len(self.streams) < len(self.expected):
                try:
                    self.sock.settimeout(_left(deadline))
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    missing = sorted(set(self.expected) - {link_name(k) for k in self.streams})
                    raise TimeoutError(f"links {missing} never connected") from None
                self._admit(conn, deadline)
        finally:
            self.sock.close()

    def _admit(self, conn: socket.socket, deadline: float) -> None:
        """Read the hello; keep the connection for its link, or close it unanswered."""
        try:
            conn.settimeout(_left(deadline))
            name = _read_hello(conn)
            why = ("no valid hello" if name is None
                   else f"a hello for {name!r}, not a link this process receives" if name not in self.expected
                   else f"a second hello for {name!r}" if self.expected[name] in self.streams
                   else None)
            if why is None:
                conn.sendall(ACK)
        except OSError as err:
            why = f"no hello ({type(err).__name__}: {err})"
        if why is not None:
            self.refused.append(why)
            conn.close()
            return
        link = self.expected[name]
        self.streams[link] = Stream(conn, link)


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` as a socket timeout; TimeoutError once it has passed (a timeout of
    0 would make the socket non-blocking: BlockingIOError, naming nothing)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the set-up deadline (dist.init_timeout_s) has passed")
    return left


def _read_hello(conn: socket.socket) -> str | None:
    """The link a hello names, or None for bytes that are no hello."""
    head = recv_exact(conn, len(HELLO_MAGIC) + 2, "closed before its hello")
    length = struct.unpack("!H", head[len(HELLO_MAGIC):])[0]
    if not head.startswith(HELLO_MAGIC) or length > HELLO_MAX:
        return None
    return recv_exact(conn, length, "closed before its hello").decode(errors="replace")


def dial(address: str, link: Link, deadline: float) -> Stream:
    """Connect to a listener at ``address`` ("host:port") for ``link``; returns once it accepted."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=_left(deadline))
    sock.sendall(hello(link))
    if sock.recv(1) != ACK:
        sock.close()
        raise ConnectionError(f"{address} refused the link {link_name(link)}")
    return Stream(sock, link)


def connect_streams(store, rank: int, address: str, hops: list[Hop], timeout_s: float,
                    channel: str = "links") -> dict[int, Stream]:
    """This process's end of each of ``hops`` it is on, by the hop's index: listen for those it
    receives (published on ``store`` as ``<channel>/<rank>``), dial those it sends. ``address``: the
    one to bind (``listen_address``); ``timeout_s``: the whole set-up's deadline (dist.init_timeout_s);
    ``channel``: which set of streams (``links``: the pipeline's; ``collectives``: the framed
    collectives', whose hops name the same worker pairs). Every process listens before it dials,
    so no two wait on each other."""
    deadline = time.monotonic() + timeout_s
    receiving = {i: link for i, (link, _, b) in enumerate(hops) if b == rank}
    listener = Listener(address, set(receiving.values())) if receiving else None
    failure: list[BaseException] = []
    if listener is not None:
        store.set(f"{channel}/{rank}", listener.address)

        def accept() -> None:
            try:
                listener.accept_all(deadline)
            except BaseException as err:  # noqa: BLE001 — raised below, in the caller's thread
                failure.append(err)

        thread = threading.Thread(target=accept, name="tcp-links-accept", daemon=True)
        thread.start()
    streams = {i: dial(store.get(f"{channel}/{b}").decode(), link, deadline)
               for i, (link, a, b) in enumerate(hops) if a == rank}
    if listener is not None:
        thread.join(max(0.0, deadline - time.monotonic()))
        if failure or thread.is_alive():
            raise TimeoutError(f"rank {rank}: {failure[0] if failure else 'links never connected'}")
        streams |= {i: listener.streams[link] for i, link in receiving.items()}
    return streams


class StreamConnector(Protocol):
    """Makes a process's streams, per channel: by each hop's index, this process's end of each hop
    it is on. Every process of the run calls it once, with the same channels and hops.
    ``counters``: where this process counts what it refuses on those streams (the run's record)."""

    counters: Counters

    def connect(self, rank: int, channels: Mapping[str, list[Hop]],
                timeout_s: float) -> dict[str, dict[int, FramedStream]]: ...


class PlainConnector:
    """Today's streams: a listener per receiving process, its address published on the store,
    nothing authenticated (``connect_streams``); channels connected one after the other."""

    def __init__(self, store, address: str):
        self.store, self.address = store, address
        self.counters = Counters()  # no record outside a cluster run: its log lines say it all

    def connect(self, rank: int, channels: Mapping[str, list[Hop]],
                timeout_s: float) -> dict[str, dict[int, FramedStream]]:
        return {channel: connect_streams(self.store, rank, self.address, hops, timeout_s, channel)
                for channel, hops in channels.items()}
