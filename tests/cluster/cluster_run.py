"""Shared by the multi-machine cluster tests: each host's credentials in its own folder, each host's
launcher started in its namespace, and their logs for a failure's message."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from netns import Wan

import meshlearn
from meshlearn.net.keys import create_run


def issue_keys(tmp_path: Path, hosts: tuple[str, ...]) -> dict[str, Path]:
    """The owner's ``meshlearn keys`` for ``hosts``, and each host's copy of its own credential
    (key, certificate, the CA and its list) in ``tmp_path/<host>/keys``: host → its key file."""
    owner = tmp_path / "owner-keys"
    create_run(owner, list(hosts), "cluster-test")
    keys = {}
    for host in hosts:
        folder = tmp_path / host / "keys"
        folder.mkdir(parents=True)
        for name in (f"{host}.key", f"{host}.crt", "ca.crt", "ca.crl"):
            shutil.copy(owner / name, folder / name)  # the key keeps its mode 0600
        keys[host] = folder / f"{host}.key"
    return keys


def start(wan: Wan, tmp_path: Path, hosts: tuple[str, ...], args: dict[str, list[str]],
          tag: str, env_of: Mapping[str, Mapping[str, str]] = {}) -> dict[str, subprocess.Popen]:
    """Each host's launcher in its namespace (``hosts[i]`` in namespace i), run in ``tmp_path/<host>``;
    ``env_of``: a host's own additions to the environment."""
    env = os.environ | {"PYTHONPATH": str(Path(meshlearn.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    procs = {}
    for side, host in enumerate(hosts):
        with (tmp_path / f"{host}-{tag}.log").open("w") as log:  # the child keeps its own copy
            # a session of its own: ``finish`` can then kill the launcher's workers with it
            procs[host] = wan.run(side, [sys.executable, "-m", "meshlearn", "train", *args[host], "--host",
                                         host], env=env | dict(env_of.get(host, {})), cwd=tmp_path / host,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return procs


def finish(procs: dict[str, subprocess.Popen], limit_s: float = 180) -> dict[str, int]:
    """The launchers' exit codes, each killed with every process it started (its session) if it has
    not ended within ``limit_s`` of now; a worker a launcher left behind is killed too."""
    try:
        end = time.monotonic() + limit_s
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):  # nothing of that session is left
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    return {host: p.returncode for host, p in procs.items()}


def start_all(wan: Wan, tmp_path: Path, hosts: tuple[str, ...], args: dict[str, list[str]], tag: str,
              limit_s: float = 180) -> dict[str, int]:
    """``start`` then ``finish``: the exit codes of a run left undisturbed."""
    procs = start(wan, tmp_path, hosts, args, tag)
    return finish(procs, limit_s)


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
