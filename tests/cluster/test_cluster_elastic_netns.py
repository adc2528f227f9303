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
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cluster_run import finish, issue_keys, logs, start
from netns import Wan, missing, wan_link
from tiny import tiny_config

import meshlearn
from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import save_config
from meshlearn.jsonl import read_records
from meshlearn.statefile import load_state

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing())), pytest.mark.slow]

DELAY_MS = 5
PORT = 29541
HOSTS = ("alice", "bob")
PLACED = {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s0")}


@pytest.fixture
def wan():
    with wan_link(DELAY_MS, "100mbit", subnet="10.231.13") as link:
        yield link


class ElasticCluster:
    """The two launchers of one elastic cluster run, and the joiners started on alice."""

    def __init__(self, wan: Wan, tmp_path: Path, tiny_corpus: Path):
        cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.stages=2", "mesh.replicas=2", "train.steps=2000",
                          "elastic.enabled=true", "elastic.membership=control", "dist.timeout_s=5",
                          "dist.dead_after_s=2", f"link.latency_ms={DELAY_MS}", "dist.shaping=none",
                          "dist.threads=1", "dist.init_timeout_s=90", "data.tokenizer=bpe",
                          "data.bpe_vocab_size=300")
        hosts = {name: HostConfig(address, PORT, PLACED[name])
                 for name, address in zip(HOSTS, wan.addresses, strict=True)}
        placed = dataclasses.replace(cfg, cluster=ClusterConfig("alice", hosts))
        self.wan, self.tmp_path = wan, tmp_path
        self.keys = issue_keys(tmp_path, HOSTS)
        for host in HOSTS:
            shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
            save_config(placed, tmp_path / host / "run.toml")
        self.runs = {h: tmp_path / h / "runs" / "x" for h in HOSTS}
        self.coordinator = f"{wan.addresses[0]}:{PORT}"
        args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                    "data.corpus=corpus.txt", "--key", str(self.keys[h])] for h in HOSTS}
        self.procs = start(wan, tmp_path, HOSTS, args, "run")
        self.joiners: list[subprocess.Popen] = []

    def join(self, tag: str) -> subprocess.Popen:
        """A joiner on alice that knows only the coordinator's address (and alice's own key)."""
        env = os.environ | {"PYTHONPATH": str(Path(meshlearn.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
        with (self.tmp_path / f"join-{tag}.log").open("w") as log:
            proc = self.wan.run(0, [sys.executable, "-m", "meshlearn", "train", "--join", "--host", "alice",
                                    "--key", str(self.keys["alice"]), "--coordinator", self.coordinator,
                                    "--out", "runs/x", "--set", "data.corpus=corpus.txt"],
                                env=env, cwd=self.tmp_path / "alice", stdout=log, stderr=subprocess.STDOUT)
        self.joiners.append(proc)
        return proc

    def output(self, tag: str) -> str:
        return (self.tmp_path / f"join-{tag}.log").read_text()

    def members(self) -> dict:
        path = self.runs["alice"] / "workers.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def event(self, name: str, kind: str, generation: int | None = None) -> dict | None:
        """The latest ``kind`` event of slot ``name`` (a joiner's ``joined`` names its generation)."""
        events = self.members().get(name, {}).get("events", [])
        return next((e for e in reversed(events) if e["event"] == kind
                     and (generation is None or e.get("generation") == generation)), None)

    def steps(self) -> list[dict]:
        """Train records of every host's folder (a step's claimant writes it), by step."""
        found = {}
        for run in self.runs.values():
            path = run / "metrics.jsonl"
            for r in read_records(path) if path.is_file() else []:
                if r["kind"] == "train":
                    found[r["step"]] = r
        return [found[s] for s in sorted(found)]

    def last_step(self) -> int:
        steps = self.steps()
        return steps[-1]["step"] if steps else 0

    def wait(self, condition: Callable[[], object], timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not condition():
            assert all(p.poll() is None for p in self.procs.values()), f"a launcher ended before {what}"
            assert time.monotonic() < end, f"no {what} within {timeout_s} s\n{logs(self.tmp_path)}"
            time.sleep(0.05)

    def pid(self, host: str, name: str) -> int:
        """The pid of worker ``name`` started by ``host``'s launcher (its log is its standard output)."""
        log = str(self.runs[host] / "logs" / f"{name}.log")
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "fd" / "1") == log:
                        return int(entry.name)
                except OSError:
                    continue
        raise AssertionError(f"no process of {name} on {host}")

    def listeners(self, side: int) -> set[str]:
        out = subprocess.run(["ip", "netns", "exec", self.wan.namespaces[side], "ss", "-ltnH"],
                             capture_output=True, text=True, check=True, timeout=10).stdout
        return {line.split()[3] for line in out.splitlines() if line.strip()}

    def stop(self) -> dict[str, int]:
        """The graceful stop: SIGTERM to r0s0, every process stops after the same step."""
        os.kill(self.pid("alice", "r0s0"), signal.SIGTERM)
        for j in self.joiners:
            j.wait(timeout=120)
        return finish(self.procs, limit_s=120)

    def close(self) -> None:
        for j in self.joiners:
            if j.poll() is None:
                j.kill()
                j.wait(timeout=10)
        finish(self.procs, limit_s=1)


@pytest.fixture
def cluster(wan, tmp_path, tiny_corpus):
    run = ElasticCluster(wan, tmp_path, tiny_corpus)
    try:
        yield run
    finally:
        run.close()


def _shard(run: Path, step: int, name: str) -> dict:
    return load_state(run / "checkpoints" / f"step-{step:06d}" / f"{name}.pt")["workers"][name]


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert a["version"] == b["version"], what
    for key, tensor in a["module"].items():
        assert torch.equal(tensor, b["module"][key]), f"{what}: {key}"
    for (pa, sa), (pb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items(),
                                  strict=True):
        assert pa == pb and all(torch.equal(sa[k], sb[k]) for k in sa), f"{what}: optimizer {pa}"


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
    _assert_identical(_shard(alice, step, "r0s0"), _shard(alice, step, "r1s0"), "stage 0")
    _assert_identical(_shard(bob, step, "r0s1"), _shard(alice, step, "r1s1"), "stage 1")
    assert not (bob / "checkpoints" / f"step-{step:06d}" / "r1s0.pt").exists()  # its holder is alice now


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
