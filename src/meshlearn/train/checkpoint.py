"""Checkpoint layouts: one file when one process holds every worker, shards plus a manifest otherwise.

The Trainer decides what a checkpoint holds (``common``: config, counters; ``shard``: this
process's workers, driver state and RNG); a store decides where it goes. A sharded checkpoint is
complete only once its manifest exists, and the manifest is written last, by one process, after
every shard is on disk (a barrier): a crash at any moment leaves either a complete checkpoint or
an incomplete folder that resume ignores.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from meshlearn.train.files import atomic_torch_save, atomic_write_json

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"


class SingleFileCheckpoint:
    """``checkpoint.pt``: everything in one file (the simulator, where one process holds all)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / CHECKPOINT

    def save(self, step: int, common: dict, shard: dict) -> Path:
        atomic_torch_save(self.path, common | shard)
        return self.path

    def load(self) -> tuple[dict, dict]:
        if not self.path.is_file():
            hint = " (it holds a sharded dist checkpoint: resume with --backend dist)" \
                if latest_complete(self.path.parent) else ""
            raise FileNotFoundError(f"--resume {self.path.parent}: no {CHECKPOINT} in the run folder{hint}")
        state = torch.load(self.path, weights_only=False)
        return state, state


class ShardedCheckpoint:
    """``checkpoints/step-NNNNNN/<worker>.pt`` per process, then ``manifest.json`` (written last)."""

    def __init__(self, run_dir: Path, shard: str, shards: list[str], barrier: Callable[[str], None],
                 writer: bool, keep: int = 2):
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.shard = shard
        self.shards = sorted(shards)
        self.barrier = barrier
        self.writer = writer
        self.keep = keep

    def save(self, step: int, common: dict, shard: dict) -> Path:
        folder = self.root / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(folder / f"{self.shard}.pt", {"common": common} | shard)
        self.barrier(f"checkpoint of step {step}")  # every shard is on disk
        if self.writer:
            atomic_write_json(folder / MANIFEST, {"step": step, "shards": self.shards})
            self._prune(step)
        return folder

    def load(self) -> tuple[dict, dict]:
        folder = latest_complete(self.root.parent)
        if folder is None:
            hint = " (it holds a simulator checkpoint: resume without --backend dist)" \
                if (self.root.parent / CHECKPOINT).is_file() else ""
            raise FileNotFoundError(f"--resume {self.root.parent}: no complete checkpoint in "
                                    f"{self.root}{hint}")
        state = torch.load(folder / f"{self.shard}.pt", weights_only=False)
        return state["common"], state

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop older folders, complete or not."""
        complete = [f for f in _step_folders(self.root) if _is_complete(f)]
        kept = {f.name for f in complete[-self.keep:]}
        for folder in _step_folders(self.root):
            if folder.name not in kept and _step(folder) < newest:
                shutil.rmtree(folder, ignore_errors=True)


def _step(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def _step_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((f for f in root.iterdir() if f.is_dir() and f.name.startswith("step-")
                   and f.name.removeprefix("step-").isdigit()), key=_step)


def _is_complete(folder: Path) -> bool:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    try:
        shards = json.loads(manifest.read_text())["shards"]
    except (json.JSONDecodeError, KeyError):
        return False
    return all((folder / f"{name}.pt").is_file() for name in shards)


def latest_complete(run_dir: Path) -> Path | None:
    """The newest sharded checkpoint whose manifest and every listed shard exist."""
    complete = [f for f in _step_folders(Path(run_dir) / CHECKPOINT_DIR) if _is_complete(f)]
    return complete[-1] if complete else None


def load_run_state(run_dir: Path) -> dict:
    """A run's latest checkpoint as one dict (``config``, ``workers`` of every worker, ...), whichever
    layout wrote it: the single file, or the shards of the newest complete sharded checkpoint."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINT).is_file():
        return torch.load(run_dir / CHECKPOINT, weights_only=False)
    folder = latest_complete(run_dir)
    if folder is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint; train (or resume) the run first")
    state: dict = {"workers": {}}
    for name in json.loads((folder / MANIFEST).read_text())["shards"]:
        shard = torch.load(folder / f"{name}.pt", weights_only=False)
        workers = state["workers"] | shard.pop("workers")
        state |= shard.pop("common") | shard  # the same in every shard but the workers
        state["workers"] = workers
    return state
