"""Checkpoint stores: one file when one process holds every worker, shards plus a manifest otherwise.

The run folder's format itself (names, manifests, which sharded checkpoint is complete) is
``meshlearn/checkpoint_layout.py``, which the runtimes read without the trainer.

The Trainer decides what a checkpoint holds (``common``: config, counters; ``shard``: this
process's workers, driver state and RNG); a store decides where it goes. A sharded checkpoint is
complete only once its manifest exists, and the manifest is written last, by one process, after
every shard is on disk (a barrier): a crash at any moment leaves either a complete checkpoint or
an incomplete folder that resume ignores.

The simulator's single file keeps the previous checkpoint beside the newest one
(``checkpoint.pt``, ``checkpoint.prev.pt``) and a manifest (``checkpoint.json``) with each file's
step, size and SHA-256. Loading verifies the newest against it and falls back to the previous one
with a warning, so one truncated file never costs the run. A file that is not a meshlearn
checkpoint raises ``CheckpointError`` (one line, naming the file), never a traceback.

Every file is a meshlearn state file (safetensors + JSON, ``meshlearn/statefile.py``), never a
pickle: a run folder may come from someone else (``--resume``, ``sample``, ``model.init``), and
loading it must not run code. The ``.pt`` names stayed; a pickle under them is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from meshlearn.atomic import atomic_path, atomic_write_json, write_synced
from meshlearn.checkpoint_layout import (
    AGREED,
    CHECKPOINT,
    CHECKPOINT_DIR,
    MANIFEST,
    PREVIOUS,
    SINGLE_MANIFEST,
    is_complete,
    latest_complete,
    load_checkpoint_file,
    sha256_file,
    step_folders,
    step_of,
)
from meshlearn.statefile import CheckpointError, encode_state, save_state


def _entry(path: Path, step: int) -> dict:
    return {"step": step, "size": path.stat().st_size, "sha256": sha256_file(path)}


def _read_manifest(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / SINGLE_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _damage(path: Path, entry: dict | None, others: list[dict]) -> str | None:
    """Why ``path`` does not match its manifest entry (None: it does, or there is no entry). A file
    that matches another entry is intact too: a crash in the middle of a rotation leaves that."""
    if not path.is_file():
        return "missing"
    if entry is None:
        return None
    size = path.stat().st_size
    candidates = [e for e in [entry, *others] if e and e.get("size") == size]
    if not candidates:
        return f"{size} bytes, {entry['size']} expected: truncated or overwritten"
    digest = sha256_file(path)
    if not any(e.get("sha256") == digest for e in candidates):
        return "checksum mismatch: the file was changed after it was written"
    return None


def load_verified(run_dir: Path, warn=None) -> dict:
    """The newest intact single-file checkpoint of ``run_dir``: ``checkpoint.pt`` if it matches
    the manifest and loads, else ``checkpoint.prev.pt`` (with a warning naming the damage)."""
    run_dir = Path(run_dir)
    warn = warn or (lambda text: print(f"meshlearn: warning: {text}", file=sys.stderr))
    manifest = _read_manifest(run_dir)
    problems = []
    for name in (CHECKPOINT, PREVIOUS):
        path = run_dir / name
        if name == PREVIOUS and not path.is_file():
            break
        why = _damage(path, manifest.get(name), [e for n, e in manifest.items() if n != name])
        if why is None:
            try:
                state = load_checkpoint_file(path)
            except CheckpointError as err:
                why = str(err).removeprefix(f"{path}: ")
            else:
                if problems:
                    warn(f"{problems[0]}; resuming from the previous checkpoint {path} "
                         f"(step {state['totals']['step']})")
                return state
        problems.append(f"{path} is damaged ({why})")
    if not problems or problems == [f"{run_dir / CHECKPOINT} is damaged (missing)"]:
        raise FileNotFoundError(f"{run_dir}: no {CHECKPOINT} in the run folder")
    raise CheckpointError(run_dir, "no usable checkpoint: " + "; ".join(problems))


class SingleFileCheckpoint:
    """``checkpoint.pt`` (newest) and ``checkpoint.prev.pt``, listed in ``checkpoint.json``:
    everything in one file (the simulator, where one process holds all)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / CHECKPOINT

    def save(self, step: int, common: dict, shard: dict) -> Path:
        # New file first (under a temporary name), then the old newest becomes the previous, then
        # the new one moves in, then the manifest: a crash anywhere leaves an intact checkpoint.
        previous = self.run_dir / PREVIOUS
        manifest = _read_manifest(self.run_dir)
        with atomic_path(self.path) as tmp:
            write_synced(tmp, encode_state(common | shard))
            entry = _entry(tmp, step)
            if self.path.is_file():
                os.replace(self.path, previous)
                manifest[PREVIOUS] = manifest.get(CHECKPOINT) or _entry(previous, -1)
        manifest[CHECKPOINT] = entry
        atomic_write_json(self.run_dir / SINGLE_MANIFEST, manifest)
        return self.path

    def load(self) -> tuple[dict, dict]:
        if not self.path.is_file() and not (self.run_dir / PREVIOUS).is_file():
            hint = " (it holds a sharded dist checkpoint: resume with --backend dist)" \
                if latest_complete(self.run_dir) else ""
            raise FileNotFoundError(f"--resume {self.run_dir}: no {CHECKPOINT} in the run folder{hint}")
        state = load_verified(self.run_dir)
        return state, state


