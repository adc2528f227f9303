"""Crash-safe files: write to a temporary name in the same folder, then rename over the target.

``os.replace`` within one file system is atomic, so a crash (or a reader mid-write) never sees a
half-written checkpoint, summary or report; on an exception the temporary file is removed and the
old file is left untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success move it onto ``path``."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        _fsync(tmp)
    return Path(path)


def write_synced(path: Path, data: bytes) -> None:
    """``data`` into ``path``, on the disk (fsynced) before this returns."""
    with Path(path).open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        write_synced(tmp, data)
    return Path(path)


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")

