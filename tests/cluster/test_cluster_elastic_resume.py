"""Checkpoints and ``--resume`` of an elastic cluster run without root: two hosts' folders, the
slots' processes in threads meeting on a real TCPStore (as on the coordinator's control service).

Each shard is confirmed by its own process; the elastic manifest's writer publishes the agreement,
which every process records in its own folder and prunes by. On resume the launchers report what
their folders hold and the coordinator picks the newest agreed step that every machine named in
it still holds and that starts a replica of every stage on its placement's host; a slot whose shard
is elsewhere (a joiner's) is absent. Each refusal is one line."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from in_threads import in_threads

from meshlearn.checkpoint_layout import MANIFEST
from meshlearn.cluster.authority import Authority
from meshlearn.cluster.checkpoints import AGREED
from meshlearn.cluster.elastic_checkpoints import ElasticClusterCheckpoint
from meshlearn.cluster.elastic_resume import ResumePlan, choose, holdings, plan_resume
from meshlearn.cluster.placement import Placement
from meshlearn.elastic.checkpoints import ElasticCheckpoints
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.statefile import CheckpointError
from meshlearn.train.checkpoint import load_run_state

PLACED = {"r0s0": "alice", "r1s1": "alice", "r0s1": "bob", "r1s0": "bob"}
MESH = MeshShape(2, 2)
BOTH_ROWS = ((0, 0), (1, 1))  # stage → replica: row 0 and row 1 (r0s1 writes the manifest)
NOTHING = "no machine's folder holds an agreed checkpoint of this run"
DIFFERS = "step 1: host bob's agreed.json differs from the coordinator's"


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _stores(tmp_path: Path, store, prefix: str, held=PLACED, rows=BOTH_ROWS, keep: int = 1, resume=None,
            deadline_s: float = 10.0) -> dict[str, ElasticClusterCheckpoint]:
    """Each slot's store in the folder of the host that holds it (``held``: slot → host)."""
    prefixed = dist.PrefixStore(prefix, store)
    return {w: ElasticClusterCheckpoint(tmp_path / host, w, host,
                                        ElasticCheckpoints(prefixed, MESH, WorkerId.parse(w), lambda: rows,
                                                           deadline_s),
                                        prefixed, deadline_s, keep, resume)
            for w, host in held.items()}


def _save(stores: dict[str, ElasticClusterCheckpoint], steps: list[int]) -> None:
    for step in steps:
        in_threads(lambda w, step=step: stores[w].save(step, {"totals": {"step": step}},
                                                       {"workers": {w: {"step": step}}}), stores)


def _reports(tmp_path: Path) -> dict[str, dict]:
    return {host: json.loads(json.dumps(holdings(tmp_path / host, host))) for host in ("alice", "bob")}


def test_every_host_records_the_agreement_keeps_its_own_shards_and_resumes_from_them(tmp_path, store):
    _save(_stores(tmp_path, store, "run1/"), [1, 2])
    agreements = []
    for host in ("alice", "bob"):
        folder = tmp_path / host / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == ["step-000002"]  # pruned by the agreement
        mine = sorted(w for w, h in PLACED.items() if h == host)
        held = sorted(p.name for p in (folder / "step-000002").iterdir())
        assert held == sorted([*(f"{w}.pt" for w in mine), AGREED])
        assert not (folder / "step-000002" / MANIFEST).exists()  # never looks complete to `sample`
        agreements.append(json.loads((folder / "step-000002" / AGREED).read_text()))
    assert agreements[0] == agreements[1]
    assert {w: e["host"] for w, e in agreements[0]["shards"].items()} == PLACED
    plan = choose(_reports(tmp_path), PLACED, 2, "alice")
    assert plan == ResumePlan(2, ("r0s0", "r0s1", "r1s0", "r1s1"), ("r0s0", "r0s1", "r1s0", "r1s1"))
    loaded = in_threads(lambda w: _stores(tmp_path, store, "resume1/", resume=2)[w].load(), PLACED)
    assert {w: (common["totals"]["step"], state["workers"]) for w, (common, state) in loaded.items()} == {
        w: (2, {w: {"step": 2}}) for w in PLACED}
    with pytest.raises(FileNotFoundError, match="one machine's folder of a cluster run: its newest agreed "
                                                r"checkpoint \(step 2\)"):
        load_run_state(tmp_path / "alice")  # `meshlearn sample` / `export` say which step, and why not


