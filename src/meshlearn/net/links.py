"""Authenticated links: a mutual TLS connection (``tls.py``) whose hello names a logical link,
and whose sending worker must belong to the identity in the dialer's certificate.

A link is ``(sender, receiver)``, two worker names (``str(WorkerId)``, e.g. ``("r0s0", "r0s1")``);
``owners`` maps each worker to the identity (host or joiner name) that runs it, as the placement
says. The dialer expects the receiver's owner at the other end (``tls.connect(expect=...)``); the
listener (``LinkGate``) accepts a hello only for a link it receives on, not yet connected, whose
sender the peer's certificate owns — so a participant with valid credentials cannot take
another's link, and a stranger never gets past the handshake. The accepted connection becomes an
``AuthStream``: the frames of ``frames.py`` (bounded before allocation, an oversized frame
discarded and the stream kept in step) over TLS, which also makes a replayed or altered record
fail its authentication tag and end the connection.

Hello (inside TLS): ``HELLO_MAGIC``, a 2-byte length (at most ``HELLO_MAX``), ``"r0s0->r0s1"``;
the listener answers ``ACK`` or closes. Hello and handshake share one deadline.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from collections.abc import Mapping

from meshlearn.net.frames import FramedStream
from meshlearn.net.keys import Identity
from meshlearn.net.tls import Refused, RunTls, refusal_of

Link = tuple[str, str]  # (sending worker, receiving worker)

HELLO_MAGIC = b"MLAL"
HELLO_MAX = 128  # bytes a link's name may take in a hello
ACK = b"\x01"


def link_name(link: Link) -> str:
    return f"{link[0]}->{link[1]}"


def hello(link: Link) -> bytes:
    name = link_name(link).encode()
    return HELLO_MAGIC + struct.pack("!H", len(name)) + name


class AuthStream(FramedStream):
    """One authenticated TLS connection carrying one logical link in one direction; ``peer`` is who
    is at the other end, as its certificate says."""

    def __init__(self, sock: ssl.SSLSocket, link: Link, peer: Identity, header_room: int):
        super().__init__(sock, link_name(link), header_room)
        self.link = link
        self.peer = peer


class LinkGate:
    """This process's admission of the links it receives on: authenticates a connection (TLS, then
    the hello) and keeps the stream, each expected link once. Use ``authenticate`` as a
    ``tls.Acceptor``'s, and ``wait_all`` for the set-up to finish."""

    def __init__(self, tls: RunTls, expected: set[Link], owners: Mapping[str, str], header_room: int):
        foreign = sorted(link_name(k) for k in expected if owners.get(k[1]) != tls.identity.name)
        if foreign:
            raise ValueError(f"links {foreign} are received by workers that {tls.identity.name} does not run")
        self.tls, self.owners, self.header_room = tls, dict(owners), header_room
        self.expected = {link_name(link): link for link in expected}
        self.streams: dict[Link, AuthStream] = {}
        self._claimed: set[Link] = set()  # links whose hello was accepted (their ACK may still be leaving)
        self._ready = threading.Condition()

    def authenticate(self, sock: socket.socket, deadline: float) -> AuthStream:
        """The stream ``sock`` carries once its peer is authenticated and its hello allowed, or
        Refused (``sock`` closed)."""
        tls_sock, peer = self.tls.accept(sock, deadline)
        try:
            link = self._claim(_read_hello(tls_sock, deadline), peer)
        except BaseException as err:
            tls_sock.close()
            raise _refusal(err, peer) from None
        try:
            tls_sock.settimeout(_left(deadline))
            tls_sock.sendall(ACK)
            tls_sock.settimeout(None)
        except BaseException as err:
            tls_sock.close()
            with self._ready:
                self._claimed.discard(link)
            raise _refusal(err, peer) from None
        stream = AuthStream(tls_sock, link, peer, self.header_room)
        with self._ready:
            self.streams[link] = stream
            self._ready.notify_all()
        return stream

    def _claim(self, name: str | None, peer: Identity) -> Link:
        """The link a hello names, reserved for this connection; Refused if the peer may not open it."""
        with self._ready:
            link = self.expected.get(name) if name is not None else None
            why = ("no valid hello" if name is None
                   else f"a hello for {name!r}, not a link this process receives" if link is None
                   else f"{peer} claims {link[0]}, which {self.owners.get(link[0])} runs"
                   if self.owners.get(link[0]) != peer.name
                   else f"a second hello for {name!r}" if link in self._claimed
                   else None)
            if why is not None:
                raise Refused("hello_refused", why, peer.name)
            self._claimed.add(link)
            return link

    def wait_all(self, deadline: float) -> dict[Link, AuthStream]:
        """Every expected link's stream, once all are in; TimeoutError naming the missing ones."""
        with self._ready:
            while len(self.streams) < len(self.expected):
                left = deadline - time.monotonic()
                if left <= 0 or not self._ready.wait(left):
                    missing = sorted(set(self.expected) - {link_name(k) for k in self.streams})
                    raise TimeoutError(f"links {missing} never connected")
            return dict(self.streams)


def dial_link(sock: socket.socket, tls: RunTls, link: Link, owners: Mapping[str, str], deadline: float,
              header_room: int) -> AuthStream:
    """Authenticate a connected ``sock`` (``port.dial``'s) as the sender of ``link``: the peer must
    be the receiver's owner and accept the hello by ``deadline``; else Refused, naming why."""
    expect = owners.get(link[1])
    if expect is None:
        raise ValueError(f"link {link_name(link)}: the placement names no identity that runs {link[1]}")
    tls_sock, peer = tls.connect(sock, expect, deadline)
    try:
        tls_sock.settimeout(_left(deadline))
        tls_sock.sendall(hello(link))
        answer = tls_sock.recv(1)
    except OSError as err:  # the listener closed on our hello
        tls_sock.close()
        raise Refused("refused_by_peer", f"{expect} refused the link {link_name(link)}: "
                                         f"{refusal_of(err)}") from None
    if answer != ACK:
        tls_sock.close()
        raise Refused("refused_by_peer", f"{expect} refused the link {link_name(link)}")
    tls_sock.settimeout(None)
    return AuthStream(tls_sock, link, peer, header_room)


def _refusal(err: BaseException, peer: Identity) -> BaseException:
    """What ``authenticate`` raises for ``err``: a Refused naming its counter."""
    if isinstance(err, Refused) or not isinstance(err, OSError):
        return err
    if isinstance(err, TimeoutError):
        return Refused("handshake_timeout", f"{peer}: no hello within the deadline", peer.name)
    return Refused("hello_refused", f"{peer}: no hello ({refusal_of(err)})", peer.name)


def _read_hello(sock: ssl.SSLSocket, deadline: float) -> str | None:
    """The link a hello names, or None for bytes that are no hello; every read by ``deadline`` (a
    peer trickling bytes cannot outlast it)."""
    head = _read_by(sock, len(HELLO_MAGIC) + 2, deadline)
    length = struct.unpack("!H", head[len(HELLO_MAGIC):])[0]
    if not head.startswith(HELLO_MAGIC) or length > HELLO_MAX:
        return None
    return _read_by(sock, length, deadline).decode(errors="replace")


def _read_by(sock: ssl.SSLSocket, n: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < n:
        sock.settimeout(_left(deadline))
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("closed before its hello")
        data += got
    return bytes(data)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline has passed")
    return left
