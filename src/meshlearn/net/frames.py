"""Bounded frames on a byte stream, plain or TLS: the receiver decides what it allocates.

A frame is a 16-byte prefix (two native int64: header length, body length; what
``distributed/wire.py`` writes in front of a message), then that many bytes. The receiver reads
the prefix and allocates only if the header fits the stream's ``header_room`` and the whole frame
the bound the caller gives. A frame beyond that is read and thrown away in ``DISCARD_CHUNK``
pieces, so the stream stays in step and the link up, and ``FrameRefused`` says what was refused.
A prefix with a negative length says nothing about where its frame ends: only the prefix is
consumed (what follows is the same peer's next frame, and a peer can only garble its own link).

A socket timeout bounds each read, not a frame: a peer trickling a byte just inside it would
stretch one frame without end. A reader that owes its caller an answer by a deadline (a
collective's contribution) passes ``within_s``, and the whole frame must arrive within it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import torch

PREFIX = struct.Struct("=qq")  # as wire.prefix writes it: two native int64
PREFIX_BYTES = PREFIX.size
DISCARD_CHUNK = 1 << 16  # a refused frame is read and dropped this many bytes at a time


class FrameRefused(Exception):
    """A frame the receiver did not allocate for; the stream is past it (the link is still up)."""


class FramedStream:
    """One connected socket (``socket.socket`` or ``ssl.SSLSocket``) carrying frames in one
    direction: the sender writes whole frames, the receiver reads them one by one against its bound.
    ``name`` says which link it is in errors."""

    def __init__(self, sock: socket.socket, name: str, header_room: int):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.name = name
        self.header_room = header_room

    def set_timeout(self, seconds: float | None) -> None:
        """The longest one read or write may block (the transport's backstop)."""
        self.sock.settimeout(seconds)

    def send(self, buffer: torch.Tensor) -> None:
        """A packed message (a uint8 buffer starting with its prefix) as one frame; a CUDA buffer is
        copied to the host."""
        self.sock.sendall(memoryview(buffer.cpu().numpy()))

    def read_frame(self, bound: int, within_s: float | None = None) -> torch.Tensor:
        """The next frame as a CPU uint8 buffer, allocated only if its prefix claims at most
        ``header_room`` header bytes and ``bound`` bytes in all; else FrameRefused, the frame
        consumed. Raises ConnectionError when the peer closed the stream, OSError on a timeout.
        ``within_s``: the whole frame (a refused one read away included) must arrive within it
        (TimeoutError; the socket's timeout is left changed: the caller sets its own again)."""
        deadline = None if within_s is None else time.monotonic() + within_s
        head = recv_exact(self.sock, PREFIX_BYTES, self._closed(), deadline)
        header_len, body_len = PREFIX.unpack(head)
        if header_len < 0 or body_len < 0:
            raise FrameRefused(f"a frame prefix claiming {header_len} + {body_len} bytes")
        size = PREFIX_BYTES + header_len + body_len
        if header_len > self.header_room or size > bound:
            self._discard(size - PREFIX_BYTES, deadline)
            raise FrameRefused(f"a frame of {size} bytes with a {header_len}-byte header (a message of "
                               f"this run takes at most {bound}, its header {self.header_room})")
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        view[:PREFIX_BYTES] = head
        fill(self.sock, view[PREFIX_BYTES:], self._closed(), deadline)
        return buffer

    def close(self) -> None:
        """Shut the connection (wakes a thread blocked reading it); queued bytes still leave."""
        with contextlib.suppress(OSError):  # already closed by the peer
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _discard(self, n: int, deadline: float | None) -> None:
        scratch = memoryview(bytearray(min(n, DISCARD_CHUNK)))
        while n:
            chunk = min(n, len(scratch))
            fill(self.sock, scratch[:chunk], self._closed(), deadline)
            n -= chunk

    def _closed(self) -> str:
        return f"the peer closed the link {self.name}"


def frame(header: bytes, body: bytes) -> bytes:
    """``header`` and ``body`` as one frame (for callers that do not pack torch messages)."""
    return PREFIX.pack(len(header), len(body)) + header + body


def recv_exact(sock: socket.socket, n: int, closed: str, deadline: float | None = None) -> bytes:
    data = bytearray(n)
    fill(sock, memoryview(data), closed, deadline)
    return bytes(data)


def fill(sock: socket.socket, view: memoryview, closed: str, deadline: float | None = None) -> None:
    """Read exactly ``len(view)`` bytes into ``view``; ConnectionError(``closed``) if the peer
    closes first; TimeoutError if they are not all in by ``deadline`` (a monotonic time; None:
    each read waits as long as the socket's timeout)."""
    while len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the frame did not arrive whole by its deadline")
            sock.settimeout(left)
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError(closed)
        view = view[got:]