def test_a_joiners_slot_held_off_its_placement_is_absent_on_resume(tmp_path, store):
    """r1s0's joiner ran on alice when the checkpoint was taken: its shard is in alice's folder, and
    bob (r1s0's host in the placement) has none; r1s0 does not start (free for a joiner), the
    others do, stage 0 from r0s0."""
    _save(_stores(tmp_path, store, "run2/", held=PLACED | {"r1s0": "alice"}), [1])
    assert (tmp_path / "alice" / "checkpoints" / "step-000001" / "r1s0.pt").is_file()
    plan = choose(_reports(tmp_path), PLACED, 2, "alice")
    assert plan == ResumePlan(1, ("r0s0", "r0s1", "r1s1"), ("r0s0", "r0s1", "r1s0", "r1s1"))


def test_a_newcomers_slot_is_absent_on_resume_and_the_step_still_resumes(tmp_path, store):
    """carol, a newcomer outside the placement, held r1s0 at the checkpoint and sends no report:
    r1s0 waits for a ``--join``, the others start."""
    _save(_stores(tmp_path, store, "run9/", held=PLACED | {"r1s0": "carol"}), [1])
    assert (tmp_path / "carol" / "checkpoints" / "step-000001" / "r1s0.pt").is_file()
    plan = choose(_reports(tmp_path), PLACED, 2, "alice")  # alice's and bob's reports only
    assert plan == ResumePlan(1, ("r0s0", "r0s1", "r1s1"), ("r0s0", "r0s1", "r1s0", "r1s1"))


def test_no_stage_replica_on_its_placements_host_is_one_line(tmp_path, store):
    _save(_stores(tmp_path, store, "run3/", held=PLACED | {"r1s0": "alice", "r0s0": "bob"}), [1])
    assert choose(_reports(tmp_path), PLACED, 2, "alice") == (
        "step 1: no shard of stage 0 is on the host its placement names (a joiner's from another machine: "
        "r0s0 on bob, r1s0 on alice)")


def test_a_host_whose_folder_lacks_the_agreed_checkpoint_falls_back_or_refuses(tmp_path, store):
    _save(_stores(tmp_path, store, "run4/", keep=2), [1, 2])
    shutil.rmtree(tmp_path / "bob" / "checkpoints" / "step-000002")
    assert choose(_reports(tmp_path), PLACED, 2, "alice").step == 1  # the newest every machine still holds
    shutil.rmtree(tmp_path / "bob" / "checkpoints" / "step-000001")
    hosts = {h: Placement(h, "127.0.0.1", 1, "lo", "alice", "127.0.0.1", 1, {}, PLACED, {}, 4, "r0s1")
             for h in ("alice", "bob")}
    def launcher(host: str) -> str | None:  # each launcher with its own connection, as over the network
        own = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        return _refusal(lambda: plan_resume(dist.PrefixStore("resume4/", own), tmp_path / host, hosts[host],
                                            ["alice", "bob"], 2, 30.0))

    errors = in_threads(launcher, hosts)
    line = ("--resume = '{}': no agreed checkpoint can resume this elastic cluster run (step 2: host bob's "
            "folder lacks its agreed shards r0s1, r1s0 (checkpoints/step-000002); step 1: host bob's folder "
            "lacks its agreed shards r0s1, r1s0 (checkpoints/step-000001)): start it anew")
    assert errors == {h: line.format(tmp_path / h) for h in hosts}  # the same line on every machine


NO_REPORTS = ['{"\u00b2": %s}', '{"%s": %%s}' % ("1" * 5000), '{"01": %s}', "[" * 100_000, "null",
              '{"1": {"holds": [], "agreement": {"shards": []}}}']


