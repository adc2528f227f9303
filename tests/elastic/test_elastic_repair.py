"""Re-pairing across rows, without a training run: the row agreement's fixer (``form_rows``) pairs
the survivors of rows broken at different stages, keeps every healthy row's links, and pairs
nothing with SENTINEL; every process reads the same rows from the store; a pipeline link may join
neighbouring stages of two replicas; a resumed run starts the workers its checkpoint lists."""

from __future__ import annotations

import json

import pytest
from in_threads import in_threads
from tiny import tiny_config

from meshlearn.checkpoint_layout import CHECKPOINT_DIR, MANIFEST
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.elastic.evictions import evicted_key
from meshlearn.elastic.membership import resume_absent
from meshlearn.elastic.rows import RowAgreement, form_rows
from meshlearn.mesh.messages import carried_kind
from meshlearn.mesh.network import LinkProfile, Network
from meshlearn.mesh.topology import WorkerId


def _rows(step, present, held=None, repair=True):
    agreed = form_rows(step, [set(p) for p in present], held or {}, repair)
    return {row: agreed.linked_at[row] for row in agreed.rows}


def test_rows_broken_at_different_stages_are_re_paired():
    """P = 2 × D = 2, r0s1 and r1s0 dead: r0s0 and r1s1 form row (0, 1), linked anew at this step
    whatever slot-row links each still held."""
    held = {WorkerId(0, 0): ((0, 0), 3), WorkerId(1, 1): ((1, 1), 3)}
    assert _rows(5, [{0}, {1}], held) == {(0, 1): 5}
    assert _rows(5, [{0}, {1}], held, repair=False) == {}  # SENTINEL: no re-pairing, no row


def test_leftovers_are_paired_in_replica_order_after_the_complete_slot_rows():
    # D = 3, P = 2: slot row 1 is complete; stage 0's leftover 0 and stage 1's 2 form one more row.
    assert _rows(4, [{0, 1}, {1, 2}]) == {(1, 1): 4, (0, 2): 4}
    # P = 3, D = 3: slot row 2, then as many rows as the stage with the fewest leftovers has.
    assert _rows(4, [{0, 1, 2}, {1, 2}, {0, 2}]) == {(2, 2, 2): 4, (0, 1, 0): 4}


def test_a_healthy_row_never_re_links():
    """A row whose members all hold its links keeps them, step after step, and whoever arrives:
    a joiner completing slot row 1 at stage 0 does not break the re-paired row (0, 1) to form
    (1, 1); it spectates until stage 1 has a replica for it, then pairs as (1, 0)."""
    repaired = {WorkerId(0, 0): ((0, 1), 5), WorkerId(1, 1): ((0, 1), 5)}
    assert _rows(6, [{0}, {1}], repaired) == {(0, 1): 5}
    assert _rows(7, [{0, 1}, {1}], repaired) == {(0, 1): 5}  # r1s0 joined
    assert _rows(9, [{0, 1}, {0, 1}], repaired) == {(0, 1): 5, (1, 0): 9}  # r0s1 joined too
    # A healthy slot row keeps its links while another row's survivors are re-paired beside it.
    slot = {WorkerId(0, 0): ((0, 0), 2), WorkerId(0, 1): ((0, 0), 2)}
    assert _rows(8, [{0, 1}, {0, 2}], slot) == {(0, 0): 2, (1, 2): 8}


@pytest.mark.parametrize("held", [
    {WorkerId(0, 0): ((0, 1), 5), WorkerId(1, 1): None},          # one end dropped its links
    {WorkerId(0, 0): ((0, 1), 5), WorkerId(1, 1): ((0, 1), 4)},   # links of different builds
    {WorkerId(0, 0): ((0, 1), 5), WorkerId(1, 1): ((1, 1), 5)}])  # one holds another row's links
def test_a_row_whose_members_hold_different_links_links_anew(held):
    assert _rows(6, [{0}, {1}], held) == {(0, 1): 6}


def _agree_all(store, held: dict[WorkerId, tuple | None], participants: list[int], repair: bool = True,
               evictions: bool = False):
    return in_threads(lambda wid: RowAgreement(store, 2, 2, 5.0, repair=repair, evictions=evictions).agree(
        3, wid, participants[wid.stage], held[wid]), held)


def test_every_process_reads_the_same_re_paired_row_and_its_place_in_it():
    store = BoundStore("127.0.0.1", 10).store
    held = {WorkerId(0, 0): ((0, 0), 1), WorkerId(1, 1): None}
    results = _agree_all(store, held, [1, 1])
    assert {a.rows for a in results.values()} == {((0, 1),)}
    assert all(a.row_of(w) == (0, 1) and a.plan(w, held[w])[1] == 3 for w, a in results.items())
    assert results[WorkerId(0, 0)].plan(WorkerId(0, 0), held[WorkerId(0, 0)]) == (True, 3)


def test_an_evicted_replica_is_never_re_paired():
    store = BoundStore("127.0.0.1", 10).store
    store.set(evicted_key(1), "r1s1")
    results = _agree_all(store, {WorkerId(0, 0): None, WorkerId(1, 0): None, WorkerId(1, 1): None},
                         [2, 1], evictions=True)
    assert {a.rows for a in results.values()} == {()}


def test_a_pipeline_link_may_join_neighbouring_stages_of_two_replicas():
    """It carries pipeline messages and is shaped as a pipeline link (the ``pp`` axis's profile)."""
    net = Network(LinkProfile(bandwidth_mbit=100, latency_ms=5), axes={"dp": LinkProfile(bandwidth_mbit=10)})
    repaired, dp = net.link(WorkerId(0, 0), WorkerId(1, 1)), net.link(WorkerId(0, 1), WorkerId(1, 1))
    assert (repaired.axis, repaired.profile.bandwidth_mbit) == ("pp", 100)
    assert (dp.axis, dp.profile.bandwidth_mbit) == ("dp", 10)
    assert carried_kind(WorkerId(0, 0), WorkerId(1, 1)) == "act"
    assert carried_kind(WorkerId(1, 1), WorkerId(0, 0)) == "grad"
    assert carried_kind(WorkerId(0, 1), WorkerId(1, 1)) == "dp"
    with pytest.raises(ValueError, match="no link runs from r0s0 to r1s2"):
        carried_kind(WorkerId(0, 0), WorkerId(1, 2))


def test_a_resumed_run_starts_the_workers_its_checkpoint_lists(tiny_corpus, tmp_path):
    """The checkpoint of a re-paired row lists r0s0 and r1s1: those start, the other two slots
    are free for joiners (a resume by rows would start none: no slot row is listed whole)."""
    cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.stages=2", "mesh.replicas=2", "elastic.enabled=true")
    folder = tmp_path / CHECKPOINT_DIR / "step-4"
    folder.mkdir(parents=True)
    for name in ("r0s0", "r1s1"):
        (folder / f"{name}.pt").write_bytes(b"")
    (folder / MANIFEST).write_text(json.dumps({"shards": ["r0s0", "r1s1"]}))
    assert resume_absent(cfg, tmp_path) == ["r0s1", "r1s0"]
