"""A cluster run among strangers (issue 27): two machines (network namespaces joined by a shaped link)
train P=2 × D=2 with their hosts' keys while a third namespace, which holds no credential, sends
every listening port of the run random bytes, a TCPStore client writing ``abort``, the same
behind a valid routing preamble, an HTTP kill request and 100 idle connections, in rounds. The run
finishes every step with the undisturbed simulator's losses, blames nobody, and counts what it
refused in summary.json; while it trains, each machine listens on its one configured port only.

Needs root, ``ip``/``tc`` and /dev/net/tun; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_run import finish, issue_keys, logs, start
from netns import Wan, missing, stranger
from tiny import tiny_config
from two_hosts import DELAY_MS, HOSTS, PLACED, placed, two_machines

import meshlearn
from meshlearn.config import save_config
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

PORT = 29547
STEPS = 120
STRANGER = Path(__file__).parent / "stranger.py"


@pytest.fixture
def wan():
    with two_machines("10.231.11") as link:
        yield link


def _listeners(wan: Wan, side: int) -> set[str]:
    """The TCP ports listening in a host's namespace, as ``address:port``."""
    out = subprocess.run(["ip", "netns", "exec", wan.namespaces[side], "ss", "-ltnH"], capture_output=True,
                         text=True, check=True, timeout=10).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


def _train_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len([r for r in read_records(metrics) if r["kind"] == "train"]) if metrics.is_file() else 0


def _wait_for(condition, timeout_s: float, what: str, procs) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert all(p.poll() is None for p in procs.values()), f"a launcher ended before {what}"
        assert time.monotonic() < end, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def test_strangers_cannot_stop_or_slow_a_keyed_cluster_run(wan, tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", f"train.steps={STEPS}",
                      f"link.latency_ms={DELAY_MS}", "dist.shaping=none", "dist.threads=1",
                      "dist.init_timeout_s=90", "dist.timeout_s=30")
    keys = issue_keys(tmp_path, HOSTS)
    for host in HOSTS:
        shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
        save_config(placed(cfg, wan, PORT), tmp_path / host / "run.toml")
    args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                "data.corpus=corpus.txt", "--key", str(keys[h])] for h in HOSTS}
    ports = [f"{address}:{PORT}" for address in wan.addresses]
    alice = tmp_path / "alice" / "runs" / "x"
    env = os.environ | {"PYTHONPATH": str(Path(meshlearn.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    with stranger(wan) as space:
        procs = start(wan, tmp_path, HOSTS, args, "run")
        attack = subprocess.Popen(["ip", "netns", "exec", space, sys.executable, str(STRANGER), *ports],
                                  env=env, stdout=(tmp_path / "stranger.log").open("w"),
                                  stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: _train_steps(alice) >= 1, 150, "first step", procs)
            for side, port in enumerate(ports):  # the links are up: nothing listens but the one port
                assert _listeners(wan, side) == {port}, (side, _listeners(wan, side))
            codes = finish(procs, limit_s=150)
        finally:
            attack.send_signal(signal.SIGKILL)
            attack.wait(timeout=10)
            finish(procs, limit_s=1)
    said = (tmp_path / "stranger.log").read_text()
    assert codes == {"alice": 0, "bob": 0}, logs(tmp_path) + said
    assert "round 1 done" in said and "TCPStore refused" in said and "got through" not in said, said

    sim = tmp_path / "sim"
    Trainer(cfg, sim, progress=False).train()
    expected = [r["train_loss"] for r in read_records(sim / "metrics.jsonl") if r["kind"] == "train"]
    got = [r["train_loss"] for r in read_records(alice / "metrics.jsonl") if r["kind"] == "train"]
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) <= 1e-5

    summary = json.loads((alice / "summary.json").read_text())
    refused = summary["refused"]
    assert refused["total"] >= 2 * 100, refused  # at least one round of idle connections per machine
    assert refused["by_reason"].get("preamble_malformed", 0) >= 2 * 7, refused  # bytes, TCPStore, HTTP
    assert refused["by_reason"].get("handshake_failed", 0) >= 1, refused  # TCPStore bytes behind a preamble
    assert refused["by_reason"].get("authority", 0) == 0, refused  # no honest request was refused
    assert set(refused["by_host"]) == set(HOSTS)
    assert refused["by_sender"] == {} and refused["claims"] == {}, refused  # a stranger is nobody's
    for host in HOSTS:
        record = json.loads((tmp_path / host / "runs" / "x" / "security.json").read_text())
        assert record["host"] == host and record["refused_total"] >= 100, record
        assert record["by_sender"] == {} and set(record["processes"]) <= set(PLACED[host]), record
    text = logs(tmp_path)
    assert "stopped answering" not in text and "reported by host" not in text and "failed:" not in text
