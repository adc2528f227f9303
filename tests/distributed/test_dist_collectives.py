"""Framed collectives (``distributed/collectives.py``): sums in replica order, the same bits on every
member and as the simulator's ``average_gradients``; a peer's frame of another size or that does not
decode is refused before allocation, attributed to it and counted, and passed over: the sender's
honest frame after it still makes the sum. A sender that only lies is named once it has spent
``MAX_REFUSED`` frames on one contribution: the receiving process ends with one line naming it,
where gloo's all-reduce aborts it (SIGABRT) on a single lie."""

from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import struct
import threading
import time
from datetime import timedelta
from types import MethodType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import gloo_receiver_exit_code
from net.net_helpers import trickle

from meshlearn.config import ConfigError, load_config
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.collectives import (
    FRAME_OVERHEAD,
    HEADER,
    MAGIC,
    MAX_REFUSED,
    OPS,
    FramedCollectives,
    Lost,
    Refused,
    RunCollectives,
    frame_bytes,
)
from meshlearn.distributed.health import Health, WorkerFailure, store_client
from meshlearn.distributed.settings import DistConfig, derive_deadlines, links_of, links_trusted
from meshlearn.distributed.wire import HEADER_ROOM
from meshlearn.mesh.network import LinkProfile
from meshlearn.mesh.sync import average_gradients
from meshlearn.mesh.topology import MeshShape
from meshlearn.mesh.worker import Worker
from meshlearn.net.counters import Counters
from meshlearn.net.frames import PREFIX, FramedStream

SHAPES = [(7, 5), (5,), (3, 4, 2)]  # a stage's parameters


def _mesh(n: int) -> list[FramedCollectives]:
    """``n`` members, a socket pair per ordered pair of them."""
    outgoing: list[dict] = [{} for _ in range(n)]
    incoming: list[dict] = [{} for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a != b:
                tx, rx = socket.socketpair()
                outgoing[a][b] = FramedStream(tx, f"{a}->{b}", HEADER_ROOM)
                incoming[b][a] = FramedStream(rx, f"{a}->{b}", HEADER_ROOM)
    members = [FramedCollectives(r, outgoing[r], incoming[r]) for r in range(n)]
    for member in members:
        member.set_timeout(10.0)
    return members


def _each(members, call) -> list:
    """``call(member)`` in a thread per member; their results in rank order."""
    results: list = [None] * len(members)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = call(members[i])
        except BaseException as err:  # noqa: BLE001 — re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_sum_is_the_simulators_bit_for_bit_on_every_replica(replicas):
    """Gradients of D replicas (values chosen to round differently in other orders) summed over
    frames, divided by D, equal the simulator's mean on every member, bit for bit."""
    gen = torch.Generator().manual_seed(replicas)
    grads = [[torch.randn(s, generator=gen) * 10 ** torch.randint(-6, 6, s, generator=gen) for s in SHAPES]
             for _ in range(replicas)]
    workers = []
    for own in grads:
        module = torch.nn.Module()
        for i, g in enumerate(own):
            module.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros_like(g)))
            getattr(module, f"p{i}").grad = g.clone()
        worker = SimpleNamespace(module=module, dp=None,
                                 grads=lambda m=module: [p.grad for p in m.parameters()],
                                 flat_gradients=lambda m=module: torch.cat([p.grad.reshape(-1)
                                                                            for p in m.parameters()]))
        worker.set_flat_gradients = MethodType(Worker.set_flat_gradients, worker)
        workers.append(worker)
    average_gradients(workers)
    expected = torch.cat([p.grad.reshape(-1) for p in workers[0].module.parameters()])
    flats = [torch.cat([g.reshape(-1) for g in own]) for own in grads]
    members = _mesh(replicas)
    sums = _each(members, lambda m: m.sum(flats[m.rank], range(replicas)) / replicas)
    for got in sums:
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    for member in members:
        member.close()


