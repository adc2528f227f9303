"""Elastic membership across machines (issue 26 item 4): two network namespaces as machines (alice,
the coordinator: r0s0, r1s1; bob: r0s1, r1s0), each with its own folder and key, joined by a
shaped link, P = 2 × D = 2 under ``elastic.membership = "control"``.

r1s0 is SIGKILLed on bob; its row partner r1s1 (on alice) spectates while row 0 trains on. A
replacement joins from alice with only the coordinator's address (``meshlearn train --join
--host alice --key … --coordinator ADDR:PORT --out RUN``): it receives the config, the tokenizer and
the free slot from the run, heals from r0s0 and row 1 trains again. A joiner killed before it
contributes frees its slot at once and a second joiner takes it. At the graceful stop (SIGTERM to
r0s0) every replica equals its stage's other replica bit for bit, and nothing listens on either
machine's address but its configured port.

Root only (``ip``/``tc``, /dev/net/tun); skipped with the reason otherwise. Slow: each is a real run
of several minutes' worth of processes on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest
from cluster_run import logs
from elastic_cluster import PORT, ElasticCluster, assert_identical, shard
from netns import missing
from two_hosts import PLACED, two_machines

from meshlearn.cluster.checkpoints import AGREED, agreed_steps

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing())), pytest.mark.slow]


@pytest.fixture
def wan():
    with two_machines("10.231.13") as link:
        yield link


@pytest.fixture
def cluster(wan, tmp_path, tiny_corpus):
    run = ElasticCluster(wan, tmp_path, tiny_corpus)
    try:
        yield run
    finally:
        run.close()


def _kill_r1s0_and_wait_for_the_spectator(cluster: ElasticCluster) -> int:
    cluster.wait(lambda: cluster.last_step() >= 2, 240, "two steps")
    os.kill(cluster.pid("bob", "r1s0"), signal.SIGKILL)
    cluster.wait(lambda: cluster.event("r1s0", "left") and cluster.event("r1s1", "spectates"), 90,
                 "r1s0's departure (from bob) and r1s1 spectating (on alice)")
    broke = cluster.event("r1s1", "spectates")["step"]
    cluster.wait(lambda: cluster.last_step() >= broke + 3, 90, "steps with r1s1 spectating")
    return broke


def _row_1_trains(cluster: ElasticCluster, generation: int) -> int:
    cluster.wait(lambda: cluster.event("r1s0", "joined", generation) and cluster.event("r1s0", "contributes")
                 and cluster.event("r1s1", "contributes"), 150, "row 1 training again")
    trains = cluster.event("r1s1", "contributes")["step"]
    cluster.wait(lambda: cluster.last_step() >= trains + 4, 90, "four steps with row 1 training")
    return trains


def _check_the_end(cluster: ElasticCluster, codes: dict[str, int], joiner: subprocess.Popen,
                   tag: str) -> None:
    assert codes == {"alice": 0, "bob": 0}, logs(cluster.tmp_path)
    assert joiner.returncode == 128 + signal.SIGTERM, cluster.output(tag)
    rows = cluster.steps()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["rows"] == [0, 1] and rows[-1]["committed"]
    alice, bob = cluster.runs["alice"], cluster.runs["bob"]
    step = len(rows)  # the stop's checkpoint: r0s0 and the joined r1s0 on alice, r0s1 on bob, r1s1 on alice
    assert_identical(shard(alice, step, "r0s0"), shard(alice, step, "r1s0"), "stage 0")
    assert_identical(shard(bob, step, "r0s1"), shard(alice, step, "r1s1"), "stage 1")
    assert not (bob / "checkpoints" / f"step-{step:06d}" / "r1s0.pt").exists()  # its holder is alice now
    for folder in (alice, bob):  # the newest complete checkpoint advanced past the join, on both machines
        assert agreed_steps(folder)[-1] == step
        agreement = json.loads((folder / "checkpoints" / f"step-{step:06d}" / AGREED).read_text())
        assert {w: e["host"] for w, e in agreement["shards"].items()} == {
            "r0s0": "alice", "r1s0": "alice", "r0s1": "bob", "r1s1": "alice"}


def test_a_worker_killed_on_one_machine_is_replaced_from_another_with_the_coordinators_address(cluster):
    """r1s0 dies on bob; one joiner on alice, given only the coordinator's address, takes its slot,
    heals from r0s0 and row 1 trains again; at the stop r1s0 = r0s0 bit for bit."""
    broke = _kill_r1s0_and_wait_for_the_spectator(cluster)
    joiner = cluster.join("one")
    trains = _row_1_trains(cluster, generation=1)
    assert trains > broke
    members = cluster.members()
    assert members["r1s0"]["host"] == "alice"  # the slot's process runs where it joined
    replaced = [e["event"] for e in members["r1s0"]["events"]]
    assert replaced[:4] == ["joined", "left", "joined", "contributes"], members["r1s0"]
    codes = cluster.stop()
    output = cluster.output("one")
    assert "took slot r1s0 (generation 1)" in output and "healed from a live replica of stage 0" in output
    _check_the_end(cluster, codes, joiner, "one")
    by_step = {r["step"]: r for r in cluster.steps()}
    assert all(by_step[s]["rows"] == [0] for s in range(broke + 2, trains + 1))  # row 1 spectated
    after = [by_step[s] for s in range(trains + 1, len(by_step) + 1)]
    assert all(r["rows"] == [0, 1] and r["committed"] for r in after)


def test_a_failed_join_frees_its_slot_and_a_second_joiner_heals(cluster):
    """A joiner killed once it has claimed r1s0 frees the slot at once (its host's launcher sees it
    end); a second joiner takes it at the next generation, heals and trains; only the configured
    port listens on each machine's address while row 1 trains."""
    _kill_r1s0_and_wait_for_the_spectator(cluster)
    first = cluster.join("first")
    cluster.wait(lambda: "took slot r1s0" in cluster.output("first"), 120, "the first joiner's claim")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    cluster.wait(lambda: cluster.event("r1s0", "left") and len(
        [e for e in cluster.members()["r1s0"]["events"] if e["event"] == "left"]) == 2, 30,
        "the failed joiner's slot freed")
    second = cluster.join("second")
    _row_1_trains(cluster, generation=2)
    for side, address in enumerate(cluster.wan.addresses):  # the joiner included: no worker listens
        assert {p for p in cluster.listeners(side) if not p.startswith("127.")} == {f"{address}:{PORT}"}
    codes = cluster.stop()
    assert "took slot r1s0 (generation 2)" in cluster.output("second")
    _check_the_end(cluster, codes, second, "second")


