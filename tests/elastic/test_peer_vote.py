"""The commit vote over the members' streams and the row agreement reused until a change
(``elastic/peer_vote.py``), in one process: P = 2 × D = 2 members as threads, each with its own
counting client of one HashStore (the run's store), the vote's streams over loopback. Each
step's requests to the store are counted: a steady step makes none."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest
import torch.distributed as dist

from meshlearn.distributed.collectives import Lost
from meshlearn.distributed.streams import PlainConnector
from meshlearn.elastic.control_quorum import CountingStore
from meshlearn.elastic.peer_vote import PeerVote, ReusedRows
from meshlearn.elastic.quorum import CommitVote
from meshlearn.elastic.rows import RowAgreement
from meshlearn.mesh.topology import MeshShape, WorkerId

MESH = MeshShape(replicas=2, stages=2)
MEMBERS = list(MESH.workers())
MEMBERS_BY_STAGE = sorted(MEMBERS, key=lambda w: (w.stage, w.replica))  # an agreement's ``present``


class Member:
    """One stage replica's vote and row agreement, as ``elastic/worker.py`` builds them."""

    def __init__(self, store: dist.Store, me: WorkerId):
        self.me = me
        self.store = CountingStore(dist.PrefixStore("elastic/", store))
        self.steady = True
        # connect_s beyond the threads' join: a vote that waited for it would fail the test
        self.vote = PeerVote(self.store, PlainConnector(self.store, "127.0.0.1"), MESH, me,
                             CommitVote(self.store, MESH.stages, 5.0), collective_s=5.0, connect_s=120.0,
                             steady=lambda: self.steady)
        self.checkpoints: set[int] = set()  # the steps after which it took a checkpoint
        self.rows = ReusedRows(RowAgreement(self.store, MESH.stages, MESH.replicas, 10.0), self.vote,
                               checkpointed=lambda step: step in self.checkpoints)
        self.held = None
        self.log: list[dict] = []  # per step: agreed rows, reused, committed, reuse next, requests

    def step(self, step: int, ok: bool) -> None:
        before = self.store.requests
        agreed = self.rows.agree(step, self.me, MESH.replicas, self.held)
        row = agreed.row_of(self.me)
        self.held = None if row is None else (row, agreed.linked_at[row])  # it links as agreed
        committed = self.vote.decide(step, self.me, MESH.replicas, ok)
        self.log.append({"rows": agreed.rows, "reused": agreed.reused, "committed": committed,
                         "reuse": self.vote.reuse, "requests": self.store.requests - before})