def test_gather_broadcast_blob_and_barrier_deliver_every_members_values():
    members = _mesh(3)
    rows = _each(members, lambda m: m.all_gather(torch.full((2, 3), float(m.rank), dtype=torch.float64),
                                                 [0, 1, 2]))
    for got in rows:
        assert [int(t[0, 0]) for t in got] == [0, 1, 2] and all(t.dtype == torch.float64 for t in got)
    loss = _each(members, lambda m: m.broadcast(torch.tensor([2.5 if m.rank == 2 else 0.0]), 2, [0, 1, 2]))
    assert [t.item() for t in loss] == [2.5, 2.5, 2.5]
    blob = torch.arange(100, dtype=torch.uint8)
    blobs = _each(members, lambda m: m.broadcast_bytes(blob if m.rank == 1 else None, 1, [0, 1, 2], 200))
    assert all(torch.equal(b, blob) for b in blobs)
    _each(members, lambda m: m.barrier([0, 1, 2]))
    # rank 0 sent its gather and barrier frames; it also heard rank 2's broadcast and rank 1's blob
    assert members[0].sent == {1: 2, 2: 2} and members[0].received == {1: 3, 2: 3}
    for member in members:
        member.close()


TENSOR = torch.arange(256, dtype=torch.float32)  # what the receiver expects: 1 KiB


def _honest(tensor: torch.Tensor, op: str, sequence: int) -> bytes:
    body = tensor.numpy().tobytes()
    return PREFIX.pack(HEADER.size, len(body)) + HEADER.pack(MAGIC, OPS[op], sequence) + body


def _lies() -> list[tuple[list[bytes], str]]:
    """Frames a lying replica sends for the second sum, each with what the refusal must say."""
    first = _honest(TENSOR, "sum", 0)
    big = _honest(torch.zeros(40 * TENSOR.numel()), "sum", 1)  # 40× oversized
    short = _honest(TENSOR[:100], "sum", 1)
    garbage = bytearray(_honest(TENSOR, "sum", 1))
    garbage[16:20] = b"JUNK"
    return [
        ([first, big], f"a frame of {len(big)} bytes"),
        ([first, short], f"a frame of {len(short)} bytes with a 16-byte header (expected a sum of "
                         f"{frame_bytes(TENSOR)} bytes"),
        ([first, bytes(garbage)], "does not decode as its sum #1 (magic b'JUNK'"),
        ([first, first], "does not decode as its sum #1 (magic b'MLC1', operation 1, number 0)"),  # replayed
        ([first, _honest(TENSOR, "gather", 1)], "operation 2"),
        ([first, struct.pack("=qq", -1, 1 << 40)], "a frame prefix claiming -1 + 1099511627776 bytes"),
    ]


@pytest.mark.parametrize(("frames", "said"), _lies())
def test_a_contribution_that_lies_is_refused_unread_counted_and_passed_over(frames, said):
    tx, rx = socket.socketpair()
    back_tx, back_rx = socket.socketpair()  # the receiver's own frames to the liar (never read)
    counters = Counters()
    receiver = FramedCollectives(0, {1: FramedStream(back_tx, "0->1", HEADER_ROOM)},
                                 {1: FramedStream(rx, "1->0", HEADER_ROOM)}, counters)
    receiver.set_timeout(10.0)
    honest = _honest(2 * TENSOR, "sum", 1)  # what the liar owes after its lie
    liar = threading.Thread(target=tx.sendall, args=(b"".join([*frames, honest]),))
    liar.start()
    assert torch.equal(receiver.sum(TENSOR, [0, 1]), 2 * TENSOR)  # the honest first round
    assert torch.equal(receiver.sum(TENSOR, [0, 1]), 3 * TENSOR)  # the lie changed nothing
    liar.join(10)
    assert receiver.refused == {1: 1} and counters.as_dict() == {"contribution_refused": 1}
    assert said in counters.recent()[0], counters.recent()
    receiver.close()
    for sock in (tx, back_rx):
        sock.close()