def test_a_lost_machine_s_slots_are_freed_by_the_coordinator_and_taken_by_a_joiner(cluster):
    """bob is lost whole (its launcher and workers SIGKILLed: nobody tells anyone): the coordinator
    sees r0s1's and r1s0's heartbeats stand still and frees both slots; alice's r0s0 and r1s1,
    the survivors of rows broken at different stages, are re-paired and train on; a joiner on
    alice takes r0s1 (the first free slot in row order) and heals from r1s1."""
    cluster.wait(lambda: cluster.last_step() >= 2, 240, "two steps")
    bob = cluster.procs["bob"]
    pids = [cluster.pid("bob", name) for name in PLACED["bob"]]
    os.killpg(bob.pid, signal.SIGKILL)  # the launcher's session: its forkserver and workers
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    bob.wait(timeout=10)
    cluster.procs = {"alice": cluster.procs["alice"]}  # bob's end is no failure of the run
    cluster.wait(lambda: cluster.event("r0s1", "left") and cluster.event("r1s0", "left"), 120,
                 "the coordinator freeing bob's slots")
    for name in PLACED["bob"]:
        assert "its machine stopped answering" in cluster.event(name, "left")["why"], cluster.members()[name]
    lost = cluster.last_step()
    cluster.wait(lambda: cluster.last_step() >= lost + 3, 120, "steps after bob was lost")
    assert cluster.steps()[-1]["rows"] == [[0, 1]] and cluster.steps()[-1]["committed"]  # re-paired
    joiner = cluster.join("lost")
    cluster.wait(lambda: cluster.event("r0s1", "joined", 1), 150, "the joiner healed into r0s1")
    assert cluster.members()["r0s1"]["host"] == "alice"
    codes = cluster.stop()
    assert codes == {"alice": 0}, logs(cluster.tmp_path)
    assert joiner.returncode == 128 + signal.SIGTERM, cluster.output("lost")
    output = cluster.output("lost")
    assert "took slot r0s1 (generation 1)" in output and "healed from a live replica of stage 1" in output
