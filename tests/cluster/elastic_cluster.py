"""One elastic cluster run (``elastic.membership = "control"``) on the two machines of
``two_hosts``: its launchers, the joiners started on alice, and what its folders and the
coordinator's workers.json say (shared by the elastic netns tests)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from cluster_run import finish, issue_keys, logs, start
from netns import Wan
from tiny import tiny_config
from two_hosts import DELAY_MS, HOSTS, placed

import meshlearn
from meshlearn.config import save_config
from meshlearn.jsonl import read_records
from meshlearn.statefile import load_state

PORT = 29541


class ElasticCluster:
    """The two launchers of one elastic cluster run, and the joiners started on alice."""

    def __init__(self, wan: Wan, tmp_path: Path, tiny_corpus: Path, *settings: str,
                 started: tuple[str, ...] = ()):
        """``settings``: config keys beyond the defaults (a long run); ``started``: ``--set``s of the
        first start only (not in the run's config.toml)."""
        cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.stages=2", "mesh.replicas=2", "train.steps=2000",
                          "elastic.enabled=true", "elastic.membership=control", "dist.timeout_s=5",
                          "dist.dead_after_s=2", f"link.latency_ms={DELAY_MS}", "dist.shaping=none",
                          "dist.threads=1", "dist.init_timeout_s=90", "data.tokenizer=bpe",
                          "data.bpe_vocab_size=300", *settings)
        self.wan, self.tmp_path = wan, tmp_path
        self.keys = issue_keys(tmp_path, HOSTS)
        for host in HOSTS:
            shutil.copy(tiny_corpus, tmp_path / host / "corpus.txt")
            save_config(placed(cfg, wan, PORT), tmp_path / host / "run.toml")
        self.runs = {h: tmp_path / h / "runs" / "x" for h in HOSTS}
        self.coordinator = f"{wan.addresses[0]}:{PORT}"
        args = {h: ["--backend", "dist", "--config", "run.toml", "--out", "runs/x", "--set",
                    "data.corpus=corpus.txt", *(x for s in started for x in ("--set", s)), "--key",
                    str(self.keys[h])] for h in HOSTS}
        self.procs = start(wan, tmp_path, HOSTS, args, "run")
        self.joiners: list[subprocess.Popen] = []

    def resume(self) -> None:
        """Every machine's ``meshlearn train --resume runs/x --host NAME --key FILE``, from its own folder."""
        args = {h: ["--resume", "runs/x", "--key", str(self.keys[h])] for h in HOSTS}
        self.procs = start(self.wan, self.tmp_path, HOSTS, args, "resume")

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


def shard(run: Path, step: int, name: str) -> dict:
    return load_state(run / "checkpoints" / f"step-{step:06d}" / f"{name}.pt")["workers"][name]


def assert_identical(a: dict, b: dict, what: str) -> None:
    assert a["version"] == b["version"], what
    for key, tensor in a["module"].items():
        assert torch.equal(tensor, b["module"][key]), f"{what}: {key}"
    for (pa, sa), (pb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items(),
                                  strict=True):
        assert pa == pb and all(torch.equal(sa[k], sb[k]) for k in sa), f"{what}: optimizer {pa}"
