"""Re-linking a pipeline row is agreed, never decided by one end alone (real store, real gloo pair
groups, in threads): a member whose links its partner dropped (a one-sided break) links anew at
the same step as the partner; a partner that died after asking for the quorum is found by the
heartbeat watch while linking, not at the rendezvous's timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.health import Health, RowBroken
from meshlearn.elastic.binding import interface_of
from meshlearn.elastic.links import RowLinks
from meshlearn.elastic.rows import Agreed, RowAgreement, link_step
from meshlearn.mesh.topology import MeshShape, WorkerId

MESH = MeshShape(1, 2)  # one row of two stages
FIRST, LAST = WorkerId(0, 0), WorkerId(0, 1)
ROW = (0, 0)  # that row
ROW3 = (0, 0, 0)


@pytest.mark.parametrize(("reports", "expected"), [
    ([(ROW3, 2)] * 3, 2),                          # every member holds the row's links of step 2: kept
    ([(ROW3, 2), None, (ROW3, 2)], 7),              # the middle dropped its links alone: all link anew
    ([(ROW3, 2), (ROW3, 5), (ROW3, 5)], 7),          # links of different builds (one re-linked alone)
    ([((1, 0, 0), 2), (ROW3, 2), (ROW3, 2)], 7),    # one holds another row's links (it was re-paired)
    ([((0, 1, 1), 2)] * 3, 7),                    # links of another row than this one
    ([None] * 3, 7)])                             # nobody holds links: the row's first step, or a joiner
def test_a_row_keeps_its_links_only_if_every_member_holds_the_same(reports, expected):
    assert link_step(7, ROW3, reports) == expected


def test_every_member_of_a_row_reads_the_same_plan_from_the_agreement():
    row = (0, 0)
    agreed = Agreed(rows=(row,), linked_at={row: 7})
    assert agreed.plan(FIRST, (row, 2)) == (True, 7)      # it held older links: drops them, links at 7
    assert agreed.plan(FIRST, None) == (False, 7)         # it held none: links at 7
    assert agreed.plan(LAST, (row, 7)) == (False, None)   # it holds the agreed links: keeps them
    assert agreed.plan(FIRST, ((0, 1), 7)) == (True, 7)   # another row's links of that step: anew
    assert agreed.plan(WorkerId(1, 0), ((1, 1), 3)) == (True, None)  # in no row: drops what it holds
    assert agreed.plan(WorkerId(1, 0), None) == (False, None)


def _store() -> BoundStore:
    """The run's store; every member talks to it through a client of its own, as a process does
    (one client's blocking wait would hold up another thread's requests)."""
    bound = BoundStore("127.0.0.1", 10)
    for wid in (FIRST, LAST):
        bound.store.set(f"elastic/gen/{wid}", "0")
    return bound


def _client(bound: BoundStore) -> dist.Store:
    return dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=10))


def _links(store, me: WorkerId, timeout_s: float = 10.0) -> RowLinks:
    return RowLinks(store, MESH, me, 0, interface_of("127.0.0.1"), timeout_s)


def _step(bound: BoundStore, step: int, held: dict[WorkerId, int | None]) -> dict[WorkerId, tuple]:
    """(``held``: the step of the row's links each member holds, None: none.)"""
    """Both members of the row in one step, as the driver runs it: the agreement (each reports the
    links it holds), the plan, the links built where the plan says; then one tensor crosses the
    link from the first stage to the last. Returns each member's (agreed, plan, received)."""
    out: dict[WorkerId, tuple] = {}
    errors: list[BaseException] = []

    def member(me: WorkerId) -> None:
        try:
            store = _client(bound)
            agreement = RowAgreement(dist.PrefixStore("elastic/", store), 2, 1, 10.0)
            mine = None if held[me] is None else (ROW, held[me])
            agreed = agreement.agree(step, me, 1, mine)
            plan = agreed.plan(me, mine)
            received = None
            if plan[1] is not None:
                groups = _links(store, me).build(plan[1], agreed.row_of(me), lambda: None)
                buffer = torch.full((4,), float(step)) if me == FIRST else torch.zeros(4)
                group = groups[(FIRST, LAST)]
                op = dist.isend if me == FIRST else dist.irecv
                kwargs = {"group_dst": group.peer} if me == FIRST else {"group_src": group.peer}
                op(buffer, group=group.pg, **kwargs).wait()
                received = buffer.tolist()
            out[me] = (agreed, plan, received)
        except BaseException as err:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=member, args=(w,)) for w in (FIRST, LAST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_a_one_sided_break_makes_both_ends_link_anew_at_the_same_step():
    """Step 0 links the row; step 1 keeps the links; before step 2 the last stage dropped its
    links alone (it saw its partner's link close, or found it silent; the first stage saw
    nothing). Decided per worker, the first stage would keep its links and the last would wait
    on a rendezvous nobody comes to; agreed, both link anew at step 2 and the link carries."""
    bound = _store()
    first = _step(bound, 0, {FIRST: None, LAST: None})
    assert {a.linked_at[ROW] for a, _, _ in first.values()} == {0}
    assert first[LAST][2] == [0.0] * 4
    kept = _step(bound, 1, {FIRST: 0, LAST: 0})
    assert all(plan == (False, None) for _, plan, _ in kept.values())
    relinked = _step(bound, 2, {FIRST: 0, LAST: None})  # the one-sided break
    assert relinked[FIRST][1] == (True, 2) and relinked[LAST][1] == (False, 2)
    assert relinked[LAST][2] == [2.0] * 4  # both ends built the same new link


def test_linking_with_a_partner_that_died_breaks_the_row_by_its_heartbeat():
    """The partner asked for the quorum, so the row was agreed, then died: the rendezvous waits
    for it while the row's heartbeat watch runs, and ends with RowBroken naming it (the worker
    stays and spectates), not with the rendezvous's timeout (which would end the process)."""
    store = _store().store
    health = Health(store, MESH, 0, heartbeat_s=0.01, dead_after_s=0.2, store_owner="the test's store",
                    grace_s=0.0, scope={0, 1})  # rank 1, r0s1, never beats
    health.start()
    try:
        with pytest.raises(RowBroken, match="worker r0s1 stopped answering"):
            _links(store, FIRST, timeout_s=30.0).build(3, ROW, health.check)
    finally:
        health.stop()


def test_a_partner_that_drops_the_rows_links_alone_breaks_the_row_at_the_others():
    """A member that drops the row's links (here: it found another partner dead) says why under
    the links' key; a partner still holding them — perhaps waiting on a link that will stay
    silent — reads it with the heartbeats: RowBroken with that reason, and only for the links it
    follows (after ``forget_row`` and for other links' keys, nothing)."""
    bound = _store()
    links = {w: _links(_client(bound), w) for w in (FIRST, LAST)}
    key = links[LAST].dropped_key(ROW, 4)
    assert key == links[FIRST].dropped_key(ROW, 4)  # the row's own, per link step
    bound.store.set(key, "")
    health = Health(_client(bound), MESH, 1, heartbeat_s=0.01, dead_after_s=60.0,
                    store_owner="the test's store", grace_s=0.0, scope={0, 1})
    health.start()
    try:
        health.follow(key)
        links[FIRST].drop(ROW, 3, "an older build's links")  # not the links it follows: nothing
        links[FIRST].drop(ROW, 4, "worker r0s2 stopped answering")
        deadline = time.monotonic() + 10
        while health.row_broken is None:
            assert time.monotonic() < deadline, "the partner's note was not read"
            time.sleep(0.01)
        with pytest.raises(RowBroken, match=r"worker r0s0 dropped its row's links \(worker r0s2 stopped"):
            health.check()
        health.forget_row()
        time.sleep(0.1)  # rounds of the monitor: the key is no longer followed
        health.check()
    finally:
        health.stop()
