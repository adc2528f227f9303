"""Elastic pieces without a training run: config validation, derived timeouts, the listening
addresses of torchft's components (read from /proc), the cross-stage commit vote, the records'
writer of each step."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from in_threads import in_threads
from tiny import tiny_config

from meshlearn.config import load_config
from meshlearn.distributed.health import Health, RowBroken
from meshlearn.elastic.binding import (
    BoundStore,
    bound_process_group,
    check_bound,
    create_manager,
    interface_of,
    start_lighthouse,
)
from meshlearn.elastic.listeners import listening
from meshlearn.elastic.quorum import CommitVote
from meshlearn.elastic.records import ElasticRecords
from meshlearn.elastic.rows import RowAgreement, whole_batch
from meshlearn.elastic.settings import ElasticConfig, derive_timeouts
from meshlearn.errors import ConfigError
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import MeshShape, WorkerId

ELASTIC = ["backend=dist", "mesh.stages=2", "mesh.replicas=2", "elastic.enabled=true"]


@pytest.mark.parametrize(("override", "field"), [
    ("elastic.host=0.0.0.0", "elastic.host"), ("elastic.host=localhost", "elastic.host"),
    ("elastic.min_replicas=3", "elastic.min_replicas"), ("mesh.schedule=async", "mesh.schedule"),
    ("backend=sim", "elastic.enabled"),
    ("elastic.heartbeat_timeout_s=-1", "elastic.heartbeat_timeout_s"),
    ("elastic.membership=lighthouse", "elastic.membership")])
def test_bad_elastic_config_names_the_field(tiny_corpus, override, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *ELASTIC, override)
    assert str(err.value).startswith(f"{field} = ")


def test_sentinel_under_elastic_takes_torchft_membership_only(tiny_corpus):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *ELASTIC, "verify.name=sentinel", "elastic.membership=control")
    assert str(err.value).startswith("elastic.membership = 'control'")


def test_sentinel_under_elastic_takes_all_reduce_only(tiny_corpus):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *ELASTIC, "verify.name=sentinel", "dp.name=diloco")
    assert str(err.value).startswith("dp.name = 'diloco': ") and "verify.name = 'sentinel'" in str(err.value)
    tiny_config(tiny_corpus, *ELASTIC, "dp.name=diloco")  # each alone is allowed


def test_the_batch_must_split_over_any_number_of_rows(tiny_corpus):
    """3 replicas × 2 microbatches: 6 sequences split over 3 rows or 1, not over 2 (2 rows × 2)."""
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *ELASTIC, "mesh.replicas=3", "train.batch_size=6")
    assert str(err.value).startswith("train.batch_size = 6: ") and "k = 2" in str(err.value)


def test_elastic_is_off_by_default_and_timeouts_come_from_the_link():
    cfg = load_config(None, ["link.latency_ms=50", "dist.dead_after_s=4"])
    assert cfg.elastic.enabled is False
    t = derive_timeouts(cfg.elastic, cfg.dist, cfg.link, grad_bytes=4_000_000, replicas=2)
    assert t.heartbeat_s == pytest.approx(4 + 2 * 0.05)  # dead_after + a round trip
    assert t.join_s == t.heartbeat_s and t.quorum_s > t.collective_s > cfg.dist.timeout_s
    set_by_hand = derive_timeouts(ElasticConfig(heartbeat_timeout_s=1.5), cfg.dist, cfg.link)
    assert set_by_hand.heartbeat_ms == 1500


def test_a_plain_tcpstore_listens_everywhere_and_a_bound_one_does_not():
    """Why BoundStore exists: torch's TCPStore server binds [::] whatever host it is given."""
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert ("::", plain.port) in listening(os.getpid())
    bound = BoundStore("127.0.0.1", 10)
    assert ("127.0.0.1", bound.port) in listening(os.getpid())
    del plain
    client = dist.TCPStore("127.0.0.1", bound.port, is_master=False)
    client.set("k", "v")
    assert bound.store.get("k") == b"v"


def test_check_bound_refuses_a_wildcard_listener():
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen(1)
    try:
        with pytest.raises(RuntimeError, match="0.0.0.0"):
            check_bound(os.getpid(), "127.0.0.1", "this test")
    finally:
        sock.close()


def _vote_all(votes: dict[WorkerId, tuple[int, bool]], stages: int, deadline_s: float = 5.0):
    store = BoundStore("127.0.0.1", 10).store
    return in_threads(lambda wid: CommitVote(store, stages, deadline_s).decide(7, wid, *votes[wid]), votes)


