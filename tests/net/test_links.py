"""Authenticated links: the sending worker of a hello must belong to the identity in the dialer's
certificate; a participant with valid credentials claiming another's worker, a second hello
for a taken link, or a revoked joiner are refused (in one line on the dialer's side) and
counted, and the listener keeps serving; an oversized frame over an authenticated stream is
refused before allocation and the stream stays in step."""

from __future__ import annotations

import re
import struct
import time

import pytest
import torch
from net_helpers import BOUND, HEADER_ROOM, LINK, OWNERS, Keys, LinkServer, TcpFront, frame_tensor, wait_until

from meshlearn.net.frames import PREFIX_BYTES, FrameRefused
from meshlearn.net.keys import Identity
from meshlearn.net.links import LinkGate, Refused, dial_link


def _dial(keys: Keys, front: TcpFront, name: str, link: tuple[str, str]):
    return dial_link(front.dial(), keys.tls(name), link, OWNERS, time.monotonic() + 10, HEADER_ROOM)


def _received(server: LinkServer):
    """The listener's end of LINK (its dialer has its ACK; the listener stores the stream next)."""
    assert wait_until(lambda: LINK in server.gate.streams)
    return server.gate.streams[LINK]


@pytest.fixture
def server(keys: Keys):
    server = LinkServer(keys)
    server.front = TcpFront(server.acceptor.submit)
    yield server
    server.front.close()


def test_an_owner_opens_its_link(keys: Keys, server: LinkServer) -> None:
    sent = _dial(keys, server.front, "alice", LINK)
    received = _received(server)
    assert sent.peer == Identity("bob", "host") and received.peer == Identity("alice", "host")
    sent.send(frame_tensor(b'{"kind": "act"}', bytes(range(200))))
    got = received.read_frame(BOUND)
    assert bytes(got[PREFIX_BYTES:].numpy()) == b'{"kind": "act"}' + bytes(range(200))
    assert server.counters.total() == 0


@pytest.mark.parametrize("name, link, reason, said", [
    ("carol", LINK, "hello_refused", "carol (joiner) claims r0s0, which alice runs"),
    ("bob", LINK, "hello_refused", "bob (host) claims r0s0, which alice runs"),
    ("alice", ("r0s0", "r1s1"), "identity_refused", None),  # r1s1 is dave's: bob is not who she expects
    ("alice", ("r1s0", "r0s1"), "hello_refused", "alice (host) claims r1s0, which carol runs"),
    ("alice", ("r1s1", "r0s1"), "hello_refused", "a hello for 'r1s1->r0s1', not a link this process"),
    ("dave", ("r1s1", "r0s1"), "certificate_refused", "certificate revoked"),
])
def test_what_a_peer_may_not_say_is_refused(keys: Keys, server: LinkServer, name: str,
                                            link: tuple[str, str], reason: str, said: str | None) -> None:
    with pytest.raises(Refused) as err:
        _dial(keys, server.front, name, link)
    assert "\n" not in str(err.value)
    if reason == "identity_refused":  # the dialer refused the server: nothing for the server to count
        assert err.value.reason == "identity_refused" and "not dave" in str(err.value)
    else:
        assert err.value.reason == "refused_by_peer"
        assert wait_until(lambda: server.counters.as_dict() == {reason: 1})
        assert said in server.counters.recent()[0]
        if reason == "certificate_refused":
            assert "certificate revoked" in str(err.value)  # the dialer learns why
    _dial(keys, server.front, "alice", LINK)  # the listener keeps serving
    assert _received(server).peer == Identity("alice", "host")


def test_a_taken_link_is_not_taken_twice(keys: Keys, server: LinkServer) -> None:
    _dial(keys, server.front, "alice", LINK)
    with pytest.raises(Refused, match="refused the link r0s0->r0s1"):
        _dial(keys, server.front, "alice", LINK)
    assert wait_until(lambda: server.counters.as_dict() == {"hello_refused": 1})
    assert "a second hello for 'r0s0->r0s1'" in server.counters.recent()[0]
    _dial(keys, server.front, "carol", ("r1s0", "r0s1"))
    assert set(server.gate.wait_all(time.monotonic() + 10)) == {LINK, ("r1s0", "r0s1")}


def test_oversized_frames_are_refused_and_the_stream_stays_in_step(keys: Keys, server: LinkServer) -> None:
    sent = _dial(keys, server.front, "alice", LINK)
    received = _received(server)
    lies = [frame_tensor(b"h", bytes(BOUND)),  # 17 bytes over the bound: 40x is no different
            frame_tensor(bytes(HEADER_ROOM + 1), b""),
            torch.frombuffer(bytearray(struct.pack("=qq", -1, 1 << 40)), dtype=torch.uint8)]
    honest = frame_tensor(b"{}", b"after the lies")
    for lie in lies:
        sent.send(lie)
        sent.send(honest)
    for expected in (f"a frame of {PREFIX_BYTES + 1 + BOUND} bytes", f"with a {HEADER_ROOM + 1}-byte header",
                     "a frame prefix claiming -1 + 1099511627776 bytes"):
        with pytest.raises(FrameRefused, match=re.escape(expected)):
            received.read_frame(BOUND)
        assert bytes(received.read_frame(BOUND)[PREFIX_BYTES:].numpy()) == b"{}after the lies"


def test_a_gate_receives_only_for_its_own_workers(keys: Keys) -> None:
    with pytest.raises(ValueError, match=r"links \['r0s1->r0s0'\] are received by workers that bob"):
        LinkGate(keys.tls("bob"), {("r0s1", "r0s0")}, OWNERS, HEADER_ROOM)


def test_missing_links_are_named(keys: Keys, server: LinkServer) -> None:
    _dial(keys, server.front, "alice", LINK)
    with pytest.raises(TimeoutError, match=r"links \['r1s0->r0s1'\] never connected"):
        server.gate.wait_all(time.monotonic() + 0.2)