@pytest.mark.parametrize(("frames", "said"), _lies())
def test_a_sender_that_only_lies_is_named_after_max_refused_frames(frames, said):
    tx, rx = socket.socketpair()
    back_tx, back_rx = socket.socketpair()
    receiver = FramedCollectives(0, {1: FramedStream(back_tx, "0->1", HEADER_ROOM)},
                                 {1: FramedStream(rx, "1->0", HEADER_ROOM)})
    receiver.set_timeout(10.0)
    liar = threading.Thread(target=tx.sendall, args=(b"".join([frames[0], *[frames[1]] * MAX_REFUSED]),))
    liar.start()
    receiver.sum(TENSOR, [0, 1])
    with pytest.raises(Refused) as err:
        receiver.sum(TENSOR, [0, 1])
    liar.join(10)
    assert err.value.sender == 1 and said in err.value.reason, err.value.reason
    assert f"{MAX_REFUSED} frames in a row refused" in err.value.reason
    assert receiver.refused == {1: MAX_REFUSED}
    receiver.close()
    for sock in (tx, back_rx):
        sock.close()


def test_a_lie_in_place_of_a_contribution_names_its_sender_at_the_deadline():
    """One refused frame and then silence: at the deadline the sender is named for its lie (the
    refused frame), not merely as silent."""
    tx, rx = socket.socketpair()
    back_tx, back_rx = socket.socketpair()
    receiver = FramedCollectives(0, {1: FramedStream(back_tx, "0->1", HEADER_ROOM)},
                                 {1: FramedStream(rx, "1->0", HEADER_ROOM)})
    receiver.set_timeout(0.5)
    tx.sendall(_honest(TENSOR[:100], "sum", 0))  # a short frame, and nothing after it
    with pytest.raises(Refused) as err:
        receiver.sum(TENSOR, [0, 1])
    said = "nothing valid for its sum by the deadline after 1 refused frame(s) (the last: a frame of"
    assert err.value.sender == 1 and err.value.reason.startswith(said), err.value.reason
    receiver.close()
    for sock in (tx, back_rx):
        sock.close()


class _SlowLiar:
    """A peer's incoming stream, on a clock of the test's: each frame arrives ``every_s`` after the
    read began and is refused (a short frame). Records the time each read was given for its frame
    (``within``) and the timeouts set on the stream."""

    def __init__(self, now: list[float], every_s: float):
        self.now, self.every_s, self.within, self.timeouts = now, every_s, [], []

    def set_timeout(self, seconds: float | None) -> None:
        self.timeouts.append(seconds)

    def read_frame(self, bound: int, within_s: float | None = None) -> torch.Tensor:
        self.within.append(within_s)
        if within_s is not None and self.every_s >= within_s:
            raise TimeoutError("timed out")  # what the stream does when the frame is not in by then
        self.now[0] += self.every_s
        return torch.frombuffer(bytearray(_honest(TENSOR[:100], "sum", 0)), dtype=torch.uint8)

    def close(self) -> None:
        pass


def test_refused_frames_do_not_extend_a_contributions_deadline():
    """A liar sends a refused frame every 4 s against a 10 s deadline: each would arrive in time
    for a read with a fresh deadline (so MAX_REFUSED of them held the reader 32 s, 3.2 deadlines).
    Each frame gets only what is left of the one deadline: after the second (8 s) there are 2 s
    left, the third does not come in them, and the sender is named at 10 s."""
    now = [0.0]
    liar = _SlowLiar(now, every_s=4.0)
    back_tx, back_rx = socket.socketpair()
    receiver = FramedCollectives(0, {1: FramedStream(back_tx, "0->1", HEADER_ROOM)}, {1: liar},
                                 clock=lambda: now[0])
    receiver.set_timeout(10.0)
    with pytest.raises(Refused, match=r"nothing valid for its sum by the deadline after 2 refused"):
        receiver.sum(TENSOR, [0, 1])
    assert receiver.refused == {1: 2} and now[0] == 8.0
    assert liar.within == [10.0, 6.0, 2.0] and liar.timeouts == [10.0, 10.0]  # set, then set again
    receiver.close()
    back_rx.close()