def test_a_step_commits_in_every_stage_or_in_none():
    yes = _vote_all({WorkerId(r, s): (2, True) for r in range(2) for s in range(2)}, stages=2)
    assert set(yes.values()) == {True}
    one_no = _vote_all({WorkerId(0, 0): (2, True), WorkerId(1, 0): (2, True),
                        WorkerId(0, 1): (1, False)}, stages=2)  # a dead replica never votes
    assert set(one_no.values()) == {False}


def test_a_stage_without_replicas_stops_the_run_with_its_name():
    vote = CommitVote(BoundStore("127.0.0.1", 10).store, stages=2, deadline_s=0.3)
    with pytest.raises(RuntimeError, match="no replica of stage 1 is left"):
        vote.decide(7, WorkerId(0, 0), 1, True)


def _agree_all(quorums: dict[WorkerId, int], stages: int, replicas: int, deadline_s: float = 5.0):
    store = BoundStore("127.0.0.1", 10).store
    return in_threads(lambda wid: RowAgreement(store, stages, replicas, deadline_s).agree(
        3, wid, quorums[wid], None).rows, quorums)


def test_the_rows_of_a_step_are_those_with_every_stage_in_its_quorum():
    full = _agree_all({WorkerId(r, s): 2 for r in range(2) for s in range(2)}, stages=2, replicas=2)
    assert set(full.values()) == {((0, 0), (1, 1))}
    # Row 1 has joined stage 0 only (stage 1's quorum is r0s1 alone): it spectates, everyone agrees.
    half = _agree_all({WorkerId(0, 0): 2, WorkerId(1, 0): 2, WorkerId(0, 1): 1}, stages=2, replicas=2)
    assert set(half.values()) == {((0, 0),)} and len(half) == 3


def test_a_step_whose_stage_has_no_quorum_stops_with_its_name():
    agreement = RowAgreement(BoundStore("127.0.0.1", 10).store, stages=2, replicas=2, deadline_s=0.3)
    with pytest.raises(RuntimeError, match="no replica of stage 1 is left"):
        agreement.agree(3, WorkerId(0, 0), 1, None)


@pytest.mark.parametrize(("contributors", "sequences", "rows", "ok"), [
    (2.0, 8.0, ((0, 0), (1, 1)), True),   # both rows trained their half
    (1.0, 8.0, ((0, 1),), True),          # one (re-paired) row, a spectator beside it (it adds 0 and 0)
    (1.0, 4.0, ((0, 0), (1, 1)), False),  # an agreed row is missing: half the batch untrained
    (2.0, 8.0, ((0, 0),), False),         # a replica trained that was not agreed: counted twice
    (0.0, 0.0, (), False)])     # nobody trains
def test_a_stage_says_yes_only_for_the_whole_batch_from_the_agreed_rows(contributors, sequences, rows, ok):
    assert whole_batch(contributors, sequences, rows, batch_size=8) is ok


# Last in this file: torchft's background threads outlive the test and slow what follows.
def test_torchft_components_listen_on_the_configured_address_only(monkeypatch):
    """Lighthouse, manager server, the replica's store and the quorum's store: each on 127.0.0.1,
    nothing on a wildcard (checked from /proc of this process, which hosts all of them)."""
    from datetime import timedelta

    from torchft.checkpointing.pg_transport import PGTransport

    before = set(listening(os.getpid()))
    server, address = start_lighthouse("127.0.0.1", 1, 100, 1000)
    store = BoundStore("127.0.0.1", 10)
    pg = bound_process_group("127.0.0.1", timedelta(seconds=5))
    manager = create_manager("127.0.0.1", pg=pg, load_state_dict=lambda s: None, state_dict=lambda: {},
                             min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=5),
                             rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                             lighthouse_addr=address, replica_id="r0s0", init_sync=False,
                             checkpoint_transport=PGTransport(pg, timedelta(seconds=5), None))
    try:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface_of("127.0.0.1"))
        manager.start_quorum()  # creates the quorum's store and the gloo group
        opened = set(listening(os.getpid())) - before
        assert len(opened) >= 4, opened  # lighthouse, replica store, manager server, quorum store
        assert all(a == "127.0.0.1" for a, _ in opened), opened
        check_bound(os.getpid(), "127.0.0.1", "this test")
    finally:
        manager.shutdown(wait=False)
        server.shutdown()


