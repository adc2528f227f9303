"""Checkpoints of an elastic cluster run: each machine keeps the shards of the slots it held at
that step, and a checkpoint is complete by an agreement every machine records in its own folder.

Why not ``cluster/checkpoints.py``'s agreement of hosts: under elastic membership the shards of a
step are those of the rows that trained it (``elastic/checkpoints.py``), held wherever each slot's
process ran then (a joiner's on its own host), and a host may have no process left to confirm
anything. So each shard is confirmed by its own process, which wrote and hashed it on its host's
disk:

- every process writes ``checkpoints/step-NNNNNN/<slot>.pt`` in its host's folder and publishes
  ``cluster/checkpoint/<step>/shard/<slot>`` (its host, size and SHA-256) on the coordinator's
  control service — a key only the slot's current holder may write (``cluster/authority.py``);
- the elastic manifest's writer (the last stage of the first row that trained the step) waits for
  the rows' shards as on one machine, then publishes the agreement ``cluster/checkpoint/<step>/agreed``
  (``{"step", "shards": {slot: {host, size, sha256}}}``; no shards: the step stays incomplete) by a
  compare-and-set from empty: the service keeps the first (``cluster/authority.py``);
- every live process waits for it, checks it — every listed entry is the one that slot's own
  process published, the listed slots are of the rows that trained the step and hold a replica of
  every stage — since any last-stage holder may write it; then writes it as ``agreed.json`` in its
  own folder and prunes by it (the newest ``dist.keep_checkpoints`` agreed ones stay): every listed
  shard is on its machine's disk before any process deletes an older checkpoint. An agreement that
  fails the check leaves the step incomplete there (one line).

No ``manifest.json`` is written: a machine's folder never looks complete to ``meshlearn sample``.
On ``--resume`` the launchers pick the step and the slots that start (``cluster/elastic_resume.py``);
each started process loads its own shard from its own folder after checking it against the
agreement there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from meshlearn.atomic import atomic_write_json
from meshlearn.checkpoint_layout import CHECKPOINT_DIR, load_checkpoint_file, sha256_file
from meshlearn.cluster.checkpoints import AGREED, KEYS, prune_agreed, read_json
from meshlearn.mesh.topology import WorkerId
from meshlearn.statefile import CheckpointError, save_state

RESUME_STEP_ENV = "MESHLEARN_RESUME_STEP"  # the step the launchers agreed to resume from


def resume_step() -> int | None:
    """The step this process's launcher named to resume from (None: not a resume)."""
    value = os.environ.get(RESUME_STEP_ENV, "")
    return int(value) if value.isdigit() else None


def read_agreement(folder: Path) -> dict | None:
    """A step folder's ``agreed.json`` (None: none, or not an agreement)."""
    agreement = read_json(folder / AGREED)
    shards = agreement.get("shards") if isinstance(agreement, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(e, dict) for e in shards.values()):
        return None
    return agreement


def _parsed(value: bytes):
    """A shard entry as its process published it (None: not JSON)."""
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


