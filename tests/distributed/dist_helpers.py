"""Helpers for the real-process tests: launch a dist run through the real launcher, read its records,
and never leave a process behind (a per-test deadline, and a sweep of the run's recorded pids)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from meshlearn.config import RunConfig, load_config, save_config
from meshlearn.entry.launch import WORKERS_FILE, launch_local
from meshlearn.jsonl import read_records

FAST = ["dist.threads=1", "dist.heartbeat_s=0.2"]  # one intra-op thread: 2 cores, up to 8 processes


def launch(cfg: RunConfig, run_dir: Path, *sets: str, resume: bool = False,
           out: io.StringIO | None = None) -> int:
    """``meshlearn train --backend dist`` in this process (the forkserver stays warm between tests);
    ``out`` collects what the launcher echoes of rank 0's output."""
    overrides = [*FAST, *sets, "backend=dist"]
    if resume:
        source = run_dir / "config.toml"
        where = ["--resume", str(run_dir)]
    else:
        source = run_dir.with_name(run_dir.name + ".toml")
        save_config(cfg, source)
        where = ["--config", str(source), "--out", str(run_dir)]
    argv = [*where, *(x for o in overrides for x in ("--set", o))]
    return launch_local(argv, load_config(source, overrides), run_dir, out=out or io.StringIO())


def launch_fixed_and_elastic(cfg: RunConfig, tmp_path: Path, seconds: float, what: str) -> dict[str, Path]:
    """``cfg`` launched twice, with fixed membership and with ``elastic.enabled``, each to success
    within ``seconds`` together; the two run folders by name ("fixed", "elastic")."""
    runs = {"fixed": tmp_path / "fixed", "elastic": tmp_path / "elastic"}
    try:
        with deadline(seconds, what):
            assert launch(cfg, runs["fixed"]) == 0
            assert launch(cfg, runs["elastic"], "elastic.enabled=true") == 0
    finally:
        for run in runs.values():
            kill_leftovers(run)
    return runs


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == kind]


def kill_leftovers(run_dir: Path) -> None:
    """SIGKILL every worker pid the launcher recorded that is still alive (a failed test's debris)."""
    path = run_dir / WORKERS_FILE
    if not path.is_file():
        return
    for info in json.loads(path.read_text()).values():
        if info["pid"] is None:  # an elastic slot nobody held (absent on resume)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info["pid"], signal.SIGKILL)


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging: the launcher stops its workers on the way out."""

    def expired(signum, frame):
        raise TimeoutError(f"{what} did not finish within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def wait_until(predicate, seconds: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``seconds``."""
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, f"{what} did not happen within {seconds} s"
        time.sleep(0.02)


def train_records(run: Path) -> int:
    """Train records written so far (0 before metrics.jsonl exists)."""
    path = run / "metrics.jsonl"
    return sum(r["kind"] == "train" for r in read_records(path)) if path.exists() else 0


def launch_and_signal(cfg: RunConfig, run_dir: Path, worker: str | tuple[str, ...],
                      signum: int | tuple[int, ...], seconds: float) -> int:
    """Launch, send ``signum`` to ``worker`` (e.g. r1s1) once two steps are committed, and return
    the launcher's exit code; nothing of the run is left behind. Several workers and signals: each
    signal to every worker in turn (SIGSTOP then SIGKILL: none sees another die before its end)."""
    workers = (worker,) if isinstance(worker, str) else worker
    signals = (signum,) if isinstance(signum, int) else signum
    result: dict[str, int] = {}
    try:
        with deadline(seconds, f"the elastic run with {', '.join(workers)} sent signals {signals}"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run_dir)))
            thread.start()
            wait_until(lambda: train_records(run_dir) >= 2, 60, "two committed steps")
            members = json.loads((run_dir / WORKERS_FILE).read_text())
            for sig in signals:
                for name in workers:
                    os.kill(members[name]["pid"], sig)
            thread.join()
    finally:
        kill_leftovers(run_dir)
    return result["code"]


def gloo_receiver_exit_code(target: Callable[[int, int], None], receiver: int) -> int | None:
    """Run ``target(rank, port)`` as ranks 0 and 1 of a gloo pair (spawned processes, a free
    loopback port); the exit code of rank ``receiver`` once it ended (30 s at most), both killed
    after: the negative control that shows gloo aborting a receiver on a send it did not post for."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, port)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    procs[receiver].join(30)
    for proc in procs:
        proc.kill()
        proc.join()
    return procs[receiver].exitcode


def tensors(state) -> Iterator:
    """Every tensor of a nested state (dicts, lists, tuples), in order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from tensors(value)
