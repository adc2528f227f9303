"""``--resume`` of an elastic cluster run (issue 26 items 3 and 4): the two machines of
``two_hosts`` (alice, the coordinator: r0s0, r1s1; bob: r0s1, r1s0), ``elastic.membership =
"control"``, each machine with its own folder and key.

The run stops at step 3 (``train.stop_at_step``, every launcher ends); every machine's folder holds
its own workers' shards and the same agreement (``agreed.json``). ``--resume`` on each machine from
its own folder starts every slot from its own shard, the run finishes step 6, and its losses equal
the uninterrupted elastic run's bit for bit; each machine then holds only its own workers' shards of
the newest agreed checkpoint (step 6: it advanced), and ``meshlearn sample`` on the coordinator's
folder names that step and why it cannot load it (no machine holds every shard).

Root only (``ip``/``tc``, /dev/net/tun); skipped with the reason otherwise. Slow: three runs.
"""

from __future__ import annotations

import json

import pytest
from cluster_run import finish, logs
from elastic_cluster import ElasticCluster
from netns import missing
from two_hosts import HOSTS, PLACED, two_machines

from meshlearn.cluster.checkpoints import AGREED, agreed_steps
from meshlearn.entry.cli import main

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing())), pytest.mark.slow]

SETTINGS = ("train.steps=6", "train.checkpoint_every=1", "dist.keep_checkpoints=1")


@pytest.fixture
def wan():
    with two_machines("10.231.15") as link:
        yield link


def _finished(run: ElasticCluster) -> None:
    try:
        codes = finish(run.procs, limit_s=240)
    finally:
        run.close()
    assert codes == dict.fromkeys(HOSTS, 0), logs(run.tmp_path)


def _own_shards(run: ElasticCluster, step: int) -> None:
    """Each machine holds its own workers' shards of ``step`` and nothing else; the same agreement."""
    agreements = []
    for host, folder in run.runs.items():
        assert agreed_steps(folder) == [step], host
        shards = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt"))
        assert shards == sorted(f"checkpoints/step-{step:06d}/{w}.pt" for w in PLACED[host]), (host, shards)
        agreements.append(json.loads((folder / "checkpoints" / f"step-{step:06d}" / AGREED).read_text()))
    assert agreements[0] == agreements[1]
    assert {w: e["host"] for w, e in agreements[0]["shards"].items()} == {
        w: h for h, ws in PLACED.items() for w in ws}


def test_an_elastic_cluster_run_stopped_at_a_step_resumes_on_each_machine_from_its_own_folder(
        wan, tmp_path, tiny_corpus, capsys):
    whole = ElasticCluster(wan, tmp_path / "whole", tiny_corpus, *SETTINGS)
    _finished(whole)
    expected = whole.steps()
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]

    run = ElasticCluster(wan, tmp_path / "stopped", tiny_corpus, *SETTINGS, started=("train.stop_at_step=3",))
    _finished(run)
    assert [r["step"] for r in run.steps()] == [1, 2, 3]
    _own_shards(run, 3)

    run.resume()
    _finished(run)
    got = run.steps()
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert all(r["rows"] == [0, 1] and r["committed"] for r in got)
    assert [r["train_loss"] for r in got] == [r["train_loss"] for r in expected]  # bit for bit
    assert [r["batch"] for r in got] == [r["batch"] for r in expected]
    _own_shards(run, 6)  # the newest agreed checkpoint advanced; the resumed-from one is pruned
    members = run.members()
    assert sorted(members) == ["r0s0", "r0s1", "r1s0", "r1s1"]
    assert all(m["events"][-1]["event"] == "finished" for m in members.values()), members

    capsys.readouterr()
    assert main(["sample", str(run.runs["alice"]), "--tokens", "4"]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert "newest agreed checkpoint (step 6) holds only this machine's shards" in err, err
