"""Checkpoints of a cluster run: no shared disk, and no machine ever holds another's shards.

Each machine's folder gets, per checkpoint ``checkpoints/step-NNNNNN/``:

- ``<worker>.pt``: the shard of each of its own workers (written atomically, as on one machine);
- ``host.json``: this host's manifest: its shards with their sizes and SHA-256, written by the
  host's first worker once every local shard is on disk;
- ``agreed.json``: the agreement that the checkpoint is complete: every host's manifest digest.

A host confirms its part by publishing its manifest's digest on the rendezvous store; the
coordinator's first worker waits for every host's, writes its own ``agreed.json`` first, and then
publishes the agreement, which every other host records in its folder. A host prunes only by that
agreement (the newest ``dist.keep_checkpoints`` agreed checkpoints stay; older folders go): the
newest agreed checkpoint is on every machine's disk before anyone deletes an older one, and it is
recorded in the coordinator's folder before anyone learns of it.

On ``--resume`` each worker states which checkpoints its own folder holds intact for it; the
coordinator picks the newest one it agreed on that every worker holds, and each worker loads its
shard from its own folder after checking it against its host's manifest. The names differ from
the one-machine layout (``manifest.json``): a cluster folder never looks like a complete
checkpoint to ``meshlearn sample`` or ``report``, which need every shard.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from meshlearn.atomic import atomic_write_json
from meshlearn.checkpoint_layout import (
    AGREED,
    CHECKPOINT_DIR,
    load_checkpoint_file,
    sha256_file,
    step_folders,
    step_of,
)
from meshlearn.statefile import CheckpointError, save_state

HOST_MANIFEST = "host.json"
KEYS = "cluster/checkpoint"  # on the rendezvous store, below the run's prefix


def agreed_steps(run_dir: Path) -> list[int]:
    """The checkpoints of this folder that every host confirmed (oldest first)."""
    return [step_of(f) for f in step_folders(Path(run_dir) / CHECKPOINT_DIR) if (f / AGREED).is_file()]


def read_json(path: Path) -> dict | None:
    """A JSON file of a checkpoint folder (None: missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def prune_agreed(root: Path, keep: int, newest: int) -> None:
    """Keep the newest ``keep`` agreed checkpoints under ``root``; drop older folders, agreed or not."""
    kept = {f"step-{s:06d}" for s in agreed_steps(root.parent)[-keep:]}
    for folder in step_folders(root):
        if folder.name not in kept and step_of(folder) < newest:
            shutil.rmtree(folder, ignore_errors=True)


class StoreWaits:
    """Reads of keys other processes will write, each with a deadline, checking the run's health
    between polls (a failed peer ends the wait with its name, not a timeout)."""

    def __init__(self, store, health, poll_s: float = 0.02):
        self.store = store
        self.health = health
        self.poll_s = poll_s

    def get(self, key: str, what: str, deadline_s: float) -> str:
        end = time.monotonic() + deadline_s
        while not self.store.check([key]):
            self.health.check()
            if time.monotonic() > end:
                raise TimeoutError(f"{what} did not come within {deadline_s:g} s")
            time.sleep(self.poll_s)
        return self.store.get(key).decode()


class ClusterCheckpoint:
    """The checkpoint store of one worker of a cluster run (the Trainer's ``checkpoints``).

    ``local``: the workers of this host, in rank order (the first one is its lead); ``hosts``:
    every host that runs workers → its workers; ``coordinator``: the host whose lead agrees."""

    def __init__(self, run_dir: Path, shard: str, host: str, local: list[str], hosts: dict[str, list[str]],
                 coordinator: str, waits: StoreWaits, deadline_s: float, resume_deadline_s: float, keep: int):
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.shard = shard
        self.host = host
        self.local = local
        self.hosts = hosts
        self.coordinator = coordinator
        self.waits = waits
        self.deadline_s = deadline_s
        self.resume_deadline_s = resume_deadline_s
        self.keep = keep

    @property
    def lead(self) -> bool:
        return self.shard == self.local[0]

    def save(self, step: int, common: dict, shard: dict) -> Path:
        folder = self.root / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.shard}.pt"
        save_state(path, {"common": common} | shard)
        entry = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        store, keys = self.waits.store, f"{KEYS}/{step}"
        store.set(f"{keys}/shard/{self.shard}", json.dumps(entry))
        if not self.lead:
            return folder
        shards = {w: json.loads(self.waits.get(f"{keys}/shard/{w}", f"worker {w}'s shard of step {step}",
                                               self.deadline_s)) for w in self.local}
        atomic_write_json(folder / HOST_MANIFEST, {"step": step, "host": self.host, "shards": shards})
        store.set(f"{keys}/host/{self.host}", sha256_file(folder / HOST_MANIFEST))
        if self.host == self.coordinator:
            hosts = {h: self.waits.get(f"{keys}/host/{h}", f"host {h}'s confirmation of step {step}",
                                       self.deadline_s) for h in sorted(self.hosts)}
            agreement = json.dumps({"step": step, "hosts": hosts})
            atomic_write_json(folder / AGREED, json.loads(agreement))  # recorded here before it is known
            store.set(f"{keys}/agreed", agreement)
        else:
            agreement = self.waits.get(f"{keys}/agreed", f"the coordinator's agreement on step {step}",
                                       self.deadline_s)
            atomic_write_json(folder / AGREED, json.loads(agreement))
        prune_agreed(self.root, self.keep, step)
        return folder

    def _intact(self) -> list[int]:
        """Steps whose folder here holds this worker's shard as its host's manifest lists it."""
        steps = []
        for folder in step_folders(self.root):
            listed = (read_json(folder / HOST_MANIFEST) or {}).get("shards", {}).get(self.shard)
            path = folder / f"{self.shard}.pt"
            if listed and path.is_file() and path.stat().st_size == listed["size"]:
                steps.append(step_of(folder))
        return steps

    def load(self) -> tuple[dict, dict]:
        store, keys = self.waits.store, f"{KEYS}/resume"
        store.set(f"{keys}/{self.shard}", json.dumps(self._intact()))
        if self.host == self.coordinator and self.lead:
            common = set(agreed_steps(self.root.parent))
            for w in sorted(w for workers in self.hosts.values() for w in workers):
                common &= set(json.loads(self.waits.get(f"{keys}/{w}", f"worker {w}'s checkpoints",
                                                        self.resume_deadline_s)))
            store.set(f"{keys}/step", str(max(common, default=-1)))
        step = int(self.waits.get(f"{keys}/step", "the coordinator's choice of checkpoint",
                                  self.resume_deadline_s))
        if step < 0:
            raise FileNotFoundError(f"--resume {self.root.parent}: no checkpoint that the coordinator "
                                    f"agreed on is held by every host")
        folder = self.root / f"step-{step:06d}"
        path = folder / f"{self.shard}.pt"
        listed = json.loads((folder / HOST_MANIFEST).read_text())["shards"][self.shard]
        if sha256_file(path) != listed["sha256"]:
            raise CheckpointError(path, f"checksum differs from {folder / HOST_MANIFEST}: the file was "
                                        "changed after it was written")
        state = load_checkpoint_file(path, ("common", "workers"))
        return state["common"], state
