"""The control service's messages: one request frame, one answer frame, over an authenticated
TLS connection (``cluster/control.py`` serves, ``cluster/control_store.py`` asks).

A message is a ``net.frames`` frame: a JSON header (at most ``HEADER_ROOM`` bytes: the operation,
its keys, numbers) and a body of raw bytes (the values, concatenated; the header gives their
lengths). Both ends check a frame's size before they allocate for it (``MAX_FRAME``); nothing is
ever unpickled. Why JSON and not the TCPStore's binary protocol: the service must read every key
before it acts (the owner rules of ``authority.py``), and a header that is text with named
fields is what can be checked field by field, in one line of refusal.
"""

from __future__ import annotations

import json
import socket

from meshlearn.net.frames import PREFIX, PREFIX_BYTES, FramedStream, frame

HEADER_ROOM = 1 << 16  # the operation and its keys; a multi_get of every heartbeat fits many times
MAX_VALUE = 64 << 20  # the largest value the run stores (the BPE tokenizer, a verifier's state)
MAX_FRAME = HEADER_ROOM + MAX_VALUE


class ControlRefused(RuntimeError):
    """The service refused a request (``reason``: the counter it added to), or it timed out."""

    def __init__(self, reason: str, why: str):
        super().__init__(f"the control service refused: {reason}: {why}")
        self.reason, self.why = reason, why


def stream(sock: socket.socket, name: str) -> FramedStream:
    return FramedStream(sock, name, HEADER_ROOM)


def send(link: FramedStream, header: dict, values: list[bytes] = ()) -> None:
    """One message: ``header`` with the lengths of ``values``, then the values."""
    body = b"".join(values)
    if len(body) > MAX_VALUE:
        raise ValueError(f"a control message of {len(body)} bytes: at most {MAX_VALUE} (MAX_VALUE)")
    link.sock.sendall(frame(json.dumps(header | {"lengths": [len(v) for v in values]}).encode(), body))


def receive(link: FramedStream) -> tuple[dict, list[bytes]]:
    """The next message: its header and its values. ``FrameRefused`` for an oversized frame (read
    and dropped, the link still in step); ValueError for a header that does not decode."""
    buffer = link.read_frame(MAX_FRAME).numpy()
    header_len, _ = PREFIX.unpack(buffer[:PREFIX_BYTES].tobytes())
    raw = buffer[PREFIX_BYTES:PREFIX_BYTES + header_len].tobytes()
    body = buffer[PREFIX_BYTES + header_len:].tobytes()
    try:
        header = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"a header that is not JSON ({err})") from None
    except RecursionError:  # nesting deep enough to exhaust the stack fits in HEADER_ROOM
        raise ValueError("a header nested too deep") from None
    lengths = header.get("lengths") if isinstance(header, dict) else None
    if (not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths)
            or sum(lengths) != len(body)):
        raise ValueError("a header whose value lengths do not add up to its body")
    values, at = [], 0
    for n in lengths:
        values.append(body[at:at + n])
        at += n
    return header, values


def _no_constant(name: str) -> None:
    """JSON's NaN and ±Infinity are no numbers a request may carry (a NaN wait never ends)."""
    raise ValueError(f"a header holding {name}")


def raise_for(header: dict) -> None:
    """The asking side of an answer that is a refusal or a timeout."""
    if "error" in header:
        raise ControlRefused(str(header["error"]), str(header.get("why", "")))
