"""A malicious participant with valid credentials inside a cluster run (issue 27): bob's worker r1s0
is ``insider.py`` — meshlearn's worker with bob's real key, plus what a malicious host can add to
its own code. While P = 2 × D = 2 trains over two hosts' ports on 127.0.0.1 it claims a link of
alice's worker and a second slot on its own, writes other participants' control records, forges
two aborts in the name of alice's r0s0, knocks at the control service with the joiner key it was
also issued, and puts a 40× oversized frame, a
replay of its previous contribution and a frame that does not decode in front of its first three
DP contributions.

Each is refused, counted and attributed to the identity that sent it (bob, or joe for the joiner
key): in the coordinator's counters (control plane) and in alice's r0s0's own record (its links
and its collectives), which is what her host's security.json and the run's summary.json add up.
Nothing is refused from or blamed on an honest participant, no abort is written, and the run
finishes with the simulator's losses: a refused frame never takes the place of the honest
contribution behind it. (The fast representatives of each refusal are in test_control.py,
test_cluster_links.py and distributed/test_dist_collectives.py.)

The same insider under meshlearn's own launchers, on two machines (network namespaces; root
only): bob's launcher loads the patches in every process it starts (``insider_site``), its
pipeline lies too (``pipeline_insider.py``), and the run's summary.json says what was refused, by
reason and by sender: bob and joe, nobody else.

On the pipeline link (``pipeline_insider.py``): bob's r1s0 puts a frame that does not decode, one
beyond the run's bound and a replay in place of three of its activations; each takes its slot as
the simulator's stand-in, and the run ends with the simulator's losses for the same lies.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import loopback
import pytest
from cluster_run import finish, issue_keys, logs, start
from loopback import HOSTS, PLACED
from netns import missing, wan_link
from pipeline_insider import LIES, PADDING_ENV, simulated_lies

import meshlearn
from meshlearn.cluster.refusals import merged, process_records
from meshlearn.cluster.security import refused_block
from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import save_config
from meshlearn.distributed.wire import message_bound
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import WorkerId
from meshlearn.net.counters import Counters
from meshlearn.net.keys import add_joiner, create_run
from meshlearn.net.port import PortAgent
from meshlearn.train import Trainer

INSIDER = Path(__file__).parent / "insider.py"
PIPELINE_INSIDER = Path(__file__).parent / "pipeline_insider.py"
SITE = Path(__file__).parent / "insider_site"  # loads insider.py's patches into every process of a host
STEPS = 4
CONTROL_WRITES = ("another worker's heartbeat", "another worker's done mark", "another worker's link address",
                  "another worker's checkpoint entry", "the coordinator's resume state",
                  "another host's security record", "an abort in another worker's name",
                  "an abort that another worker noticed")


@pytest.fixture
def agents() -> Iterator[dict[str, PortAgent]]:
    folders = {h: Path(tempfile.mkdtemp(prefix="ml-insider-")) for h in HOSTS}  # AF_UNIX paths are short
    made = {h: PortAgent("127.0.0.1", 0, f / "agent.sock", Counters()) for h, f in folders.items()}
    for agent in made.values():
        agent.start()
    yield made
    for host, agent in made.items():
        agent.close()
        shutil.rmtree(folders[host])


@pytest.mark.slow
def test_a_participant_with_valid_credentials_is_refused_attributed_and_the_run_goes_on(agents, tiny_corpus,
                                                                                       tmp_path):
    keys = tmp_path / "keys"
    create_run(keys, list(HOSTS), "insider-test")
    add_joiner(keys, "joe")  # the owner issued the insider a joiner's key too
    cfg = loopback.cluster_config(tiny_corpus, {h: a.port for h, a in agents.items()}, f"train.steps={STEPS}")
    save_config(cfg, tmp_path / "run.toml")
    coordinator = Counters()  # the control service's refusals (alice's launcher would own them)
    control = loopback.control_service(agents, keys, coordinator)
    run_dirs = {host: tmp_path / host / "x" for host in HOSTS}
    report = tmp_path / "insider.jsonl"
    try:
        insider = {"INSIDER_REPORT": str(report), "INSIDER_JOINER": str(keys / "joe.key")}
        procs = loopback.start_workers(tmp_path / "run.toml", run_dirs, agents, keys, tmp_path,
                                       programs={"r1s0": [str(INSIDER)]}, extra_env=insider)
        codes = loopback.wait_all(procs)
        abort = control.state.wait(["meshlearn/0//abort"], 0.0)
    finally:
        control.close()
    logs = loopback.logs_of(tmp_path)
    said = {r["attack"]: r["outcome"] for r in map(json.loads, report.read_text().splitlines())}
    assert codes == [0, 0, 0, 0], logs + str(said)
    assert abort in (None, [b""]), abort  # nobody stopped the run, nobody was blamed

    # what the insider saw: every attempt refused, none accepted
    for attack in CONTROL_WRITES:
        assert said[attack].startswith("refused:") and "authority" in said[attack], (attack, said[attack])
    assert said["a joiner's key at the control service"].startswith("refused: Refused: refused_by_peer")
    assert said["claim another worker's link"].startswith("refused:") and "refused the link r1s1->" in \
        said["claim another worker's link"], said
    assert said["a second hello for its own link"].startswith("refused:"), said
    assert [said[f"dp frame {n}"] for n in (1, 2, 3)] == ["sent in front of the honest one"] * 3

    # the coordinator's control service: each refusal counted and attributed to its sender
    assert coordinator.as_dict().get("authority") == len(CONTROL_WRITES), coordinator.recent()
    assert coordinator.as_dict().get("identity_refused") == 1, coordinator.recent()
    assert coordinator.by_sender() == {"bob": len(CONTROL_WRITES), "joe": 1}, coordinator.recent()

    # alice's r0s0, the insider's victim: its links' and its collectives' refusals, all bob's
    alice = process_records(run_dirs["alice"])
    victim = alice["r0s0"]
    assert victim["refused"]["contribution_refused"] == 3, victim
    assert victim["refused"]["hello_refused"] >= 1, victim
    assert set(victim["by_sender"]) == {"bob"}, victim
    recent = "\n".join(victim["recent"])
    for lie in ("a frame of", "number 0)", "magic b'JUNK'"):  # 40× oversized, replayed, undecodable
        assert lie in recent, recent
    assert "bob (host) claims r1s1, which alice runs" in recent, recent
    assert not process_records(run_dirs["bob"]), "an honest participant's bytes were refused"

    # what summary.json's block says: counted by reason and attributed to bob and joe only
    alice_reasons, alice_senders = merged(coordinator, alice)
    block = refused_block({"alice": {"refused": alice_reasons, "by_sender": alice_senders},
                           "bob": {"refused": {}, "by_sender": {}}}, "alice", HOSTS)
    assert set(block["by_sender"]) == {"bob", "joe"}, block
    assert block["by_reason"]["contribution_refused"] == 3, block
    assert "refused a frame from rank 2 (host bob), sum" in logs

    expected, got = loopback.simulator_losses(cfg, tmp_path / "sim"), loopback.losses(run_dirs["alice"])
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(expected, got, strict=True)) <= 1e-5, \
        (expected, got)


@pytest.mark.slow
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_under_the_launchers_summary_json_names_the_insider_and_nobody_else(tiny_corpus, tmp_path):
    keys = issue_keys(tmp_path, HOSTS)
    add_joiner(tmp_path / "owner-keys", "joe")
    for name in ("joe.key", "joe.crt"):
        shutil.copy(tmp_path / "owner-keys" / name, tmp_path / "bob" / "keys" / name)
    with wan_link(2, "100mbit", subnet="10.231.13") as wan:
        hosts = {h: HostConfig(a, 29561, PLACED[h]) for h, a in zip(HOSTS, wan.addresses, strict=True)}
        cfg = dataclasses.replace(
            loopback.cluster_config(tiny_corpus, {h: 0 for h in HOSTS}, f"train.steps={STEPS}"),
            cluster=ClusterConfig("alice", hosts))
        for host in HOSTS:
            shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
            save_config(cfg, tmp_path / host / "run.toml")
        args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                    "data.corpus=corpus.txt", "--key", str(keys[h])] for h in HOSTS}
        report = tmp_path / "insider.jsonl"
        sim, padding = simulated(cfg, tmp_path / "sim")
        bob = {"PYTHONPATH": f"{SITE}:{Path(meshlearn.__file__).parents[1]}", "INSIDER_REPORT": str(report),
               "INSIDER_JOINER": str(tmp_path / "bob" / "keys" / "joe.key"), PADDING_ENV: padding}
        codes = finish(start(wan, tmp_path, HOSTS, args, "insider", env_of={"bob": bob}), limit_s=150)
    said = report.read_text() if report.is_file() else "(no report)"
    assert codes == {"alice": 0, "bob": 0}, logs(tmp_path) + said
    assert said.count('"refused: ') == len(CONTROL_WRITES) + 3 and "accepted" not in said, said

    alice = tmp_path / "alice" / "runs" / "x"
    refused = json.loads((alice / "summary.json").read_text())["refused"]
    assert set(refused["by_sender"]) == {"bob", "joe"} and refused["claims"] == {}, refused
    assert refused["by_reason"]["contribution_refused"] == 3, refused
    assert refused["by_reason"]["message_refused"] == len(LIES), refused  # its pipeline lies
    assert refused["by_reason"]["authority"] == len(CONTROL_WRITES), refused
    assert refused["by_reason"]["hello_refused"] >= 1, refused
    assert refused["by_reason"]["identity_refused"] >= 1, refused
    record = json.loads((alice / "security.json").read_text())
    assert record["processes"]["r0s0"]["contribution_refused"] == 3, record
    assert record["processes"]["r1s1"] == {"message_refused": len(LIES)}, record
    assert "contribution_refused" not in refused["by_host"]["bob"], refused  # alice sent bob no lie
    expected = loopback.losses(sim)
    got = loopback.losses(alice)
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(expected, got, strict=True)) <= 1e-5


def simulated(cfg, folder: Path) -> tuple[Path, str]:
    """The simulator's run of ``cfg`` where r1s0 tells ``pipeline_insider``'s lies (its folder),
    and a padding beyond every receiver's bound (``wire.message_bound``) for the dist run's."""
    trainer = Trainer(dataclasses.replace(cfg, backend="sim", cluster=ClusterConfig()), folder,
                      progress=False)
    trainer.workers[WorkerId(1, 0)].forge = simulated_lies
    trainer.train()
    largest = max(w.n_params for w in trainer.workers.values())
    return folder, str(message_bound(trainer.cfg, largest))


@pytest.mark.slow
def test_pipeline_lies_of_a_participant_take_their_slots_as_stand_ins_attributed_to_it(agents, tiny_corpus,
                                                                                       tmp_path):
    """bob's r1s0 (``pipeline_insider.py``) puts a frame that does not decode, one beyond the run's
    bound (``wire.message_bound``) and a replay of an earlier activation in place of three of its
    activations to alice's r1s1. Each takes its slot as the stand-in the simulator's guard puts there
    (the same records), is counted under bob in r1s1's record, and the run ends with the losses of
    the simulator's run of the same lies (≤ 1e-5). Before, r1s1 ended the run at the first one."""
    keys = tmp_path / "keys"
    create_run(keys, list(HOSTS), "pipeline-insider-test")
    cfg = loopback.cluster_config(tiny_corpus, {h: a.port for h, a in agents.items()}, f"train.steps={STEPS}")
    save_config(cfg, tmp_path / "run.toml")
    sim, padding = simulated(cfg, tmp_path / "sim")  # the reference: its r1s0 tells the same lies
    beyond = {PADDING_ENV: padding}
    control = loopback.control_service(agents, keys, Counters())
    run_dirs = {host: tmp_path / host / "x" for host in HOSTS}
    try:
        procs = loopback.start_workers(tmp_path / "run.toml", run_dirs, agents, keys, tmp_path,
                                       programs={"r1s0": [str(PIPELINE_INSIDER)]}, extra_env=beyond)
        codes = loopback.wait_all(procs)
    finally:
        control.close()
    logs = loopback.logs_of(tmp_path)
    assert codes == [0, 0, 0, 0], logs

    receiver = process_records(run_dirs["alice"])["r1s1"]
    assert receiver["refused"] == {"message_refused": 3} and receiver["by_sender"] == {"bob": 3}, receiver
    recent = "\n".join(receiver["recent"])
    for lie in ("malformed message from r1s0", "a frame of", "stale step"):  # undecodable, too big, replayed
        assert lie in recent, recent
    assert set(process_records(run_dirs["alice"])) == {"r1s1"} and not process_records(run_dirs["bob"])

    fields = ("step", "microbatch", "message", "src", "dst")
    logged = [json.loads(line.split(": rejected ", 1)[1]) for line in (tmp_path / "r1s1.log").read_text()
              .splitlines() if ": rejected {" in line]
    expected = [r for r in read_records(sim / "metrics.jsonl") if r["kind"] == "wire_reject"]
    assert [tuple(r[f] for f in fields) for r in logged] == [tuple(r[f] for f in fields) for r in expected]
    assert [(r["step"], r["microbatch"]) for r in logged] == [(t + 1, m) for t, m in sorted(LIES)]
    got, want = loopback.losses(run_dirs["alice"]), loopback.losses(sim)
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(want, got, strict=True)) <= 1e-5, (want, got)
