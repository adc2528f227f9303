"""Pipeline links over framed TCP (``dist.links = "tcp"``): a raw socket peer that lies about its
frames — a prefix claiming more than the bound, a message larger than any honest one, a header
beyond its room, a negative length, bytes that do not decode — gets each refused unread and
named; the receiver stays up and delivers the honest message that follows. Connections: a
listener takes each expected link once, from a hello naming it, and nothing else."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import gloo_receiver_exit_code

from meshlearn.compress.codecs import Encoded
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.health import Health, WorkerFailure, store_client
from meshlearn.distributed.streams import (
    ACK,
    HELLO_MAGIC,
    Listener,
    connect_streams,
    dial,
    hello,
    local_address,
)
from meshlearn.distributed.transport import Forged, Transport
from meshlearn.distributed.wire import HEADER_ROOM, PREFIX_BYTES, pack
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId

BOUND = 1 << 20  # the receiver's max_message_bytes
SRC, DST = WorkerId(0, 0), WorkerId(0, 1)
LINK = (SRC, DST)


def _values(n: int, m: int) -> Encoded:
    return Encoded({"values": torch.arange(n, dtype=torch.float32) + m}, (n,), torch.float32)


def _frame(header_len: int, body_len: int, filler: int | None = None) -> bytes:
    """A prefix, and (``filler``) as many junk bytes as it claims."""
    head = struct.pack("=qq", header_len, body_len)
    return head if filler is None else head + bytes([filler]) * (header_len + body_len)


def _packed(message: Message) -> bytes:
    return pack(message, torch.device("cpu")).numpy().tobytes()


def _lies() -> list[tuple[bytes, str]]:
    """What the lying peer sends, each with what the receiver must say of it."""
    flood = _packed(Message("act", 0, 1, SRC, DST, _values(BOUND // 4 + 1000, 1)))  # a real message
    garbage = bytearray(_packed(Message("act", 0, 2, SRC, DST, _values(4, 2))))
    garbage[PREFIX_BYTES:PREFIX_BYTES + 8] = b"#" * 8  # the JSON header's first bytes
    return [
        (_frame(10, BOUND + 1 - PREFIX_BYTES - 10, 7), f"a frame of {BOUND + 1} bytes"),
        (flood, f"a frame of {len(flood)} bytes"),
        (_frame(HEADER_ROOM + 1, 0, 9), f"with a {HEADER_ROOM + 1}-byte header"),
        (_frame(-1, 1 << 40), "a frame prefix claiming -1 + 1099511627776 bytes"),
        (bytes(garbage), "malformed message from r0s0"),
    ]


@pytest.fixture
def store() -> BoundStore:
    """The tests' rendezvous store, listening on 127.0.0.1 only: TCPStore's own server binds every
    interface, and one left to the garbage collector made a later in-process elastic launch
    refuse to run (its check that the launcher listens on elastic.host only)."""
    return BoundStore("127.0.0.1", 10)


def _receiver(store, port: int) -> tuple[Transport, Health]:
    """This process as r0s1, its link from r0s0 connected (to a raw peer dialing in a thread)."""
    mesh = MeshShape(1, 2)
    health = Health(store_client("127.0.0.1", port, 10), mesh, 1, 0.2, 5.0, "test store")
    streams = connect_streams(store_client("127.0.0.1", port, 10), 1, "127.0.0.1", [(LINK, 0, 1)], 10.0)
    transport = Transport(DST, mesh, {LINK: streams[0]}, {}, torch.device("cpu"), health, message_s=10.0,
                          max_message_bytes=BOUND)
    return transport, health


def _dial_raw(store_port: int) -> socket.socket:
    """The lying peer: reads the receiver's address off the store and says hello as r0s0."""
    address = store_client("127.0.0.1", store_port, 10).get("links/1").decode()
    host, port = address.rsplit(":", 1)
    peer = socket.create_connection((host, int(port)), timeout=10)
    peer.sendall(hello(LINK))
    assert peer.recv(1) == ACK
    return peer


def test_frames_that_lie_are_refused_unread_and_the_link_delivers_the_honest_message_after(store):
    peers: list[socket.socket] = []
    dialer = threading.Thread(target=lambda: peers.append(_dial_raw(store.port)))
    dialer.start()
    transport, _ = _receiver(store, store.port)
    dialer.join()
    lies = _lies()
    transport.expect(SRC, len(lies) + 1, capacity=0)  # a stream has no posted capacity
    honest = _packed(Message("act", 0, 3, SRC, DST, _values(30, 3)))
    sender = threading.Thread(target=peers[0].sendall, args=(b"".join(f for f, _ in lies) + honest,))
    sender.start()
    got = [transport.next_arrival(10.0) for _ in range(len(lies) + 1)]
    sender.join()
    for item, (_, said) in zip(got, lies, strict=False):
        assert isinstance(item, Forged), item
        assert item.link == LINK and said in item.reason, item.reason
        assert item.message.startswith("worker r0s0 sent a message that was refused unread")
    last = got[-1]
    assert isinstance(last, Message) and last.microbatch == 3 and last.link == LINK
    assert torch.equal(last.payload.tensors["values"], torch.arange(30, dtype=torch.float32) + 3)
    peers[0].close()
    transport.close()