def run_all(members: list[Member], body: Callable[[Member], None]) -> None:
    errors: list[BaseException] = []

    def guarded(m: Member) -> None:
        try:
            body(m)
        except BaseException as err:  # noqa: BLE001 — reported in the test's thread
            errors.append(err)
    threads = [threading.Thread(target=guarded, args=(m,), daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a member did not finish"
    if errors:
        raise errors[0]


@pytest.fixture
def members():
    store = dist.HashStore()
    made = [Member(store, w) for w in MEMBERS]
    yield made
    for m in made:
        m.vote.close()


def steps(members: list[Member], first: int, count: int,
          ok: Callable[[Member, int], bool] = lambda m, s: True) -> None:
    run_all(members, lambda m: [m.step(s, ok(m, s)) for s in range(first, first + count)])


def test_steady_steps_reuse_the_rows_and_vote_with_no_store_request(members):
    steps(members, 0, 5)
    for m in members:
        assert [e["committed"] for e in m.log] == [True] * 5
        assert [e["reused"] for e in m.log] == [False, True, True, True, True]
        assert m.log[0]["requests"] > 0  # the first agreement, and the vote's streams, on the store
        assert [e["requests"] for e in m.log[1:]] == [0] * 4
        assert all(e["rows"] == ((0, 0), (1, 1)) for e in m.log)
        assert m.vote.settled_by_store == 0


def test_one_stage_saying_no_fails_the_step_everywhere_and_the_next_agrees_on_the_store(members):
    steps(members, 0, 4, ok=lambda m, s: not (s == 2 and m.me == WorkerId(1, 1)))
    for m in members:
        assert [e["committed"] for e in m.log] == [True, True, False, True]
        assert [e["reused"] for e in m.log] == [False, True, True, False]
        assert m.log[3]["requests"] > 0 and m.log[2]["requests"] == 0


def test_a_member_not_steady_commits_and_makes_every_member_agree_anew(members):
    def body(m: Member) -> None:
        for s in range(4):
            m.steady = not (s == 1 and m.me == WorkerId(0, 0))  # e.g. its stage flagged a joiner
            m.step(s, True)
    run_all(members, body)
    for m in members:
        assert [e["committed"] for e in m.log] == [True] * 4
        assert [e["reuse"] for e in m.log] == [True, False, True, True]
        assert [e["reused"] for e in m.log] == [False, True, False, True]


def test_the_step_after_a_checkpoint_agrees_on_the_store(members):
    for m in members:
        m.checkpoints.add(1)  # every process checkpoints after the same steps
    steps(members, 0, 4)
    for m in members:
        assert [e["committed"] for e in m.log] == [True] * 4
        assert [e["reused"] for e in m.log] == [False, True, False, True]
        assert [e["requests"] > 0 for e in m.log] == [True, False, True, False]


def test_a_member_that_dies_fails_the_step_in_every_stage_through_the_store(members):
    steps(members, 0, 2)
    dead, live = members[-1], members[:-1]
    dead.vote.close()  # as a SIGKILL: its streams close
    steps(live, 2, 1)
    for m in live:
        assert m.log[2]["committed"] is False and m.log[2]["reuse"] is False
        assert m.vote.settled_by_store == 1
    assert members[0].store.get("pvote/2/decision") == b"00"


def test_a_member_that_loses_round_two_adopts_what_the_others_adopted_without_the_store(members):
    """r1s1 gets every outcome but its last read fails: it goes to the store and proposes the
    outcome of round 1, which the others adopted from the streams: commit in every stage. The
    next step finds its streams closed: it commits nowhere, and the one after agrees on the store."""
    steps(members, 0, 1)
    late = members[-1]
    framed = late.vote.connecting.framed
    real, calls = framed.all_gather, []

    def second_round_lost(*args, **kwargs):
        calls.append(1)
        parts = real(*args, **kwargs)
        if len(calls) == 2:
            raise Lost(0, "while receiving (injected)")
        return parts
    framed.all_gather = second_round_lost
    steps(members, 1, 3)
    for m in members:
        assert [e["committed"] for e in m.log] == [True, True, False, True], m.me
        assert [e["reused"] for e in m.log] == [False, True, True, False]
    assert [m.vote.settled_by_store for m in members] == [1, 1, 1, 2]
    assert late.store.get("pvote/1/decision") == b"11"


def test_a_member_that_dies_before_its_streams_connect_fails_the_step_without_holding_the_others(members):
    """r1s1 reports to a new agreement (so it is in the vote's group) and dies before it connects:
    the others' agreement returns while their streams still connect (in a run the step's pipeline
    goes on meanwhile, instead of waiting for a partner held there past its deadline); once its
    address turns out dead, the step commits nowhere, through the store, long before the connect
    deadline (120 s; the threads are joined within 60)."""
    def body(m: Member) -> None:
        m.steady = False  # the next step agrees on the store
        m.step(0, True)
    run_all(members, body)
    dead, live = members[-1], members[:-1]
    agreed = {}

    def agree(m: Member) -> None:
        if m is dead:
            m.rows.agreement.agree(1, m.me, MESH.replicas, m.held)  # reports, never connects
        else:
            agreed[m.me] = m.rows.agree(1, m.me, MESH.replicas, m.held)
    run_all(members, agree)
    assert all(agreed[m.me].present == tuple(MEMBERS_BY_STAGE) and agreed[m.me].complete for m in live)
    assert all(not m.vote.connecting.wait(0) for m in live)  # still waiting for r1s1's address
    with socket.socket() as closed:  # a port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    dead.store.set(f"pvote-1/{MESH.rank(dead.me)}", f"127.0.0.1:{port}")
    outcomes = {}
    run_all(live, lambda m: outcomes.setdefault(m.me, (m.vote.decide(1, m.me, MESH.replicas, True),
                                                       m.vote.reuse)))
    assert set(outcomes.values()) == {(False, False)}
    assert all(m.vote.settled_by_store == 1 for m in live)
    assert live[0].store.get("pvote/1/decision") == b"00"
