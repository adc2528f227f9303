"""Runs describe themselves: commit, uncommitted changes, package versions, command line."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import meshlearn


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