class ShardedCheckpoint:
    """``checkpoints/step-NNNNNN/<worker>.pt`` per process, then ``manifest.json`` (written last).

    ``membership`` (elastic runs, where the set of processes changes): after this process's shard
    is on disk, ``membership.manifest(step)`` returns the shards the manifest lists (those agreed
    mesh-wide to be written, and written) and whether this process writes it; on resume, a shard
    the manifest does not list loads ``membership.substitute(shard, listed)`` instead (a replica
    of the same stage, identical to it at any committed step). Without it: every shard, a barrier
    of all processes, and ``writer`` writes the manifest."""

    def __init__(self, run_dir: Path, shard: str, shards: list[str], barrier: Callable[[str], None],
                 writer: bool, keep: int = 2, membership=None):
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.shard = shard
        self.shards = sorted(shards)
        self.barrier = barrier
        self.writer = writer
        self.keep = keep
        self.membership = membership

    def save(self, step: int, common: dict, shard: dict) -> Path:
        folder = self.root / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        save_state(folder / f"{self.shard}.pt", {"common": common} | shard)
        if self.membership is not None:
            shards, writes = self.membership.manifest(step)
        else:
            self.barrier(f"checkpoint of step {step}")  # every shard is on disk
            shards, writes = self.shards, self.writer
        if writes:
            atomic_write_json(folder / MANIFEST, {"step": step, "shards": sorted(shards)})
            self._prune(step)
        return folder

    def load(self) -> tuple[dict, dict]:
        folder = latest_complete(self.root.parent)
        if folder is None:
            hint = " (it holds a simulator checkpoint: resume without --backend dist)" \
                if (self.root.parent / CHECKPOINT).is_file() else ""
            raise FileNotFoundError(f"--resume {self.root.parent}: no complete checkpoint in "
                                    f"{self.root}{hint}")
        name = self.shard
        listed = json.loads((folder / MANIFEST).read_text())["shards"]
        if name not in listed and self.membership is not None:
            name = self.membership.substitute(name, listed)
        state = load_checkpoint_file(folder / f"{name}.pt", ("common", "workers"))
        if name != self.shard:  # a replica's state, under this worker's name
            state["workers"] = {self.shard: state["workers"][name]}
        return state["common"], state

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop older folders, complete or not."""
        complete = [f for f in step_folders(self.root) if is_complete(f)]
        kept = {f.name for f in complete[-self.keep:]}
        for folder in step_folders(self.root):
            if folder.name not in kept and step_of(folder) < newest:
                shutil.rmtree(folder, ignore_errors=True)


def load_run_state(run_dir: Path) -> dict:
    """A run's latest checkpoint as one dict (``config``, ``workers`` of every worker, ...), whichever
    layout wrote it: the single file, or the shards of the newest complete sharded checkpoint."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINT).is_file() or (run_dir / PREVIOUS).is_file():
        return load_verified(run_dir)
    folder = latest_complete(run_dir)
    agreed = [f for f in step_folders(run_dir / CHECKPOINT_DIR) if (f / AGREED).is_file()]
    if folder is None and agreed:
        raise FileNotFoundError(f"{run_dir}: one machine's folder of a cluster run: its newest agreed "
                                f"checkpoint (step {step_of(agreed[-1])}) holds only this machine's shards, "
                                "and no machine holds every shard (docs/cluster.md, 'Not yet')")
    if folder is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint; train (or resume) the run first")
    state: dict = {"workers": {}}
    for name in json.loads((folder / MANIFEST).read_text())["shards"]:
        shard = load_checkpoint_file(folder / f"{name}.pt", ("common", "workers"), device="cpu")
        workers = state["workers"] | shard.pop("workers")
        state |= shard.pop("common") | shard  # the same in every shard but the workers
        state["workers"] = workers
    return state