def test_a_frame_trickled_a_byte_at_a_time_meets_the_contributions_deadline():
    """A liar trickles its contribution a byte every 0.1 s: each read comes in time for a socket
    timeout of 0.5 s, the frame (over a kilobyte) would take minutes. It is cut off at the deadline
    (the liar stops after 3 s and closes: before, the reader was still waiting then, and saw a
    closed stream instead)."""
    tx, rx = socket.socketpair()
    back_tx, back_rx = socket.socketpair()
    receiver = FramedCollectives(0, {1: FramedStream(back_tx, "0->1", HEADER_ROOM)},
                                 {1: FramedStream(rx, "1->0", HEADER_ROOM)})
    receiver.set_timeout(0.5)
    liar = threading.Thread(target=lambda: (trickle(tx, _honest(TENSOR, "sum", 0)[:30]), tx.close()))
    liar.start()
    with pytest.raises(Lost) as err:
        receiver.sum(TENSOR, [0, 1])
    assert err.value.timed_out and err.value.peer == 1, err.value.how
    liar.join(10)
    receiver.close()
    for sock in (tx, back_rx):
        sock.close()


@pytest.fixture
def store() -> BoundStore:
    return BoundStore("127.0.0.1", 10)


def _run_collectives(store_port: int, rank: int, sock: socket.socket) -> RunCollectives:
    """Rank ``rank`` of a D = 2, P = 1 mesh (r0s0, r1s0), reaching the other over ``sock``."""
    health = Health(store_client("127.0.0.1", store_port, 10), MeshShape(2, 1), rank, 0.2, 5.0, "test store")
    peer = 1 - rank
    framed = FramedCollectives(rank, {peer: FramedStream(sock, "out", HEADER_ROOM)},
                               {peer: FramedStream(sock, "in", HEADER_ROOM)})
    return RunCollectives(framed, health, {0: "r0s0", 1: "r1s0"}, [0, 1], deadline_s=10.0)


def _honest_receiver(store_port: int, port: int, said: mp.Queue) -> None:
    """r0s0 in a process of its own: one DP sum with r1s0, whose frame lies."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    collectives = _run_collectives(store_port, 0, sock)
    try:
        collectives.stage_sum(TENSOR.clone(), "the data-parallel all-reduce of stage 0")
        said.put("no refusal")
    except WorkerFailure as err:
        said.put(str(err))


def _undecodable() -> bytes:
    """A frame of the expected size whose header is no header."""
    frame = bytearray(_honest(TENSOR, "sum", 0))
    frame[16:32] = bytes(range(16))
    return bytes(frame)


@pytest.mark.parametrize(("lie", "said"), [
    (_honest(torch.zeros(40 * TENSOR.numel()), "sum", 0), f"a frame of {40 * 1024 + FRAME_OVERHEAD} bytes"),
    (_undecodable(), "a frame that does not decode as its sum #0"),
], ids=["oversized-40x", "undecodable"])
def test_a_lying_dp_contribution_ends_the_run_in_one_line_and_the_receiver_does_not_abort(store, lie, said):
    with socket.create_server(("127.0.0.1", 0)) as server:
        said_q: mp.Queue = mp.get_context("spawn").Queue()
        receiver = mp.get_context("spawn").Process(target=_honest_receiver,
                                                   args=(store.port, server.getsockname()[1], said_q))
        receiver.start()
        server.settimeout(30)
        liar, _ = server.accept()
        liar.sendall(lie * MAX_REFUSED)  # one lie would be passed over: only lies name the sender
        message = said_q.get(timeout=30)
        receiver.join(30)
        liar.close()
    assert receiver.exitcode == 0, receiver.exitcode
    assert message.startswith("worker r1s0 sent a contribution to the data-parallel all-reduce of stage 0 "
                              f"that was refused unread: {MAX_REFUSED} frames in a row"), message
    assert said in message
    assert "\n" not in message and message.endswith("(noticed by r0s0)")
    assert store_client("127.0.0.1", store.port, 10).get("abort").decode() == message  # the run's one line


def _gloo_replica(rank: int, port: int) -> None:
    """The same lie through a gloo all-reduce: rank 1 contributes 40× what rank 0 expects."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    dist.all_reduce(torch.zeros(TENSOR.numel() * (40 if rank == 1 else 1)))
    time.sleep(30)  # stays until the test has seen rank 0 end (then kills it)


