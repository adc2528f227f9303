"""Runs describe themselves: commit, uncommitted changes, package versions, command line.

``run.json`` keeps one record per start of the run (``history``: the fresh start, then each
resume with the step it resumed from and the config keys it changed); its top level repeats the
latest record. ``check_resumable`` refuses a change a checkpoint cannot continue under.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import meshlearn
from meshlearn.atomic import atomic_write_json
from meshlearn.config_diff import changed_keys, flatten
from meshlearn.errors import ConfigError

RUN_JSON = "run.json"
# Keys a checkpoint cannot continue under: the weights' shapes and meaning, the mesh that holds
# them, the token ids, the optimizer state's kind, the checkpoint layout.
NOT_RESUMABLE = ("model.", "mesh.stages", "mesh.replicas", "data.tokenizer", "data.bpe_vocab_size",
                 "optim.name", "backend")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(meshlearn.__file__).parent)
        return out.stdout if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def describe_run() -> dict:
    diff = _git("diff", "HEAD")
    versions = {}
    for pkg in ("torch", "numpy", "tokenizers", "matplotlib"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "meshlearn": meshlearn.__version__,
        "commit": _git("rev-parse", "HEAD").strip() or None,
        "uncommitted_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "argv": sys.argv,
    }


def _resumable(key: str, old: Any, new: Any) -> bool:
    if key.startswith("cluster.hosts.") and key.endswith(".workers"):
        return False  # each machine resumes the shards of its own workers, from its own folder
    if key == "mesh.schedule":  # flush schedules swap freely at a drain point; async plans differ
        return "async" not in (old, new)
    return not any(key == p or (p.endswith(".") and key.startswith(p)) for p in NOT_RESUMABLE)


def _same(saved: Any, text: str) -> bool:
    """Whether a ``--set`` value (text) says what the saved config holds."""
    if str(saved).lower() == text.strip().lower():
        return True
    try:
        return float(saved) == float(text)
    except (TypeError, ValueError):
        return False


def refuse_unresumable_sets(old: dict[str, Any], sets: list[str]) -> None:
    """Before a resumed config is built: a ``--set`` that changes a key a resume cannot change is
    refused as such, rather than by whatever check of the new value fails first (a new
    model.n_layer would otherwise be reported as not divisible by mesh.stages)."""
    saved = flatten(old)
    for item in sets:
        key, _, text = item.partition("=")
        key = key.strip()
        if key in saved and not _same(saved[key], text) and not _resumable(key, saved[key], text.strip()):
            was = saved[key]
            raise ConfigError(key, _as_typed(text, was), f"cannot change on --resume (the run was trained "
                                                         f"with {key} = {was!r}); start a new run with --out "
                                                         f"instead")


def _as_typed(text: str, like: Any) -> Any:
    """``text`` as the saved value's type where it parses (so the message reads ``= 64``)."""
    if not isinstance(like, int | float) or isinstance(like, bool):
        return text
    try:
        return type(like)(text.strip())
    except ValueError:
        return text


def check_resumable(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """The keys a resume changes; raises ConfigError naming the first that cannot change."""
    changed = changed_keys(old, new)
    for key, (was, now) in changed.items():
        if key == "model.vocab_size" and now == 0:
            continue  # 0 means "from the tokenizer": the saved config has it filled in
        if not _resumable(key, was, now):
            raise ConfigError(key, now, f"cannot change on --resume (the run was trained with "
                                        f"{key} = {was!r}); start a new run with --out instead")
    return changed


def record_start(run_dir: Path, cfg: dict[str, Any], resume_step: int | None) -> dict:
    """Append this start to ``run.json`` (call before the new config.toml is written: the keys
    changed since the previous start are diffed against it). Returns the record."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_JSON
    history: list[dict] = []
    if resume_step is not None and path.is_file():
        try:
            old = json.loads(path.read_text())
            history = old.get("history") or [{k: v for k, v in old.items() if k != "history"}]
        except (OSError, json.JSONDecodeError, AttributeError):
            history = []
    changed: dict[str, list[Any]] = {}
    previous = run_dir / "config.toml"
    if resume_step is not None and previous.is_file():
        try:
            changed = changed_keys(tomllib.loads(previous.read_text()), cfg)
        except (OSError, tomllib.TOMLDecodeError):
            changed = {}
    record = describe_run() | {
        "kind": "resume" if resume_step is not None else "start",
        "step": resume_step or 0, "changed": changed, "started": time.time(),
        "host": socket.gethostname(), "pid": os.getpid()}
    history.append(record)
    atomic_write_json(path, record | {"history": history})
    return record
