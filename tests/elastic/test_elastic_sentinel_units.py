"""The pieces of SENTINEL under elastic membership, without processes: the verifier's per-link step
count over the agreed rows, the relay's hop order, the row agreement's evicted rows, the eviction
of a banned worker's row, and the refusals of a banned identity, of joiners and of --resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from in_threads import in_threads
from tiny import tiny_config

from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.health import EXIT_EVICTED, EXIT_LEFT, Health
from meshlearn.distributed.verifier import Slots
from meshlearn.elastic.evictions import (
    Evicted,
    Evictions,
    evicted_key,
    refuse_banned,
    refuse_join_when_verified,
)
from meshlearn.elastic.links import hops
from meshlearn.elastic.membership import banned_key
from meshlearn.elastic.rows import RowAgreement
from meshlearn.entry.launch import launch_local
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.report.progress import format_event
from meshlearn.verify.boundary import BoundaryVerifier
from meshlearn.verify.ledger import Ban
from meshlearn.verify.settings import VerifyConfig
from meshlearn.verify.trust import TrustLayer

VERIFIED = ["backend=dist", "model.n_layer=3", "mesh.stages=3", "mesh.replicas=3", "train.batch_size=12",
            "elastic.enabled=true", "verify.name=sentinel", "verify.warmup_steps=3"]
BAN = Ban(WorkerId(1, 1), 5, "norm", "s1|s2", "act", 3)


def test_a_links_steps_skip_those_its_row_did_not_train():
    """Row 1 is out of step 1 (it was not in every stage's quorum): its next messages are step 2's."""
    rows = {0: (0, 1), 1: (0,), 2: (0, 1), 3: (0, 1)}
    row0, row1 = (WorkerId(0, 0), WorkerId(0, 1)), (WorkerId(1, 0), WorkerId(1, 1))
    slots = Slots([row0, row1], microbatches=2, trains=lambda step, replica: replica in rows[step])
    assert [slots.next(row0) for _ in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [slots.next(row1) for _ in range(4)] == [0, 0, 2, 2]
    slots.expect_evaluation(1, rows=(0, 1))  # elastic: every row that trains evaluates
    assert [slots.next(row1), slots.next(row1), slots.next(row0)] == [None, 3, None]
    slots.restart(2)
    assert [slots.next(row1) for _ in range(3)] == [2, 2, 3]


def test_the_relays_hops_are_each_workers_own_order():
    """A worker meets only the verifier, upstream neighbour first; the verifier goes through the
    workers in rank order, each through its own hops (so nobody waits on a third process)."""
    mesh = MeshShape(2, 3)
    a, b, c = (WorkerId(0, s) for s in range(3))
    assert hops(mesh, a) == [((a, b), "in"), ((b, a), "out")]
    assert hops(mesh, b) == [((a, b), "out"), ((b, a), "in"), ((b, c), "in"), ((c, b), "out")]
    assert hops(mesh, c) == [((b, c), "out"), ((c, b), "in")]
    every = [hop for w in mesh.workers() for hop in hops(mesh, w)]
    assert len(every) == len(set(every)) == 2 * 2 * 2 * 2  # each link's in and out hop, once


def test_an_evicted_row_is_never_agreed_again_whatever_its_processes_do():
    store = BoundStore("127.0.0.1", 10).store
    store.set(evicted_key(1), "r1s1")  # the verifier, before the verdict
    results = in_threads(  # every replica of both stages asks, the evicted row's too
        lambda wid: RowAgreement(store, 2, 3, 5.0, repair=False, evictions=True).agree(6, wid, 3, None).rows,
        [WorkerId(r, s) for r in range(3) for s in range(2)])
    assert set(results.values()) == {((0, 0), (2, 2))}


class _Driver(Evictions):
    def __init__(self, me: WorkerId):
        self.me = me
        self.evicted, self.leaving = {}, None


def test_a_ban_makes_the_banned_worker_and_its_row_leave_and_the_others_stop_waiting_for_it(tiny_corpus):
    banned, partner, other = _Driver(WorkerId(1, 1)), _Driver(WorkerId(1, 2)), _Driver(WorkerId(0, 1))
    for driver in (banned, partner, other):
        driver.evict(BAN)
    assert isinstance(banned.leaving, Evicted) and banned.leaving.exit_code == EXIT_EVICTED
    assert str(banned.leaving).startswith("evicted: banned by SENTINEL at step 6 (s1|s2 act norm, 3 strikes)")
    assert partner.leaving.exit_code == EXIT_LEFT and "row's r1s1 was banned" in str(partner.leaving)
    assert other.leaving is None and other.evicted == {WorkerId(1, 1): 5}
    # The trust layer's record of the ban: an eviction, nobody's state copied.
    cfg = tiny_config(tiny_corpus, *VERIFIED, "attack.kind=zeros", "attack.workers=r1s1",
                      "attack.start_step=4")
    trust = TrustLayer(cfg, {})
    trust.driver = other
    entry = trust._carry_out(BAN)
    assert entry["evicted"] and entry["replaced_from"] is None and not entry["honest"]
    assert format_event(entry).endswith("banned r1s1 (norm on act, 3 strikes); evicted: its row leaves")


def test_the_fixed_drivers_truth_exchange_skips_attackers_evicted_before_the_step():
    seen = []

    class Base:
        def exchange_truth(self, step, local, attackers):
            seen.append(list(attackers))
            return local

    class Driver(Evictions, Base):
        pass

    driver = Driver()
    driver.evicted = {WorkerId(1, 1): 5}
    driver.verdicts = object()  # a verifier's board (``setup_verification``'s with SENTINEL)
    attackers = [WorkerId(1, 1), WorkerId(2, 1)]
    driver.exchange_truth(5, {}, attackers)  # its last step: it sent its truth of it
    driver.exchange_truth(6, {}, attackers)  # gone
    assert seen == [attackers, [WorkerId(2, 1)]]
    driver.verdicts = None  # no verifier (a DP attack under control membership): nothing crosses
    assert driver.exchange_truth(7, {WorkerId(2, 1): {1}}, attackers) == {WorkerId(2, 1): {1}}
    assert len(seen) == 2


def test_a_banned_identity_is_refused_in_one_line_and_a_new_generation_is_not():
    store = BoundStore("127.0.0.1", 10).store
    ban = {"step": 5, "reason": "banned by SENTINEL at step 6 (x)"}
    store.set(banned_key(WorkerId(1, 1), 0), json.dumps(ban))
    with pytest.raises(ConfigError) as err:
        refuse_banned(store, WorkerId(1, 1), 0)
    assert str(err.value) == ("MESHLEARN_GENERATION = 0: the identity r1s1.0 (slot r1s1, generation 0) was "
                              "banned by SENTINEL at step 6 (x): it cannot rejoin; the slot stays closed "
                              "for the rest of the run")
    refuse_banned(store, WorkerId(1, 1), 1)  # another identity
    refuse_banned(store, WorkerId(0, 1), 0)


def test_a_verified_elastic_run_refuses_joiners_and_resume_but_not_its_config(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, *VERIFIED)  # validates: SENTINEL is allowed under elastic now
    with pytest.raises(ConfigError, match="--join = '127.0.0.1:1': the run verifies"):
        refuse_join_when_verified(cfg, "127.0.0.1:1")
    refuse_join_when_verified(tiny_config(tiny_corpus, *VERIFIED, "verify.name=none"), "127.0.0.1:1")
    with pytest.raises(ConfigError, match="an elastic run with SENTINEL cannot resume yet"):
        launch_local(["--resume", str(tmp_path)], cfg, tmp_path)  # before any process starts
    assert not (tmp_path / "logs").exists()


def test_the_sanity_shape_is_a_samples_so_a_changed_row_count_is_no_flag():
    """Under elastic membership the sequences per microbatch follow the rows that train a step;
    the wire guard checks them against the step's layout, the verifier a sample's shape."""
    verifier = BoundaryVerifier(VerifyConfig(name="sentinel"), beta=0.9)
    verifier.shape = (2, 16, 32)
    assert verifier.sanity(torch.ones(3, 16, 32), 1.0) == ""
    assert verifier.sanity(torch.ones(2, 16, 31), 1.0) == "shape"


def test_the_verifier_watches_the_workers_once_its_links_are_built(tiny_corpus, monkeypatch):
    """No world group synchronizes an elastic start: the verifier ignores the workers' heartbeats
    (a slow start is no death) until ``elastic_relay`` has met every one of them."""
    import meshlearn.elastic.evictions as evictions

    mesh, store = MeshShape(3, 3), BoundStore("127.0.0.1", 10).store
    health = Health(store, mesh, mesh.world_size, heartbeat_s=0.05, dead_after_s=1.0,
                    store_owner="the test's store", world=mesh.world_size + 1)
    health.ignore(set(range(mesh.world_size)))  # as start_session does for the elastic verifier
    assert not any(health._watched(r) for r in range(mesh.world_size))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(evictions, "store_client", lambda *args: store)
    monkeypatch.setattr(evictions, "verifier_links", lambda *args: {})  # every worker met
    evictions.elastic_relay(tiny_config(tiny_corpus, *VERIFIED), SimpleNamespace(health=health, mesh=mesh))
    assert all(health._watched(r) for r in range(mesh.world_size + 1))
