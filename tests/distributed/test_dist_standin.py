"""A pipeline message the transport refuses unread takes its slot as a quarantined stand-in (issue
27): each refused frame carries its slot, the transport hands the driver's stand-in to the main
thread for a training slot only (any other still ends the run naming the sender), and a link whose
messages are all refused ends the run after ``MAX_REFUSED`` in a row. The real processes: a
participant's lies on its pipeline link in a cluster run, ``cluster/test_cluster_insider.py``."""

from __future__ import annotations

import functools
import socket
import threading
from types import SimpleNamespace

import pytest
import torch
from test_dist_streams import LINK, SRC, _dial_raw, _frame, _packed, _receiver, _values
from test_dist_streams import store as store  # the fixture

from meshlearn.compress.codecs import IdentityCodec
from meshlearn.compress.wire_checks import Rejection, WireGuard
from meshlearn.distributed.collectives import MAX_REFUSED
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.health import WorkerFailure
from meshlearn.distributed.pipeline_refusals import PipelineRefusals
from meshlearn.distributed.transport import Forged
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.net.counters import Counters


def test_each_refused_frame_names_its_slot_and_the_main_thread_gets_the_drivers_stand_in(store):
    """A receive posted for step 4: the frames it refuses are its slots 0 and 2; the main thread
    gets what ``stand_in`` makes of each, and the honest message between them as it came."""
    peers: list[socket.socket] = []
    dialer = threading.Thread(target=lambda: peers.append(_dial_raw(store.port)))
    dialer.start()
    transport, _ = _receiver(store, store.port)
    dialer.join()
    stood_in: list[Forged] = []

    def stand_in(forged: Forged) -> Message:
        stood_in.append(forged)
        return Message("act", forged.step, forged.index, SRC, LINK[1], _values(1, 0), skip=True, link=LINK)

    transport.stand_in = stand_in
    transport.expect(SRC, 3, capacity=0, step=4)
    lie = _frame(10, (1 << 20) + 1, 7)  # beyond the receiver's bound
    honest = _packed(Message("act", 4, 1, SRC, LINK[1], _values(3, 1)))
    peers[0].sendall(lie + honest + lie)
    got = [transport.next_message("an activation", SRC) for _ in range(3)]
    assert [(m.step, m.microbatch, m.skip) for m in got] == [(4, 0, True), (4, 1, False), (4, 2, True)]
    assert [(f.step, f.index, f.link) for f in stood_in] == [(4, 0, LINK), (4, 2, LINK)]
    assert "a frame of" in stood_in[0].reason
    peers[0].close()
    transport.close()


def test_a_refused_frame_of_no_training_step_still_ends_the_run_naming_its_sender(store):
    """A receive posted without a step (a validation batch's, a control message's) has no slot a
    stand-in could take: the run ends in one line naming the sender, as before."""
    peers: list[socket.socket] = []
    dialer = threading.Thread(target=lambda: peers.append(_dial_raw(store.port)))
    dialer.start()
    transport, health = _receiver(store, store.port)
    dialer.join()
    transport.stand_in = lambda forged: pytest.fail("no stand-in outside a training step")
    transport.expect(SRC, 1, capacity=0)
    peers[0].sendall(_frame(10, (1 << 20) + 1, 7))
    with pytest.raises(WorkerFailure, match="worker r0s0 sent a message that was refused unread: a frame of"):
        transport.next_message("a validation activation", SRC)
    peers[0].close()
    transport.close()


def test_a_link_whose_messages_are_all_refused_ends_the_run_naming_its_sender_after_max_refused():
    """Counted under the sender's identity each time; one accepted message starts the count again;
    ``MAX_REFUSED`` in a row on one link end the run, naming the worker and the last reason."""
    me, up, down = WorkerId(0, 1), WorkerId(0, 0), WorkerId(0, 2)
    health = SimpleNamespace(abort=lambda message: message)
    counters = Counters()
    refusals = PipelineRefusals(str(me), health, counters, {(up, me): "bob", (down, me): "alice"})

    def refuse(src: WorkerId, n: int) -> None:
        for _ in range(n):
            refusals.refused((src, me), Rejection(0, "act", 0, src, me, "oversized: 9 bytes"))

    refuse(up, MAX_REFUSED - 1)
    refusals.accepted((up, me))
    refuse(up, MAX_REFUSED - 1)
    refuse(down, 1)  # another link's count is its own
    assert counters.as_dict() == {"message_refused": 2 * MAX_REFUSED - 1}
    assert counters.by_sender() == {"alice": 1, "bob": 2 * MAX_REFUSED - 2}
    with pytest.raises(WorkerFailure, match=f"worker r0s0 sent {MAX_REFUSED} pipeline messages in a row that "
                                            r"were refused \(the last: oversized: 9 bytes\)"):
        refuse(up, 1)
    assert "r0s0->r0s1 (host bob), act 0 of step 1: oversized: 9 bytes" in counters.recent()[-1]


def test_a_message_in_another_s_slot_is_refused_and_its_stand_in_fills_the_slot_where_it_arrived():
    """Where a message arrived (the n-th of the receive posted for its step) says which microbatch
    it must be. A replay of the step before, a header naming the other microbatch, and a pipeline
    message labelled "dp" are each refused by the receiver's guard, and the stand-in takes the
    slot's (step, microbatch), whatever the header said: the receiver never waits for a slot the
    lie took. An honest message is accepted as it is."""
    me, up = WorkerId(0, 1), WorkerId(0, 0)
    shape = (1, 2, 3)
    guard = WireGuard(IdentityCodec(), seq_len=shape[1], d_model=shape[2], vocab_size=8)
    worker = SimpleNamespace(id=me, guard=guard, work={3: SimpleNamespace(microbatch_size=1)},
                             microbatches=2, context=lambda kind, j, arriving: None)
    received: list[Message] = []
    worker.admit = functools.partial(Worker.admit, worker)
    worker.receive = received.append
    driver = DistDriver.__new__(DistDriver)
    driver.me, driver.worker, driver.mesh = me, worker, MeshShape(1, 3)
    driver.cfg = SimpleNamespace(mesh=SimpleNamespace(schedule="gpipe", microbatches=2))
    driver.health = SimpleNamespace(abort=lambda message: message)
    driver.refusals = PipelineRefusals(str(me), driver.health, Counters(), {})

    def arrival(kind: str, step: int, microbatch: int, n: int) -> Message:
        message = Message(kind, step, microbatch, up, me, IdentityCodec().encode(torch.ones(shape), "act"))
        message.link, message.arrival = (up, me), (3, n)  # as the transport marks it
        return message

    for kind, step, microbatch, n in (("act", 2, 0, 0), ("act", 3, 0, 1), ("dp", 3, 0, 0), ("act", 3, 1, 1)):
        driver._deliver(arrival(kind, step, microbatch, n))
    assert [(m.kind, m.step, m.microbatch, m.skip) for m in received] == [
        ("act", 3, 0, True), ("act", 3, 1, True), ("act", 3, 0, True), ("act", 3, 1, False)]
    assert all(not m.payload.tensors["values"].any() for m in received[:3])  # the stand-ins' zeros
    reasons = [line.split(": ", 1)[1] for line in driver.refusals.counters.recent()]
    assert [r.split(": ")[1] for r in reasons] == ["stale step", "microbatch", "kind"], reasons