def test_over_gloo_the_same_oversized_dp_contribution_aborts_the_receiving_process():
    """The negative control: gloo's all-reduce kills the receiver (SIGABRT in gloo's own thread)."""
    code = gloo_receiver_exit_code(_gloo_replica, receiver=0)
    assert code == -signal.SIGABRT, code


PLACEMENT = """
[mesh]
stages = 2
replicas = 2
[cluster]
coordinator = "alice"
[cluster.hosts.alice]
address = "127.0.0.1"
workers = ["r0s0", "r1s1"]
[cluster.hosts.bob]
address = "127.0.0.2"
workers = ["r0s1", "r1s0"]
"""


def test_trusted_links_auto_is_untrusted_across_machines_and_with_a_verifier(tmp_path):
    def cfg(*overrides, text=None):
        path = None
        if text is not None:
            path = tmp_path / "run.toml"
            path.write_text(text)
        return load_config(path, ["backend=dist", *overrides])

    assert links_trusted(cfg()) and links_of(cfg()) == "collective"  # one machine: today's groups
    assert not links_trusted(cfg(text=PLACEMENT)) and links_of(cfg(text=PLACEMENT)) == "tcp"
    assert not links_trusted(cfg("verify.name=sentinel"))
    assert links_trusted(cfg("verify.name=sentinel", "dist.links=collective"))  # declared trusted
    assert links_trusted(cfg("elastic.enabled=true", "mesh.replicas=2"))  # torchft's groups
    assert links_trusted(cfg("dist.trusted_links=true", text=PLACEMENT))
    untrusted = cfg("dist.trusted_links=false")
    assert not links_trusted(untrusted) and links_of(untrusted) == "tcp"
    for overrides, key in [(["dist.trusted_links=maybe"], "dist.trusted_links"),
                           (["dist.trusted_links=false", "dist.links=collective"], "dist.links"),
                           (["dist.trusted_links=false", "elastic.enabled=true", "mesh.replicas=2"],
                            "dist.trusted_links")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
            cfg(*overrides)
        assert "\n" not in str(err.value)


def test_a_peer_that_closes_its_stream_ends_the_run_naming_it_as_a_lost_connection(store):
    mine, theirs = socket.socketpair()
    collectives = _run_collectives(store.port, 0, mine)
    theirs.close()
    with pytest.raises(WorkerFailure) as err:
        collectives.gather(torch.zeros(1, 3, dtype=torch.float64), "the gather of losses and norms")
    assert str(err.value).startswith("lost the connection to worker r1s0 while "), err.value
    assert str(err.value).endswith("during the gather of losses and norms (noticed by r0s0)")
    assert collectives.peers.refused == {}  # a broken stream is no lie
    collectives.close()


def test_the_collective_deadline_allows_for_an_all_gather_beyond_two_replicas():
    """10 MB of gradients over 10 Mbit/s links, 100 ms: a ring of 4 moves 6 chunks of 2.5 MB (2 s
    each, plus a latency); framed, a replica's uplink carries 3 whole copies (8 s each), once."""
    dist_cfg, link = DistConfig(timeout_s=5.0), LinkProfile(10.0, 100.0)
    ring = derive_deadlines(dist_cfg, link, 0, 0, 10**7, 4)
    framed = derive_deadlines(dist_cfg, link, 0, 0, 10**7, 4, allgather=True)
    assert ring.collective_s == pytest.approx(5.0 + 2 * 6 * 2.1)
    assert framed.collective_s == pytest.approx(5.0 + 2 * (3 * 8.0 + 0.1))
    two = [derive_deadlines(dist_cfg, link, 0, 0, 10**7, 2, allgather=a).collective_s for a in (False, True)]
    assert two[0] == two[1]  # one copy each way: a ring's bytes, and its two latencies allow for one
