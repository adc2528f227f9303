"""A worker's last step set on the run's store off the step's path (``elastic/progress.py``): the
step does not wait for the store, the newest count is the one that ends up set, a failed set is
raised in the worker's thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from meshlearn.distributed.health import EXIT_EVICTED
from meshlearn.elastic.evictions import Evicted, Evictions
from meshlearn.elastic.progress import ProgressBeacon

KEY = "progress/r1s0"


class GatedStore:
    """A HashStore whose ``set`` waits until the test opens the gate (a store across a slow link);
    ``entered`` is set when a set has started."""

    def __init__(self, fail: bool = False):
        self.store = dist.HashStore()
        self.values: list[str] = []  # every value set, in order
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.fail = fail

    def set(self, key: str, value: str) -> None:
        self.entered.set()
        self.gate.wait()
        if self.fail:
            raise ConnectionError("the coordinator's store is gone")
        self.store.set(key, value)
        self.values.append(value)


def test_a_step_does_not_wait_for_the_store_and_the_newest_count_is_set():
    store = GatedStore()
    beacon = ProgressBeacon(store, KEY)
    beacon.report(1)
    assert store.entered.wait(10)  # the thread is in the set of 1, held by the gate
    for count in (2, 3, 4):  # each returns while the store holds that set: the step goes on
        beacon.report(count)
    assert store.values == []
    store.gate.set()
    beacon.close(10)
    assert store.store.get(KEY) == b"4"
    assert store.values == ["1", "4"]  # the counts reported during a set are not sent one by one
    assert not beacon.thread.is_alive()


def test_close_without_a_report_sets_nothing():
    store = GatedStore()
    ProgressBeacon(store, KEY).close(10)
    assert not store.entered.is_set()


def test_a_failed_set_is_raised_in_the_step_after_it():
    store = GatedStore(fail=True)
    store.gate.set()
    beacon = ProgressBeacon(store, KEY)
    beacon.report(1)
    beacon.thread.join(10)  # the set failed: the thread ended
    with pytest.raises(RuntimeError, match="progress/r1s0 on the run's store failed: ConnectionError"):
        beacon.report(2)
    with pytest.raises(RuntimeError, match="the coordinator's store is gone"):
        beacon.close(10)


def test_close_names_a_set_that_stays_in_flight():
    store = GatedStore()
    beacon = ProgressBeacon(store, KEY)
    beacon.report(7)
    assert store.entered.wait(10)
    with pytest.raises(TimeoutError, match="progress/r1s0 = 7 was not set on the run's store within 0.01 s"):
        beacon.close(0.01)
    store.gate.set()
    beacon.thread.join(10)


def test_an_evicted_worker_sets_its_last_step_before_it_leaves():
    """A banned worker (or a partner of its row) leaves before its next step and its process ends
    at once (``os._exit``): its last count is on the store by then, not still in the thread, so
    workers.json says it left after its last step (tests/elastic/test_elastic_sentinel.py)."""
    store = dist.HashStore()
    beacon = ProgressBeacon(store, KEY)
    beacon.report(5)
    leaving = Evicted("evicted: banned by SENTINEL; left its stage's quorum", EXIT_EVICTED)
    driver = SimpleNamespace(leaving=leaving, records=SimpleNamespace(pending={}), beacon=beacon,
                             quorum=SimpleNamespace(shutdown=lambda: None),
                             health=SimpleNamespace(finish=lambda: None),
                             deadlines=SimpleNamespace(collective_s=10.0))
    with pytest.raises(Evicted):
        Evictions.check_eviction(driver)
    assert not beacon.thread.is_alive() and store.get(KEY) == b"5"
