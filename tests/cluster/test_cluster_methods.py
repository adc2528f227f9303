"""The methods that run processes of their own, in a cluster run among strangers: two machines
(network namespaces, a shaped link), each with its host's key, and the extra processes placed on
bob, the machine that is not the coordinator. Every message to or from them crosses a machine over
the authenticated links of each host's one port.

- SENTINEL: P = 3 × D = 3 with the verifier on bob while r1s1 (on alice) sends zeros. The
  simulator with verification is the oracle, as on one machine (tests/distributed/
  test_dist_sentinel.py): the same decision on every message, the same ban at the same step with
  the same donor, and the simulator's losses to the end.
- The anchor circuit: P = 2 × D = 2 masked, with the anchor's two stages on bob; its passes,
  bytes and the corrected losses are the simulator's (tests/distributed/test_dist_anchor.py).

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
SENTINEL = ("model.n_layer=3", "mesh.stages=3", "mesh.replicas=3", "train.batch_size=12", "train.steps=8",
            "train.eval_every=4", "verify.name=sentinel", "verify.warmup_steps=3", "verify.window=16",
            "verify.decision_log=all", "attack.kind=zeros", "attack.workers=r1s1", "attack.start_step=5")
ANCHOR = ("mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b", "codec.name=mask", "codec.keep=0.25",
          "optim.spectral.enabled=true", "train.steps=6", "train.eval_every=6", "anchor.z=1",
          "anchor.delay=2", "anchor.max_late=2", "anchor.wire_dtype=fp32", "anchor.send=gradients",
          "anchor.weights=snapshot", "anchor.bandwidth_mbit=10000", "anchor.latency_ms=0", "anchor.rank=3")


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


def _both(wan, tiny_corpus, tmp_path, sets: tuple[str, ...], placed: dict[str, tuple[str, ...]],
          trusted: tuple[str, ...] = ()):
    """The keyed cluster run of ``sets`` placed as ``placed`` (the hosts ``trusted`` marked so) and
    the simulator's run of the same config (the losses compared): the coordinator's folder, bob's
    folder, the simulator's folder."""
    cfg = tiny_config(tiny_corpus, *sets, f"link.latency_ms={DELAY_MS}", "dist.shaping=none",
                      "dist.threads=1", "dist.init_timeout_s=90", "dist.timeout_s=30")
    hosts = {name: HostConfig(address, 29561, placed[name], trusted=name in trusted)
             for name, address in zip(HOSTS, wan.addresses, strict=True)}
    keys = issue_keys(tmp_path, HOSTS)
    for host in HOSTS:
        shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
        save_config(dataclasses.replace(cfg, cluster=ClusterConfig("alice", hosts)),
                    tmp_path / host / "run.toml")
    args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                "data.corpus=corpus.txt", "--key", str(keys[h])] for h in HOSTS}
    assert start_all(wan, tmp_path, HOSTS, args, "run") == {"alice": 0, "bob": 0}, logs(tmp_path)
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    alice, bob = (tmp_path / h / "runs" / "x" for h in HOSTS)
    summary = json.loads((alice / "summary.json").read_text())
    # Nobody else is on the network: the only refusals are honest dials that came before their
    # destination process had registered with its host's agent (retried; docs/security.md).
    assert set(summary["refused"]["by_reason"]) <= {"unknown_destination"}, summary["refused"]
    for got, expected in zip(_records(alice), _records(tmp_path / "sim"), strict=True):
        assert got["train_loss"] == pytest.approx(expected["train_loss"], abs=1e-5)
    assert [r["val_loss"] for r in _records(alice, "eval")] == pytest.approx(
        [r["val_loss"] for r in _records(tmp_path / "sim", "eval")], abs=1e-5)
    return alice, bob, tmp_path / "sim"


@pytest.mark.slow  # about 30 s on 2 cores: nine workers and a verifier across two namespaces
def test_a_verifier_on_another_machine_bans_as_the_simulator_does(wan, tiny_corpus, tmp_path):
    # Every stage on both machines, the attacker (r1s1) on the coordinator, the verifier on bob,
    # which the run's owner marks trusted (a verifier bans and evicts: only the coordinator or a
    # trusted host may hold it, a compat row).
    placed = {"alice": ("r0s0", "r1s1", "r2s2", "r0s2"),
              "bob": ("r0s1", "r1s0", "r1s2", "r2s0", "r2s1", "verifier")}
    alice, _, sim = _both(wan, tiny_corpus, tmp_path, SENTINEL, placed, trusted=("bob",))
    assert _decisions(alice) == _decisions(sim)  # the verdicts crossed to the records writer

    def bans(run) -> list[tuple]:
        summary = json.loads((run / "summary.json").read_text())
        return [(b["worker"], b["step"], b["replaced_from"], b["honest"]) for b in summary["banned_workers"]]

    assert bans(alice) == bans(sim) == [("r1s1", 7, "r0s1", False)]  # the donor's state crossed


@pytest.mark.slow  # about 20 s on 2 cores: four workers and two anchor stages across two namespaces
def test_anchor_stages_on_another_machine_correct_as_in_the_simulator(wan, tiny_corpus, tmp_path):
    placed = {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s0", "a0s0", "a0s1")}
    alice, _, sim = _both(wan, tiny_corpus, tmp_path, ANCHOR, placed)
    got, expected = (json.loads((run / "summary.json").read_text()) for run in (alice, sim))
    assert got["anchor_passes"] == expected["anchor_passes"] == 3
    assert got["anchor_delivered"] == 3 * 4 and got["anchor_dropped_late"] == 0
    for key in ("anchor_bytes_snapshot", "anchor_bytes_boundary", "anchor_bytes_gradients",
                "spectral_anchor_accepted", "spectral_corrected_steps"):
        assert got[key] == expected[key], key
