"""A run folder's checkpoint format: file and folder names, manifests, which sharded checkpoint is complete.

Below the trainer and the runtimes alike: the trainer writes checkpoints in this layout
(``train/checkpoint.py``'s stores), and the runtimes read it without the trainer — the elastic
layer (which shards the newest checkpoint lists), a cluster's agreed checkpoints
(``cluster/checkpoints.py``) and its resume. A sharded checkpoint is
``checkpoints/step-NNNNNN/<worker>.pt`` plus ``manifest.json`` (written last); it is complete only
once the manifest and every shard it lists exist.

Every file is a meshlearn state file (safetensors + JSON, ``meshlearn/statefile.py``), never a
pickle: a file that is not a meshlearn checkpoint raises ``CheckpointError`` (one line, naming the
file), never a traceback.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshlearn.statefile import CheckpointError, load_state

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
SINGLE_MANIFEST = "checkpoint.json"
CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
AGREED = "agreed.json"  # a cluster run's agreement that a checkpoint is complete (cluster/checkpoints.py)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_checkpoint_file(path: Path, keys: tuple[str, ...] = ("config", "totals", "workers"),
                         device=None) -> dict:
    """A meshlearn checkpoint (or shard), read without pickle (meshlearn/statefile.py); tensors on
    ``device`` (None: where they were saved). CheckpointError for anything else."""
    state = load_state(path, device)
    if not isinstance(state, dict) or not set(keys) <= set(state):
        got = sorted(state)[:5] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(path, f"not a meshlearn checkpoint (it holds {got}, expected the "
                                    f"keys {', '.join(keys)})")
    return state


def step_of(folder: Path) -> int:
    """The step a ``step-NNNNNN`` folder holds."""
    return int(folder.name.removeprefix("step-"))


def step_folders(root: Path) -> list[Path]:
    """The ``step-NNNNNN`` folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((f for f in root.iterdir() if f.is_dir() and f.name.startswith("step-")
                   and f.name.removeprefix("step-").isdigit()), key=step_of)


def is_complete(folder: Path) -> bool:
    """Whether a step folder's manifest and every shard it lists exist."""
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
    complete = [f for f in step_folders(Path(run_dir) / CHECKPOINT_DIR) if is_complete(f)]
    return complete[-1] if complete else None