class ElasticClusterCheckpoint:
    """The checkpoint store of one elastic process of a cluster run (the Trainer's ``checkpoints``).

    ``membership``: the elastic manifest's agreement on the listed shards (``ElasticCheckpoints``);
    ``store``: the run's control store (the workers' namespace); ``resume_step``: the step its
    launcher was told to resume from (None: not a resume)."""

    def __init__(self, run_dir: Path, shard: str, host: str, membership, store, deadline_s: float,
                 keep: int, resume_step: int | None = None, poll_s: float = 0.02):
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.shard = shard
        self.host = host
        self.membership = membership
        self.store = store
        self.deadline_s = deadline_s
        self.keep = keep
        self.resume_step = resume_step
        self.poll_s = poll_s

    def save(self, step: int, common: dict, shard: dict) -> Path:
        folder = self.root / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.shard}.pt"
        save_state(path, {"common": common} | shard)
        entry = {"host": self.host, "size": path.stat().st_size, "sha256": sha256_file(path)}
        keys = f"{KEYS}/{step}"
        self.store.set(f"{keys}/shard/{self.shard}", json.dumps(entry))  # before the manifest's mark
        listed, writes = self.membership.manifest(step)
        if writes:
            shards = {w: json.loads(self.store.get(f"{keys}/shard/{w}")) for w in sorted(listed)}
            self.store.compare_set(f"{keys}/agreed", "", json.dumps({"step": step, "shards": shards}))
        elif self.membership.writes():  # this process writes it, and found the step incomplete
            self.store.compare_set(f"{keys}/agreed", "", json.dumps({"step": step, "shards": {}}))
        agreement = self._agreement(step)
        if agreement:
            atomic_write_json(folder / AGREED, agreement)
            prune_agreed(self.root, self.keep, step)
        return folder

    def _agreement(self, step: int) -> dict | None:
        """The step's agreement, once published (None: incomplete, or none came in time: the
        writer waits ``deadline_s`` for the shards, so this waits twice that)."""
        key = f"{KEYS}/{step}/agreed"
        end = time.monotonic() + 2 * self.deadline_s
        while not self.store.check([key]):
            if time.monotonic() > end:
                print(f"meshlearn worker {self.shard}: no agreement on the checkpoint of step {step} within "
                      f"{2 * self.deadline_s:.1f} s: it stays incomplete here", file=sys.stderr, flush=True)
                return None
            time.sleep(self.poll_s)
        value = self.store.get(key)
        try:
            agreement = json.loads(value)
        except (ValueError, UnicodeDecodeError, RecursionError):
            agreement = None
        if isinstance(agreement, dict) and agreement.get("shards") == {}:
            return None  # the writer's word: the step is incomplete
        why = self._flaw(step, agreement)
        if why is not None:
            print(f"meshlearn worker {self.shard}: the agreement on the checkpoint of step {step} {why}: "
                  "it stays incomplete here", file=sys.stderr, flush=True)
            return None
        return agreement

    def _flaw(self, step: int, agreement) -> str | None:
        """Why ``agreement`` (as a last-stage holder published it) is not this step's (None: it is):
        every listed entry must be what that slot's own process published, and the listed slots
        those of the rows that trained the step, a replica of every stage among them — a holder
        could otherwise make every honest process record, and prune by, a checkpoint that is not."""
        shards = agreement.get("shards") if isinstance(agreement, dict) else None
        if not isinstance(shards, dict) or agreement.get("step") != step:
            return 'is not {"step": <this step>, "shards": {slot: entry}}'
        trained = {str(WorkerId(r, s)) for row in self.membership.rows() for s, r in enumerate(row)}
        if strangers := sorted(set(shards) - trained)[:4]:
            return f"lists {', '.join(map(repr, strangers))}, no slot of the rows that trained it"
        if {WorkerId.parse(w).stage for w in shards} != set(range(self.membership.mesh.stages)):
            return "lists no replica of some stage"
        for slot, entry in sorted(shards.items()):
            key = f"{KEYS}/{step}/shard/{slot}"
            if not self.store.check([key]) or _parsed(self.store.get(key)) != entry:
                return f"lists an entry of {slot} that is not the one {slot}'s process published"
        return None

    def load(self) -> tuple[dict, dict]:
        if self.resume_step is None:
            raise FileNotFoundError(f"--resume {self.root.parent}: this process's launcher named no agreed "
                                    "checkpoint to resume from (start it with meshlearn train --resume)")
        folder = self.root / f"step-{self.resume_step:06d}"
        entry = ((read_agreement(folder) or {}).get("shards") or {}).get(self.shard)
        path = folder / f"{self.shard}.pt"
        if entry is None or entry.get("host") != self.host or not path.is_file():
            raise FileNotFoundError(f"--resume {self.root.parent}: {folder} holds no agreed shard of "
                                    f"{self.shard} for host {self.host}")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(path, f"checksum differs from {folder / AGREED}: the file was changed "
                                        "after it was written")
        state = load_checkpoint_file(path, ("common", "workers"))
        return state["common"], state
