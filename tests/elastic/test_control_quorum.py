"""The stage membership on the run's store (``elastic/control_quorum.py``), in one process: each
member a thread with its own store clients (a HashStore stands in for the run's), its sums over
loopback streams. The test plays the commit vote (a step commits when every member's sums went
through) and each member's weights (its running sum), so healing and the sums are checked bit
for bit, and each step's requests to the store are counted."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshlearn.distributed.streams import PlainConnector
from meshlearn.elastic.control_quorum import ControlQuorum, CountingStore
from meshlearn.elastic.settings import ElasticTimeouts
from meshlearn.mesh.topology import MeshShape, WorkerId

TIMEOUTS = ElasticTimeouts(heartbeat_s=0.5, join_s=0.5, quorum_s=20.0, collective_s=10.0)
MESH = MeshShape(replicas=3, stages=1)


class Vote:
    """Step ``q`` commits once every participant voted yes; one "no" fails it."""

    def __init__(self):
        self.cond = threading.Condition()
        self.votes: dict[int, list[bool]] = {}

    def decide(self, q: int, participants: int, ok: bool) -> bool:
        with self.cond:
            self.votes.setdefault(q, []).append(ok)
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: not all(self.votes[q]) or len(self.votes[q]) >= participants,
                                      timeout=30)
            return all(self.votes[q])


class Member:
    """One stage replica: its weights ``w`` move by the stage's sum of its contributions."""

    def __init__(self, store: dist.Store, replica: int, vote: Vote, joining: bool = False,
                 timeouts: ElasticTimeouts = TIMEOUTS):
        self.me = WorkerId(replica, 0)
        self.w = torch.full((3,), 0.25, dtype=torch.float32)
        self.vote = vote
        self.steps: list[tuple[int, int, int | None, bool]] = []  # (q, participants, requests, committed)
        counting = CountingStore(dist.PrefixStore("s0", store))
        self.quorum = ControlQuorum(MESH, self.me, f"{self.me}.0", counting, dist.PrefixStore("s0", store),
                                    PlainConnector(counting, "127.0.0.1"), timeouts, 1,
                                    lambda: {"w": self.w.clone()}, self._load, joining)
        self.healed_from: torch.Tensor | None = None
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _load(self, state: dict) -> None:
        self.healed_from = state["w"].clone()
        self.w = state["w"].clone()

    def step(self) -> None:
        current = self.quorum.begin()
        q = self.quorum.q - 1
        flat = torch.tensor([1.0 + self.me.replica, 0.5, 0.125 * q], dtype=torch.float32)
        ok = self.quorum.sum(flat) and self.quorum.should_commit()
        committed = self.vote.decide(q, current.participants, ok)
        self.quorum.settled(committed)
        if committed:
            self.w = self.w + flat
        self.steps.append((q, current.participants, current.requests, committed))

    def run(self, until) -> threading.Thread:
        def body():
            try:
                while not until(self):
                    self.step()
            except BaseException as err:  # noqa: BLE001 — the test's thread reports it
                self.error = err
        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread


def _join(threads: list[threading.Thread], members: list[Member]) -> None:
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a member did not finish"
    for m in members:
        if m.error is not None:
            raise m.error


@pytest.fixture
def store():
    return dist.HashStore()


def test_a_stage_that_does_not_change_sends_nothing_to_the_store_after_its_first_quorum(store):
    vote = Vote()
    a, b = Member(store, 0, vote), Member(store, 1, vote)
    try:
        _join([m.run(lambda m: len(m.steps) == 6) for m in (a, b)], [a, b])
        for m in (a, b):
            assert [s[1] for s in m.steps] == [2] * 6
            assert all(s[3] for s in m.steps)
            assert m.steps[0][2] > 0  # the first record is formed on the store
            assert [s[2] for s in m.steps[1:]] == [0] * 5  # then: no request per step
            assert m.quorum.formed == 1
        assert torch.equal(a.w, b.w)
        expected = torch.full((3,), 0.25)
        for q in range(6):
            expected = expected + (torch.tensor([1.0, 0.5, 0.125 * q]) + torch.tensor([2.0, 0.5, 0.125 * q]))
        assert torch.equal(a.w, expected)
    finally:
        for m in (a, b):
            m.quorum.shutdown()


