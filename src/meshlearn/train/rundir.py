"""Run folders that never lose work: one run per folder, one process per run.

- A fresh ``train`` refuses a folder that already holds a run (``holds_run``) unless told to
  ``--overwrite`` it, which clears the folder first — and only a folder that holds a run, so a
  mistyped ``--out .`` never empties a source tree.
- ``RunLock`` is held for the whole run: ``RUN/.lock`` names the pid, host and start time of its
  holder, and an advisory ``flock`` on it is what excludes a second process. The kernel drops the
  flock when its holder dies (even by SIGKILL), so a lock file whose flock is free is stale: it is
  named in a warning and taken over.
- ``default_out`` gives a fresh ``runs/<name>-<timestamp>`` folder that no other run has.
- ``start_fresh`` runs before anything is written; ``discard_fresh`` removes what a fresh run
  wrote if its setup fails, so bad input leaves no run folder behind.

    with RunLock(run_dir):
        ...train...
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from meshlearn.errors import ConfigError

LOCK = ".lock"
# What makes a folder a run folder: any of these (the files a Trainer writes first, and checkpoints).
RUN_MARKERS = ("config.toml", "run.json", "metrics.jsonl", "summary.json", "checkpoint.pt",
               "checkpoint.prev.pt", "checkpoints")


class RunFolderError(ConfigError):
    """A run folder cannot be used as asked: names the folder and what to do instead."""


def holds_run(run_dir: Path) -> list[str]:
    """The run files in ``run_dir`` (empty: it holds no run)."""
    run_dir = Path(run_dir)
    return [name for name in RUN_MARKERS if (run_dir / name).exists()] if run_dir.is_dir() else []


def default_out(cfg_name: str, config_path: str | None, root: Path = Path("runs"),
                now: float | None = None) -> Path:
    """``runs/<name>-YYYYmmdd-HHMMSS`` (name: ``name`` in the config, else the config file's stem,
    else ``run``), created here so that two commands started in the same second get two folders."""
    stem = cfg_name or (Path(config_path).stem if config_path else "run")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = root / (f"{stem}-{stamp}" if n == 1 else f"{stem}-{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RunFolderError("--out", str(root), "could not find a free run folder name; pass --out")


def start_fresh(run_dir: Path, overwrite: bool) -> None:
    """Make ``run_dir`` ready for a new run (call with its lock held): refuse a folder holding a
    run unless ``overwrite``, which clears it; refuse a non-empty folder that holds no run."""
    run_dir = Path(run_dir)
    found = holds_run(run_dir)
    if found and not overwrite:
        raise RunFolderError("--out", str(run_dir),
                             f"already holds a run ({', '.join(found)}); continue it with "
                             f"`meshlearn train --resume {run_dir}`, pass --overwrite to replace it, "
                             "or choose another --out")
    others = [p.name for p in run_dir.iterdir() if p.name != LOCK] if run_dir.is_dir() else []
    if others and not found:
        raise RunFolderError("--out", str(run_dir),
                             f"is not empty and holds no run ({', '.join(sorted(others)[:3])}"
                             f"{', ...' if len(others) > 3 else ''}); choose a new or empty folder")
    for name in others:  # --overwrite of a run folder: start from an empty one
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# --- the lock ------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / LOCK).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def running_holder(run_dir: Path) -> dict[str, Any] | None:
    """The lock record of the live process training ``run_dir``, or None when none holds it (a
    shared flock attempt: it fails only while an exclusive holder lives, and takes nothing)."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_lock(run_dir) or {}
    finally:
        os.close(fd)  # closing drops the shared lock if it was granted
    return None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} (since {started}: {holder.get('command', '?')})"


class RunLock:
    """``RUN/.lock`` for the lifetime of a run. ``acquire`` raises RunFolderError naming the holder
    if another live process has the run; a stale lock (holder gone) is reported and taken over."""

    def __init__(self, run_dir: Path, command: str | None = None, warn=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.command = command or " ".join(["meshlearn", *sys.argv[1:]])
        self.warn = warn or (lambda text: print(f"meshlearn: warning: {text}", file=sys.stderr))
        self._fd: int | None = None
        self.stale: dict[str, Any] | None = None  # the dead holder whose lock this one replaced

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError("--out", str(self.run_dir),
                                 f"is in use by {_describe(read_lock(self.run_dir))}; wait for it to "
                                 f"finish or stop it (lock: {self.path})") from None
        previous = read_lock(self.run_dir)
        if previous:  # a holder that exits cleanly removes the file: this one died holding it
            self.stale = previous
            alive = previous.get("host") == socket.gethostname() and _pid_alive(int(previous.get("pid", 0)))
            why = "its process is gone" if not alive else "it no longer holds the lock"
            self.warn(f"{self.run_dir}: stale lock of {_describe(previous)} ({why}); taking it over")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if (read_lock(self.run_dir) or {}).get("pid") == os.getpid():
                self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def discard_fresh(run_dir: Path, created: bool) -> None:
    """Undo a fresh run whose setup failed (bad input found while loading the corpus, say): remove
    the folder if this command created it, else empty it again (the lock stays with its holder)."""
    run_dir = Path(run_dir)
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path.name == LOCK:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