def test_a_message_its_sender_cannot_pack_ends_the_run_naming_the_sender_not_a_lost_link(store):
    """A header beyond HEADER_ROOM fails in ``wire.pack`` in the sender's thread: the error the
    main thread raises says so, and does not blame the peer for a lost connection."""
    listener = Listener("127.0.0.1", {LINK})
    accepting = threading.Thread(target=listener.accept_all, args=(time.monotonic() + 10,))
    accepting.start()
    stream = dial(listener.address, LINK, time.monotonic() + 10)
    accepting.join()
    health = Health(store_client("127.0.0.1", store.port, 10), MeshShape(1, 2), 0, 0.2, 5.0, "test store")
    transport = Transport(SRC, MeshShape(1, 2), {LINK: stream}, {}, torch.device("cpu"), health,
                          message_s=10.0, max_message_bytes=BOUND)
    many = Encoded({f"blocks.{i}.w": torch.zeros(1) for i in range(2000)}, (), torch.float32)
    transport.send(Message("act", 0, 0, SRC, DST, many), capacity=0, shaped=False)
    with pytest.raises(WorkerFailure) as err:
        transport.drain(10.0)
    assert "r0s0 cannot send act 0 of step 0 to worker r0s1" in str(err.value), err.value
    assert "lost the connection" not in str(err.value)
    transport.close()
    listener.streams[LINK].close()


def _try(address: str, payload: bytes) -> bytes:
    """What a listener answers a connection that sends ``payload`` (b"": it closed unanswered;
    with bytes of ours still unread there, the close is a reset)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(payload)
        try:
            return conn.recv(1)
        except ConnectionResetError:
            return b""


def test_a_listener_takes_each_expected_link_once_and_closes_every_other_connection():
    other = (WorkerId(0, 1), WorkerId(0, 0))
    stranger = (WorkerId(3, 3), WorkerId(0, 0))
    listener = Listener("127.0.0.1", {LINK, other})
    accepting = threading.Thread(target=listener.accept_all, args=(time.monotonic() + 10,))
    accepting.start()
    assert listener.address.startswith("127.0.0.1:")  # the socket's own address: never 0.0.0.0
    assert _try(listener.address, hello(stranger)) == b""
    assert _try(listener.address, b"GET / HTTP/1.0\r\n\r\n") == b""
    assert _try(listener.address, HELLO_MAGIC + struct.pack("!H", 60000)) == b""  # a name too long
    host, port = listener.address.rsplit(":", 1)
    first = socket.create_connection((host, int(port)), timeout=5)
    first.sendall(hello(LINK))
    assert first.recv(1) == ACK
    assert _try(listener.address, hello(LINK)) == b""  # the link is taken
    assert _try(listener.address, hello(other)) == ACK
    accepting.join(10)
    assert not accepting.is_alive() and set(listener.streams) == {LINK, other}
    assert [why.split(" ")[:3] for why in listener.refused] == [
        ["a", "hello", "for"], ["no", "valid", "hello"], ["no", "valid", "hello"], ["a", "second", "hello"]]
    with pytest.raises(ConnectionRefusedError):  # every link is in: nobody listens any more
        _try(listener.address, hello(LINK))
    first.close()
    for stream in listener.streams.values():
        stream.close()


def test_the_listening_address_is_the_one_toward_the_store_never_every_interface():
    assert local_address("127.0.0.1", 29500) == "127.0.0.1"
    listener = Listener("127.0.0.1", {LINK})
    assert listener.address.startswith("127.0.0.1:")  # bound there, never to 0.0.0.0
    with pytest.raises(TimeoutError, match="never connected"):
        listener.accept_all(time.monotonic() + 0.2)


def test_a_connection_silent_until_the_deadline_ends_the_set_up_naming_the_links_never_connected():
    """The documented stall: a connection that never says its hello holds the listener until the
    set-up deadline; then the error names the missing links (not a non-blocking socket's EAGAIN)."""
    listener = Listener("127.0.0.1", {LINK})
    host, port = listener.address.rsplit(":", 1)
    with (socket.create_connection((host, int(port)), timeout=5),
          pytest.raises(TimeoutError, match=r"links \['r0s0->r0s1'\] never connected")):
        listener.accept_all(time.monotonic() + 0.3)
    assert listener.refused == ["no hello (TimeoutError: timed out)"]


def _gloo_peer(rank: int, port: int) -> None:
    """Rank 0 sends 1000 bytes into the 100-byte receive rank 1 posted, as a lying peer would."""
    from meshlearn.distributed.transport import MESSAGE_TAG

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    if rank == 0:
        dist.isend(torch.zeros(1000, dtype=torch.uint8), 1, tag=MESSAGE_TAG).wait()
    else:
        dist.irecv(torch.empty(100, dtype=torch.uint8), 0, tag=MESSAGE_TAG).wait()
    time.sleep(30)  # rank 0 stays connected until the test has seen rank 1 end (then kills it)


def test_over_gloo_a_send_larger_than_the_posted_receive_aborts_the_receiving_process():
    """Why the verifier's links are tcp: the same lie over a collective link kills the receiver
    (SIGABRT in gloo's own thread; nothing in Python can catch it)."""
    code = gloo_receiver_exit_code(_gloo_peer, receiver=1)
    assert code == -signal.SIGABRT, code