def test_each_steps_records_are_written_once_and_follow_the_live_rows(tmp_path):
    """r0s1 (the preferred writer while row 0 trains) writes step 1's records at once; it dies
    before claiming step 2's: r1s1 claims them after step 3's quorum, then writes from there on."""
    store = BoundStore("127.0.0.1", 10).store
    path = tmp_path / "metrics.jsonl"
    rows = {"now": ((0, 0), (1, 1))}
    sinks = {w: ElasticRecords(store, MeshShape(2, 2), w, lambda: rows["now"])
             for w in (WorkerId(0, 1), WorkerId(1, 1), WorkerId(1, 0))}
    for sink in sinks.values():
        sink.attach(path)
    r0, r1, first = sinks[WorkerId(0, 1)], sinks[WorkerId(1, 1)], sinks[WorkerId(1, 0)]
    for sink in (r1, r0, first):
        sink.write(1, {"kind": "train", "step": 1, "by": str(sink.me)})
    r0.write(1, {"kind": "eval", "step": 1, "by": "r0s1"})
    r1.write(1, {"kind": "eval", "step": 1, "by": "r1s1"})
    r1.after_quorum(1)  # r0s1 claimed step 1: r1s1's copies are dropped
    r1.write(2, {"kind": "train", "step": 2, "by": "r1s1"})  # r0s1 is killed before its own
    rows["now"] = ((1, 1),)
    r1.after_quorum(2)
    r1.write(3, {"kind": "train", "step": 3, "by": "r1s1"})
    r1.close()
    assert [(r["kind"], r["step"], r["by"]) for r in read_records(path)] == [
        ("train", 1, "r0s1"), ("eval", 1, "r0s1"), ("train", 2, "r1s1"), ("train", 3, "r1s1")]
    assert r1.holds(3) and not r0.holds(3) and not first.holds(1)


def test_the_preferred_writer_claims_before_its_vote_so_a_fast_fallback_loses(tmp_path):
    """A cluster run's preferred writer (r0s1, on the coordinator) claims step 1's records before its
    verdict; r1s1, whose vote has then ended, reaches step 2's quorum before r0s1 has written a
    record of step 1: its fallback claim loses, and the records are r0s1's, in r0s1's folder."""
    store = BoundStore("127.0.0.1", 10).store
    rows = ((0, 0), (1, 1))
    r0, r1 = (ElasticRecords(store, MeshShape(2, 2), w, lambda: rows, preferred=WorkerId(0, 1))
              for w in (WorkerId(0, 1), WorkerId(1, 1)))
    r0.attach(tmp_path / "coordinator.jsonl")
    r1.attach(tmp_path / "other.jsonl")
    r1.before_vote(1)  # not the preferred writer: claims nothing here
    r0.before_vote(1)
    r1.write(1, {"kind": "train", "step": 1, "by": "r1s1"})
    r1.after_quorum(1)
    r0.write(1, {"kind": "train", "step": 1, "by": "r0s1"})
    r0.write(1, {"kind": "eval", "step": 1, "by": "r0s1"})
    assert [(r["kind"], r["by"]) for r in read_records(tmp_path / "coordinator.jsonl")] == [
        ("train", "r0s1"), ("eval", "r0s1")]
    assert not (tmp_path / "other.jsonl").exists()
    assert r0.holds(1) and not r1.holds(1)


def test_a_row_partners_death_breaks_the_row_and_the_worker_stays(monkeypatch):
    """Elastic: the monitor finds a row partner silent: ``RowBroken`` at the main thread's next
    check, no forced exit, and this worker's own heartbeat goes on (it stays in its stage's
    quorum); ``forget_row`` clears it. Fixed membership: the same silence ends the process."""
    import meshlearn.distributed.health as health_module

    exits: list[int] = []
    monkeypatch.setattr(health_module.os, "_exit", exits.append)
    mesh = MeshShape(2, 2)
    store = BoundStore("127.0.0.1", 10).store
    health = Health(store, mesh, 0, heartbeat_s=0.01, dead_after_s=0.2, store_owner="the test's store",
                    grace_s=0.0, scope={0, 1})  # rank 1, r0s1, never beats
    health.start()
    try:
        deadline = time.monotonic() + 10
        while health.row_broken is None:
            assert time.monotonic() < deadline, "the partner's silence was not noticed"
            time.sleep(0.01)
        with pytest.raises(RowBroken, match="worker r0s1 stopped answering"):
            health.check()
        beats = int(store.add("hb/0", 0))
        time.sleep(0.3)
        assert int(store.add("hb/0", 0)) > beats and health._thread.is_alive() and exits == []
        health.forget_row()
        health.check()  # dropped: the dead partner concerns it no more
        assert isinstance(health.link_failure("lost the connection to worker r0s1"), RowBroken)
        assert health.failure is None and store.get("abort") == b""  # never the run's abort
    finally:
        health.stop()
    fixed = Health(BoundStore("127.0.0.1", 10).store, mesh, 0, heartbeat_s=0.01, dead_after_s=0.2,
                   store_owner="the test's store", grace_s=0.0)
    fixed.start()
    fixed._thread.join(10)  # it ends with the failure: every rank but 0 is silent
    assert exits == [health_module.EXIT_PEER_FAILURE] and "stopped answering" in fixed.failure
    assert not isinstance(fixed.link_failure("lost the connection"), RowBroken)