def test_a_joiner_is_admitted_at_one_step_healed_bit_for_bit_and_sums_with_the_others(store):
    vote = Vote()
    a, b = Member(store, 0, vote), Member(store, 1, vote)
    joiner: list[Member] = []
    try:
        first = [m.run(lambda m: len(m.steps) == 3) for m in (a, b)]
        _join(first, [a, b])
        joiner.append(Member(store, 2, vote, joining=True))
        c = joiner[0]

        def three_after_join(m: Member) -> bool:
            return len(m.steps) >= 3 and m.steps[-3][1] == 3
        _join([m.run(three_after_join) for m in (a, b, c)], [a, b, c])
        joined_q = c.steps[0][0]
        assert c.healed_from is not None
        donor_w = torch.full((3,), 0.25)  # a's weights before quorum joined_q: every committed step's sum
        for q, _, _, committed in a.steps:
            if q < joined_q and committed:
                donor_w = donor_w + torch.tensor([1.0, 0.5, 0.125 * q]) + torch.tensor([2.0, 0.5, 0.125 * q])
        assert torch.equal(c.healed_from, donor_w)
        assert torch.equal(a.w, b.w) and torch.equal(a.w, c.w)  # bit for bit after the joined steps
        for m in (a, b):
            by_q = {q: (n, r) for q, n, r, _ in m.steps}
            assert by_q[joined_q][0] == 3 and by_q[joined_q - 1][0] == 2
            assert by_q[joined_q][1] > 0  # the slow path: the record naming the joiner
            # the first quorum and the joiner's: every other step sent nothing to the store
            assert m.quorum.formed == 2
            assert sum(1 for _, _, r, _ in m.steps if r) == 2
    finally:
        for m in (a, b, *joiner):
            m.quorum.shutdown()


def test_a_member_that_dies_fails_one_step_and_is_dropped_once_its_heartbeat_lapses(store):
    vote = Vote()
    members = [Member(store, r, vote) for r in range(3)]
    a, b, c = members
    try:
        _join([m.run(lambda m: len(m.steps) == 3) for m in members], members)
        c.quorum.shutdown()  # as a SIGKILL: its heartbeat stops and its streams close

        def two_after_drop(m: Member) -> bool:
            return len(m.steps) >= 2 and m.steps[-2][1] == 2
        _join([m.run(two_after_drop) for m in (a, b)], [a, b])
        for m in (a, b):
            outcomes = [(n, committed) for _, n, _, committed in m.steps[3:]]
            assert outcomes[0] == (3, False)  # the step it died in commits nowhere
            assert all(o == (2, True) for o in outcomes[1:])
            assert m.quorum.formed == 2
        assert torch.equal(a.w, b.w)
    finally:
        for m in members:
            m.quorum.shutdown()


def test_a_joiner_that_dies_before_it_connects_fails_one_step_and_is_left_out_of_the_next(store):
    """Admitted (its heartbeat had not lapsed yet) but gone: the members' streams never connect,
    that step commits nowhere, no member fails, and the next record is the two of them again."""
    quick = ElasticTimeouts(heartbeat_s=0.5, join_s=0.5, quorum_s=2.0, collective_s=10.0)
    store.set_timeout(timedelta(seconds=quick.quorum_s))  # as the run's client: quorum_s (worker.py)
    vote = Vote()
    a, b = (Member(store, r, vote, timeouts=quick) for r in range(2))
    try:
        _join([m.run(lambda m: len(m.steps) == 2) for m in (a, b)], [a, b])
        gone = Member(store, 2, vote, joining=True, timeouts=quick)
        gone.quorum.shutdown()  # asked to join, then died: it never reads the record that admits it
        def two_steady(m: Member) -> bool:
            return len(m.steps) >= 3 and m.steps[-3][3] is False and m.steps[-1][3]
        _join([m.run(two_steady) for m in (a, b)], [a, b])
        for m in (a, b):
            failed = [s for s in m.steps if not s[3]]
            assert [s[1] for s in failed] == [3]  # the one step whose record named the dead joiner
            assert m.steps[-1][1] == 2 and m.steps[-2][1] == 2
        assert torch.equal(a.w, b.w)
    finally:
        for m in (a, b):
            m.quorum.shutdown()
