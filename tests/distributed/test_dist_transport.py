"""The transport between two real processes: messages that fit the receive buffers and messages
that do not (the oversize path) arrive intact and in order, over a per-direction group."""

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
from meshlearn.distributed.transport import Transport
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import LinkProfile, Network
from meshlearn.mesh.topology import MeshShape, WorkerId

CAPACITY = 4096
SIZES = [10, 5000, 20, 100_000, 30]  # values per message; 5000 and 100000 floats exceed CAPACITY


def _peer(rank: int, port: int, result: mp.Queue) -> None:
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
    transport = Transport(me, mesh, groups, pacers, torch.device("cpu"), health, message_s=20.0)
    if rank == 0:
        for m, n in enumerate(SIZES):
            payload = Encoded({"values": torch.arange(n, dtype=torch.float32) + m}, (n,), torch.float32)
            transport.send(Message("act", 0, m, me, other, payload), CAPACITY)
        transport.drain(20.0)
        result.put("sent")
    else:
        transport.expect(other, len(SIZES), CAPACITY)
        got = [transport.next_message("activation", other) for _ in SIZES]
        ok = all(g.microbatch == m and torch.equal(g.payload.tensors["values"],
                                                   torch.arange(n, dtype=torch.float32) + m)
                 for m, (g, n) in enumerate(zip(got, SIZES, strict=True)))
        result.put("ok" if ok else f"wrong: {[(g.microbatch, g.payload.shape) for g in got]}")
    dist.barrier()
    health.finish()
    transport.close()
    dist.destroy_process_group()


def test_messages_arrive_intact_whether_or_not_they_fit_the_posted_buffers():
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(rank, store.port, result)) for rank in range(2)]
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
    assert outcomes == ["ok", "sent"]
    assert [p.exitcode for p in procs] == [0, 0]