@pytest.mark.parametrize("report", NO_REPORTS)
def test_a_report_that_is_no_report_holds_nothing_and_is_one_line(tmp_path, store, capsys, report):
    """A host's report that would not parse (a superscript or 5000-digit step, nesting past the
    recursion limit) counts as holding nothing: the choice is still one line on every host."""
    _save(_stores(tmp_path, store, "run10/"), [1])
    held = json.dumps(holdings(tmp_path / "bob", "bob")["1"])
    keys = dist.PrefixStore("resume10/", store)
    keys.set("meshlearn-cluster/resume/bob", report % held if "%s" in report else report)
    alice = Placement("alice", "127.0.0.1", 1, "lo", "alice", "127.0.0.1", 1, {}, PLACED, {}, 4, "r0s1")
    assert _refusal(lambda: plan_resume(keys, tmp_path / "alice", alice, ["alice", "bob"], 2, 30.0)) == (
        f"--resume = '{tmp_path / 'alice'}': no agreed checkpoint can resume this elastic cluster run "
        "(step 1: host bob's folder lacks its agreed shards r0s1, r1s0 (checkpoints/step-000001)): "
        "start it anew")
    assert capsys.readouterr().err.count("host bob's resume report is no report of agreed checkpoints") == 1


def test_machines_whose_agreements_differ_resume_from_neither(tmp_path, store):
    _save(_stores(tmp_path, store, "run5/"), [1])
    path = tmp_path / "bob" / "checkpoints" / "step-000001" / AGREED
    agreement = json.loads(path.read_text())
    agreement["shards"]["r0s0"]["sha256"] = "0" * 64
    path.write_text(json.dumps(agreement))
    assert choose(_reports(tmp_path), PLACED, 2, "alice") == DIFFERS
    assert choose({"alice": {}, "bob": {}}, PLACED, 2, "alice") == NOTHING


def test_only_the_agreements_in_the_coordinators_folder_count(tmp_path, store):
    """bob runs a slot of every stage and reports a made-up newer step listing only his shards, or
    step 1's agreement trimmed to them: only what alice's (the coordinator's) processes recorded
    from the control service can resume, and bob's copy must be it."""
    _save(_stores(tmp_path, store, "run11/"), [1])
    reports = _reports(tmp_path)
    honest = reports["bob"]["1"]
    mine = {w: e for w, e in honest["agreement"]["shards"].items() if e["host"] == "bob"}
    reports["bob"]["9"] = {"agreement": {"step": 9, "shards": mine}, "holds": sorted(mine)}
    assert choose(reports, PLACED, 2, "alice") == ResumePlan(1, tuple(sorted(PLACED)), tuple(sorted(PLACED)))
    reports["bob"]["1"] = {"agreement": {"step": 1, "shards": mine}, "holds": sorted(mine)}
    assert choose(reports, PLACED, 2, "alice") == DIFFERS
    assert choose(reports | {"alice": {}}, PLACED, 2, "alice") == (
        "the coordinator's folder (alice) holds no agreed checkpoint of this run")


def test_a_changed_shard_or_no_named_step_is_refused_by_the_process_that_loads_it(tmp_path, store):
    _save(_stores(tmp_path, store, "run6/"), [1])
    shard = tmp_path / "bob" / "checkpoints" / "step-000001" / "r1s0.pt"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # same size, other bytes: its host still reports it held
    shard.write_bytes(bytes(data))
    assert choose(_reports(tmp_path), PLACED, 2, "alice").step == 1
    with pytest.raises(CheckpointError, match="checksum differs from .*agreed.json"):
        _stores(tmp_path, store, "resume6/", resume=1)["r1s0"].load()
    with pytest.raises(FileNotFoundError, match="launcher named no agreed checkpoint"):
        _stores(tmp_path, store, "resume6/")["r0s0"].load()


