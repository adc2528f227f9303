"""The coordinator's eye on slots held on other machines (``elastic/remote.py``): a slot is lost
with its machine only once its heartbeat has moved in the current generation and then stood still
beyond the limit, and never once its process said it finished; a new holder starts afresh. And a
claim's value names its host, whose pid only that host watches."""

from __future__ import annotations

import torch.distributed as dist

from meshlearn.elastic.remote import ClusterWatch, Lapses, claimant


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slot_is_lost_only_after_it_beat_and_then_stood_still_beyond_the_limit() -> None:
    store, clock = dist.HashStore(), Clock()
    lapses = Lapses(store, {"r0s1": 1, "r1s0": 2}, dead_after_s=10.0, clock=clock)
    assert lapses.lapsed("r0s1", 0) is None  # first look
    clock.now = 30.0
    assert lapses.lapsed("r0s1", 0) is None  # never beat in this generation: still starting
    store.add("hb/1", 1)
    assert lapses.lapsed("r0s1", 0) is None  # it beats
    clock.now = 39.0
    assert lapses.lapsed("r0s1", 0) is None  # 9 s of silence: within the limit
    clock.now = 41.0
    assert lapses.lapsed("r0s1", 0) == 11.0  # lost
    assert lapses.lapsed("r0s1", 1) is None  # a joiner holds it now: its counter goes on from 1
    clock.now = 60.0
    assert lapses.lapsed("r0s1", 1) is None  # the joiner has not beaten yet
    store.add("hb/2", 1)
    assert lapses.lapsed("r1s0", 0) is None
    store.add("hb/2", 1)
    assert lapses.lapsed("r1s0", 0) is None
    store.set("done/2", "1")  # it finished: its host says how it ended, not the silence
    clock.now = 100.0
    assert lapses.lapsed("r1s0", 0) is None


def test_a_claim_names_the_host_whose_launcher_watches_its_pid() -> None:
    watch = ClusterWatch("alice", ("r0s1",), coordinator=True)
    assert claimant("alice:42", watch) == ("alice", 42)
    assert claimant("bob:42", watch) == ("bob", None)  # bob's launcher watches it
    assert claimant("42", None) == (None, 42)  # one machine: the launcher watches every joiner
