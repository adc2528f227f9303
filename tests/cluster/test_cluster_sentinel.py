"""SENTINEL in a cluster run among strangers: two machines (network namespaces, a shaped link), each
with its host's key, train P = 3 × D = 3 with the verifier placed on bob, the machine that is not the
coordinator, while r1s1 (on alice) sends zeros. Every pipeline message crosses a machine on its way
through the verifier, over the authenticated links of each host's one port.

The simulator with verification is the oracle, as on one machine (tests/distributed/
test_dist_sentinel.py): the same decision on every message, the same ban at the same step with the
same donor, and the simulator's losses to the end.

Needs root, ``ip``/``tc`` and /dev/net/tun; skipped with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from cluster_run import issue_keys, logs, start_all
from netns import missing, wan_link
from tiny import tiny_config

from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import save_config
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

DELAY_MS = 2
HOSTS = ("alice", "bob")
# Every stage on both machines, the attacker (r1s1) on the coordinator, the verifier on the other.
PLACED = {"alice": ("r0s0", "r1s1", "r2s2", "r0s2"),
          "bob": ("r0s1", "r1s0", "r1s2", "r2s0", "r2s1", "verifier")}
SETS = ("model.n_layer=3", "mesh.stages=3", "mesh.replicas=3", "train.batch_size=12", "train.steps=8",
        "train.eval_every=4", "verify.name=sentinel", "verify.warmup_steps=3", "verify.window=16",
        "verify.decision_log=all", "attack.kind=zeros", "attack.workers=r1s1", "attack.start_step=5")


@pytest.fixture
def wan():
    with wan_link(DELAY_MS, "200mbit", subnet="10.231.13") as link:
        yield link


def _records(run, kind: str = "train") -> list[dict]:
    return [r for r in read_records(run / "metrics.jsonl") if r["kind"] == kind]


def _decisions(run) -> list[tuple]:
    rows = map(json.loads, (run / "verify.jsonl").read_text().splitlines())
    return sorted((r["step"], r["message"], r["src"], r["microbatch"], r["action"], r["reason"])
                  for r in rows)


@pytest.mark.slow  # about 40 s on 2 cores: ten processes and a verifier across two namespaces
def test_a_verifier_on_another_machine_bans_as_the_simulator_does(wan, tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, *SETS, f"link.latency_ms={DELAY_MS}", "dist.shaping=none",
                      "dist.threads=1", "dist.init_timeout_s=90", "dist.timeout_s=30")
    hosts = {name: HostConfig(address, 29561, PLACED[name])
             for name, address in zip(HOSTS, wan.addresses, strict=True)}
    keys = issue_keys(tmp_path, HOSTS)
    for host in HOSTS:
        shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
        save_config(dataclasses.replace(cfg, cluster=ClusterConfig("alice", hosts)),
                    tmp_path / host / "run.toml")
    args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                "data.corpus=corpus.txt", "--key", str(keys[h])] for h in HOSTS}
    assert start_all(wan, tmp_path, HOSTS, args, "run") == {"alice": 0, "bob": 0}, logs(tmp_path)

    sim = tmp_path / "sim"
    Trainer(cfg, sim, progress=False).train()
    alice, bob = (tmp_path / h / "runs" / "x" for h in HOSTS)
    verifier_folder = next(run for run in (alice, bob) if (run / "verify.jsonl").is_file())
    assert _decisions(verifier_folder) == _decisions(sim)
    summary, oracle = (json.loads((run / "summary.json").read_text()) for run in (alice, sim))
    def bans(s: dict) -> list[tuple]:
        return [(b["worker"], b["step"], b["replaced_from"], b["honest"]) for b in s["banned_workers"]]

    assert bans(summary) == bans(oracle) == [("r1s1", 7, "r0s1", False)]  # the donor's state crossed
    for got, expected in zip(_records(alice), _records(sim), strict=True):
        assert got["train_loss"] == pytest.approx(expected["train_loss"], abs=1e-5)
    assert [r["val_loss"] for r in _records(alice, "eval")] == pytest.approx(
        [r["val_loss"] for r in _records(sim, "eval")], abs=1e-5)
    # Nobody else is on the network: the only refusals are honest dials that came before their
    # destination process had registered with its host's agent (retried; docs/security.md).
    assert set(summary["refused"]["by_reason"]) <= {"unknown_destination"}, summary["refused"]
