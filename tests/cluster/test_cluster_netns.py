"""A cluster run on two emulated machines: two network namespaces joined by a shaped link (tbf rate,
TUN relay delay), each with its own run folder and its own copy of the corpus, each running
`meshlearn train --backend dist --host NAME --key FILE`. The placement makes both the pipeline links and the
DP links cross the link (alice: r0s0, r1s1; bob: r0s1, r1s0). The run stops at a step, then
resumes on each machine from its own folder; its losses are the single-process simulator's.

Needs root, ``ip``/``tc`` and /dev/net/tun; skipped with the reason otherwise.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from cluster_run import issue_keys, logs, start_all
from netns import missing
from tiny import tiny_config
from two_hosts import DELAY_MS, HOSTS, PLACED, placed, two_machines

from meshlearn.config import save_config
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


@pytest.fixture
def wan():
    with two_machines("10.231.9") as link:
        yield link


def test_two_machines_stop_and_resume_each_from_its_own_folder_match_the_simulator(wan, tiny_corpus,
                                                                                   tmp_path):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "train.steps=4",
                      "train.checkpoint_every=1", "dist.keep_checkpoints=1", "data.tokenizer=bpe",
                      "data.bpe_vocab_size=300", f"link.latency_ms={DELAY_MS}", "dist.shaping=none",
                      "dist.threads=1", "dist.init_timeout_s=90", "dist.timeout_s=30")
    on_two = placed(cfg, wan, 29533)
    keys = issue_keys(tmp_path, HOSTS)
    for host in HOSTS:  # each machine: its own folder, its own copy of the corpus at its own path
        shutil.copy(tiny_corpus, tmp_path / host / f"corpus-{host}.txt")
    save_config(on_two, tmp_path / "alice" / "run.toml")
    save_config(on_two, tmp_path / "bob" / "run.toml")
    fresh = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                 f"data.corpus=corpus-{h}.txt", "--set", "train.stop_at_step=2", "--key", str(keys[h])]
             for h in HOSTS}
    assert start_all(wan, tmp_path, HOSTS, fresh, "fresh") == {"alice": 0, "bob": 0}, logs(tmp_path)
    runs = {h: tmp_path / h / "runs" / "x" for h in HOSTS}
    for host, run in runs.items():  # stopped at step 2: the agreed checkpoint, older ones pruned
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"], host
        assert sorted(p.name for p in (run / "checkpoints" / "step-000002").iterdir()) == sorted(
            [f"{w}.pt" for w in PLACED[host]] + ["agreed.json", "host.json"]), host
        assert (run / "config.toml").is_file() and (run / "run.json").is_file()
    digests = {h: hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
               for h, run in runs.items()}
    assert digests["alice"] == digests["bob"]  # trained once, by the coordinator, and sent

    resume = {h: ["--resume", "runs/x", "--key", str(keys[h])] for h in HOSTS}
    assert start_all(wan, tmp_path, HOSTS, resume, "resume") == {"alice": 0, "bob": 0}, logs(tmp_path)

    alice, bob = runs["alice"], runs["bob"]
    assert {"metrics.jsonl", "summary.json", "workers.json"} <= {p.name for p in alice.iterdir()}
    assert not {"metrics.jsonl", "summary.json", "workers.json"} & {p.name for p in bob.iterdir()}
    assert json.loads((bob / "coordinator.json").read_text())["coordinator"] == "alice"
    for host, run in runs.items():  # each machine holds its own workers' shards, and only those
        shards = sorted(str(p.relative_to(run)) for p in run.rglob("*.pt"))
        assert shards == sorted(f"checkpoints/step-000004/{w}.pt" for w in PLACED[host]), (host, shards)

    sim = tmp_path / "sim"
    Trainer(cfg, sim, progress=False).train()
    expected = [r["train_loss"] for r in read_records(sim / "metrics.jsonl") if r["kind"] == "train"]
    got = [r["train_loss"] for r in read_records(alice / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in read_records(alice / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) <= 1e-5