def test_a_step_with_no_replica_of_a_stage_stays_incomplete_everywhere(tmp_path, store):
    """Only the last stages write (stage 0's replicas are gone): the writer says the step is
    incomplete and no folder records an agreement, so nothing is pruned and nothing resumes from it."""
    stores = _stores(tmp_path, store, "run7/", deadline_s=0.5)
    in_threads(lambda w: stores[w].save(1, {"totals": {"step": 1}}, {"workers": {w: {}}}),
               ["r0s1", "r1s1"])
    said = json.loads(dist.PrefixStore("run7/", store).get("cluster/checkpoint/1/agreed"))
    assert said == {"step": 1, "shards": {}}  # the writer's word that the step is incomplete: nobody waits on
    assert not list(tmp_path.rglob(AGREED))
    assert choose(_reports(tmp_path), PLACED, 2, "alice") == NOTHING


FORGED = {  # what a last-stage holder might publish as step 2's agreement before the writer does
    "a changed hash": lambda honest: honest | {"r0s0": honest["r0s0"] | {"sha256": "0" * 64}},
    "a slot that did not train": lambda honest: honest | {"r5s0": honest["r0s0"]},
    "no replica of stage 0": lambda honest: {w: e for w, e in honest.items() if w.endswith("s1")},
}


@pytest.mark.parametrize("forged", [*FORGED, "null", "[]", '{"step": 2, "shards": []}', "{"])
def test_an_agreement_that_is_not_the_shards_own_entries_is_recorded_nowhere(tmp_path, store, capsys, forged):
    """Any last-stage holder may publish the agreement (once): every process checks it against the
    entries the shards' own processes published, and records and prunes by none that differs."""
    _save(_stores(tmp_path, store, "run8/"), [1])
    keys = dist.PrefixStore("run8/", store)
    honest = json.loads(keys.get("cluster/checkpoint/1/agreed"))["shards"]
    value = (json.dumps({"step": 2, "shards": FORGED[forged](honest)}) if forged in FORGED else forged)
    keys.set("cluster/checkpoint/2/agreed", value)  # first: the writer's compare-and-set finds it taken
    _save(_stores(tmp_path, store, "run8/"), [2])
    assert sorted(p.parent.name for p in tmp_path.rglob(AGREED)) == ["step-000001"] * 2  # nothing pruned
    assert choose(_reports(tmp_path), PLACED, 2, "alice").step == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "stays incomplete here" in line]
    assert len(lines) == 4 and all("the agreement on the checkpoint of step 2" in line for line in lines)


def _refusal(call) -> str | None:
    try:
        call()
    except ConfigError as err:
        return str(err)
    return None


def test_the_agreement_is_a_last_stage_holders_and_each_launcher_reports_only_its_own_folder():
    ranks = {"r0s0": 0, "r0s1": 1, "r1s0": 2, "r1s1": 3}
    authority = Authority(PLACED, ranks, "alice", elastic=True, stages=2, hosts=["alice", "bob", "carol"])
    key = "meshlearn/0//cluster/checkpoint/4/agreed"
    assert authority.refusal("bob", "compare_set", key) is None  # r0s1's host: the manifest's writer
    assert authority.refusal("bob", "set", key) == f"host bob may not set {key!r}"  # once, from empty
    assert authority.write_once_refusal(key, b"{}") is not None  # never moved after
    assert authority.write_once_refusal(key, b"") is None
    assert authority.refusal("carol", "compare_set", key) == f"host carol may not compare_set {key!r}"
    assert authority.refusal("bob", "set", "meshlearn-cluster/resume/bob") is None
    assert authority.refusal("alice", "set", "meshlearn-cluster/resume/bob") is not None
    assert authority.refusal("alice", "set", "meshlearn-cluster/resume") is None  # the coordinator's choice
    assert authority.refusal("bob", "set", "meshlearn-cluster/resume") is not None
    fixed = Authority(PLACED, ranks, "alice")
    assert fixed.refusal("bob", "set", key) is not None  # a fixed run's agreement stays the coordinator's