def test_a_worker_abandons_a_step_in_flight_and_stands_at_its_update(tiny_corpus):
    """``Worker.abandon``: a first stage whose partner died after its forwards (their gradients
    never come) drops the step's open microbatches and stands at the update with zero gradients,
    idle, as a spectator; discarding that update changes no weight, and the next step runs."""
    import copy

    from meshlearn.assemble import build_workers
    from meshlearn.mesh.worker import StepWork

    cfg = tiny_config(tiny_corpus, *ELASTIC, "model.vocab_size=256")
    worker = build_workers(cfg)[WorkerId(0, 0)]
    M, seq = cfg.mesh.microbatches, cfg.model.seq_len

    def feed(step: int) -> None:
        tokens = [torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(step * M + m))
                  for m in range(M)]
        worker.feed(StepWork(step=step, microbatch_size=2, tokens=tokens))
        worker.horizon = (step + 1) * M

    before = copy.deepcopy(worker.module.state_dict())
    feed(0)
    sent = [m for _ in range(M) for m in worker.run(worker.next_action())]  # every forward of step 0
    assert len(sent) == M and worker.next_action() is None and not worker.idle  # waits for gradients
    action = worker.abandon(0)
    assert worker.idle and action.kind == "U" and worker.next_action() == action
    assert all(not p.grad.any() for p in worker.module.parameters())
    worker.discard_update(action)
    assert all(torch.equal(t, before[k]) for k, t in worker.module.state_dict().items())
    feed(1)
    assert worker.next_action().kind == "F" and worker.next_action().microbatch == M  # step 1 runs


def test_a_joiner_that_ends_while_the_launcher_reads_its_stat_has_exited(monkeypatch):
    """The launcher follows joiners by pid (not its children): reading /proc/PID/stat of a process
    that is exiting at that moment fails with ESRCH; that is an exit, not the launcher's crash."""
    from pathlib import Path

    from meshlearn.elastic import membership

    assert membership._alive(os.getpid())

    def ending(self, *args, **kwargs):
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(Path, "read_text", ending)
    assert not membership._alive(os.getpid())


class _Events:
    """A store holding what a holder (maybe another host's) wrote as membership events."""

    def __init__(self, values: dict[str, dict]):
        self.values = {k: json.dumps(v).encode() for k, v in values.items()}

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_a_membership_event_is_believed_only_with_its_kinds_fields():
    from meshlearn.elastic.membership import _event_report

    store = _Events({
        "ok": {"event": "dp_outlier", "step": 3, "worker": "r1s0", "score": 7.5, "count": 3},
        "inf": {"event": "dp_outlier", "step": 3, "worker": "r1s0", "score": float("inf"), "count": 3},
        "who": {"event": "dp_outlier", "step": 3, "worker": "\x1b[2Jeveryone", "score": 7.5, "count": 3},
        "count": {"event": "dp_outlier", "step": 3, "worker": "r1s0", "score": 7.5, "count": "3"},
        "unknown": {"event": "promoted", "step": 3},
        "spectates": {"event": "spectates", "step": 2, "why": "lost r1s1"},
        "no_why": {"event": "spectates", "step": 2},
        "repaired": {"event": "repaired", "step": 4, "row": [0, 1], "partners": ["r1s1"]},
        "relinks": {"event": "relinks", "step": 5, "row": 1, "why": "not every member held its links"},
    })
    assert _event_report(store, "ok")["worker"] == "r1s0"
    assert _event_report(store, "inf")["score"] == float("inf")
    for key in ("who", "count", "unknown", "no_why"):
        assert _event_report(store, key) is None, key
    assert _event_report(store, "spectates")["why"] == "lost r1s1"
    assert _event_report(store, "repaired")["row"] == [0, 1]  # what ElasticDriver writes: row_label
    assert _event_report(store, "relinks")["row"] == 1


def test_a_reason_another_host_wrote_reaches_the_console_as_one_bounded_printable_line():
    from meshlearn.elastic.membership import SHOWN_CHARS, _shown

    assert _shown("lost r1s1 (timeout)") == "lost r1s1 (timeout)"
    shown = _shown("a\nmeshlearn: worker r0s0 banned\x1b[31m" + "x" * 1000)
    assert "\n" not in shown and "\x1b" not in shown and len(shown) == SHOWN_CHARS + 1
