"""The transport between two real processes: messages that fit the receive buffers and messages
that do not (the oversize path) arrive intact and in order, over a per-direction group; bytes that
lie (an oversize notice beyond the run's bound, a header that does not decode) are refused unread,
named, and leave the link up for the next message."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_helpers import deadline

from meshlearn.compress.codecs import Encoded
from meshlearn.distributed.health import Health, store_client
from meshlearn.distributed.shaping import Pacer
from meshlearn.distributed.transport import MESSAGE_TAG, Forged, Transport
from meshlearn.distributed.wire import pack, prefix
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import LinkProfile, Network
from meshlearn.mesh.topology import MeshShape, WorkerId

CAPACITY = 4096
BOUND = 1 << 20  # the receiver's max_message_bytes
SIZES = [10, 5000, 20, 100_000, 30]  # values per message; 5000 and 100000 floats exceed CAPACITY


def _values(n: int, m: int) -> Encoded:
    return Encoded({"values": torch.arange(n, dtype=torch.float32) + m}, (n,), torch.float32)


def _send_intact(transport: Transport, me: WorkerId, other: WorkerId, _forward) -> None:
    for m, n in enumerate(SIZES):
        transport.send(Message("act", 0, m, me, other, _values(n, m)), CAPACITY)
    transport.drain(20.0)


def _send_lies(transport: Transport, me: WorkerId, other: WorkerId, forward) -> None:
    """An oversize notice of 1 TiB (no buffer follows), one of 3 bytes (less than a prefix: none
    follows either), a header that is not JSON, then an honest message: raw sends on the link's
    group, as a lying peer would make them."""
    lie, short = prefix(-1, 1 << 40, torch.device("cpu")), prefix(-1, 3, torch.device("cpu"))
    garbage = pack(Message("act", 0, 0, me, other, _values(4, 0)), torch.device("cpu"))
    garbage[16:24] = ord("#")  # the JSON header's first bytes
    for buffer in (lie, short, garbage):
        dist.isend(buffer, 1, group=forward, tag=MESSAGE_TAG).wait()
    transport.send(Message("act", 0, 3, me, other, _values(30, 3)), CAPACITY)
    transport.drain(20.0)


LIES = [None, None, None, 30]  # what the receiver gets of _send_lies: three refusals, then 30 values


def _peer(rank: int, port: int, sender, expected: list, result: mp.Queue) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    mesh = MeshShape(1, 2)
    me, other = mesh.worker(rank), mesh.worker(1 - rank)
    health = Health(store_client("127.0.0.1", port, 30), mesh, rank, 0.2, 5.0, "test store")
    health.start()
    forward, backward = dist.new_group([0, 1]), dist.new_group([0, 1])
    groups = {(WorkerId(0, 0), WorkerId(0, 1)): forward, (WorkerId(0, 1), WorkerId(0, 0)): backward}
    network = Network(LinkProfile(float("inf"), 0.0))
    pacers = {other: Pacer(network.link(me, other), 0.0, enabled=False)}
    transport = Transport(me, mesh, groups, pacers, torch.device("cpu"), health, message_s=20.0,
                          max_message_bytes=BOUND)
    if rank == 0:
        sender(transport, me, other, forward)
        result.put("sent")
    else:
        transport.expect(other, len(expected), CAPACITY)
        got = [transport.next_arrival(20.0) for _ in expected]
        result.put(_verdict(got, expected))
    dist.barrier()
    health.finish()
    transport.close()
    dist.destroy_process_group()


def _verdict(got: list, expected: list) -> str:
    """"ok" when each arrival is what was sent: the message with its values (n of them), or a
    refusal (None) naming the sender and what was wrong."""
    for m, (item, n) in enumerate(zip(got, expected, strict=True)):
        if n is None:
            ok = isinstance(item, Forged) and item.message.startswith("worker r0s0 sent a message") and (
                "oversize notice of 1099511627776 bytes" in item.reason or "malformed" in item.reason
                or "oversize notice of 3 bytes" in item.reason)
        else:
            ok = isinstance(item, Message) and torch.equal(item.payload.tensors["values"],
                                                           torch.arange(n, dtype=torch.float32) + m)
        if not ok:
            return f"arrival {m} wrong: {item!r:.300}"
    return "ok"


def _run_pair(sender, expected: list) -> list[str]:
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(rank, store.port, sender, expected, result))
             for rank in range(2)]
    try:
        with deadline(60, "the two transport processes"):
            for p in procs:
                p.start()
            outcomes = sorted(result.get(timeout=50) for _ in procs)
            for p in procs:
                p.join(timeout=20)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return outcomes


def test_messages_arrive_intact_whether_or_not_they_fit_the_posted_buffers():
    assert _run_pair(_send_intact, SIZES) == ["ok", "sent"]


def test_a_lying_notice_and_undecodable_bytes_are_refused_unread_and_the_link_stays_up():
    assert _run_pair(_send_lies, LIES) == ["ok", "sent"]
