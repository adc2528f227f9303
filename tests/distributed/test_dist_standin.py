"""A pipeline message the transport refuses unread takes its slot as a quarantined stand-in (issue
27): each refused frame carries its slot, the transport hands the driver's stand-in to the main
thread for a training slot only (any other still ends the run naming the sender), and a link whose
messages are all refused ends the run after ``MAX_REFUSED`` in a row. The real processes: a
participant's lies on its pipeline link in a cluster run, ``cluster/test_cluster_insider.py``."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
from test_dist_streams import LINK, SRC, _dial_raw, _frame, _packed, _receiver, _values
from test_dist_streams import store as store  # the fixture

from meshlearn.compress.wire_checks import Rejection
from meshlearn.distributed.collectives import MAX_REFUSED
from meshlearn.distributed.health import WorkerFailure
from meshlearn.distributed.refusals import PipelineRefusals
from meshlearn.distributed.transport import Forged
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
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
