"""``meshlearn train --backend dist``: start the D × P worker processes on this machine, watch them.

With ``verify.name = "sentinel"`` one more process, the SENTINEL verifier (rank D·P, ``logs/verifier.log``),
relays the pipeline traffic (distributed/verifier.py). The processes' watch is ``distributed/procs.py``'s
(elastic: ``elastic/membership.py``'s).

The launcher plays torchrun's agent: it hosts the rendezvous store (on an OS-chosen port of
127.0.0.1) and gives each worker torchrun's environment, so a worker cannot tell the two apart
and a cluster needs no code change. Workers are forked from a forkserver that has imported torch
once (eight fresh interpreters would spend longer importing than a small run trains). Each worker
writes ``logs/<worker>.log`` in the run folder; rank 0's log is echoed here.

When a worker fails, the others notice by themselves (heartbeat, deadline or closed connection)
and exit naming it; the launcher gives them that long plus a margin, then kills what is left, and
prints one report: the agreed error, every worker's exit status, and how to resume.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from meshlearn.atomic import atomic_write_json
from meshlearn.checkpoint_layout import latest_complete
from meshlearn.config import RunConfig
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.groups import anchors, world_size
from meshlearn.distributed.health import ABORT_KEY, process_name
from meshlearn.distributed.procs import describe_exit, echo, forward_signals, stop, stop_at_once
from meshlearn.distributed.settings import derive_deadlines
from meshlearn.elastic.binding import check_bound
from meshlearn.elastic.membership import (
    LIGHTHOUSES_ENV,
    STARTED_ENV,
    WORKERS_FILE,
    WRITER_ENV,
    publish_run,
    resume_absent,
    start_lighthouses,
    watch_elastic,
)
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.entry.worker import refuse_resume
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.train.signals import STOPPING


def run_child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """Runs in the forked worker: torchrun's environment, output to the log, then the entry point."""
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    from meshlearn.entry.worker import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch_local(worker_argv: list[str], cfg: RunConfig, run_dir: Path, out: TextIO | None = None) -> int:
    """Run ``meshlearn worker <worker_argv>`` as D × P local processes; return the exit code.

    Called from a script, call it under ``if __name__ == "__main__":`` — forkserver children import
    the main module, as with any multiprocessing start method but fork.
    """
    out = out or sys.stdout
    if "--resume" in worker_argv:
        refuse_resume(cfg, run_dir)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    world = world_size(cfg, mesh)  # the workers, and the verifier with verify.name = sentinel
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    host = cfg.elastic.host if cfg.elastic.enabled else "127.0.0.1"
    # TCPStore's own server would listen on every interface: give it a socket on ``host``.
    bound = BoundStore(host, cfg.dist.init_timeout_s, world_size=world)
    store = bound.store
    torchft = cfg.elastic.enabled and cfg.elastic.membership == "torchft"
    lighthouses = start_lighthouses(cfg, host) if torchft else []  # "control": the store holds it all
    ctx = mp.get_context("forkserver")
    # torch._dynamo is what building an optimizer imports lazily: ~1.5 s of CPU once, not per worker.
    ctx.set_forkserver_preload(["meshlearn.entry.worker", "torch._dynamo"])
    # An elastic resume starts the rows its checkpoint was written by (elastic/checkpoints.py).
    absent = resume_absent(cfg, run_dir) if cfg.elastic.enabled and "--resume" in worker_argv else []
    ranks = [rank for rank in range(world) if process_name(mesh, rank, anchors(cfg)) not in absent]
    started = [mesh.worker(r) for r in ranks if r < mesh.world_size]
    writer = next((w for w in started if w.stage == mesh.stages - 1), WorkerId(0, mesh.stages - 1))
    procs = []
    for rank in ranks:
        name = process_name(mesh, rank, anchors(cfg))
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
               "MASTER_ADDR": host, "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
               "MESHLEARN_STORE_OWNER": f"the launcher's store at {host}:{store.port}",
               LIGHTHOUSES_ENV: ",".join(address for _, address in lighthouses),
               STARTED_ENV: str(len(started)), WRITER_ENV: str(writer)}  # workers (not the verifier)
        log = logs / f"{name}.log"
        with log.open("a") as f:
            f.write(f"--- meshlearn worker {name} (rank {rank}) {' '.join(worker_argv)}\n")
        proc = ctx.Process(target=run_child, args=(worker_argv, env, str(log)), name=name)
        proc.start()
        procs.append(proc)
    membership = {p.name: {"rank": rank, "pid": p.pid, "events": [{"event": "joined", "step": 0}]}
                  for rank, p in zip(ranks, procs, strict=True)}
    for name in absent:
        membership[name] = {"rank": mesh.rank(WorkerId.parse(name)), "pid": None,
                            "events": [{"event": "absent", "why": "not in the checkpoint resumed from"}]}
    atomic_write_json(run_dir / WORKERS_FILE, membership)
    if cfg.elastic.enabled:
        check_bound(os.getpid(), host, "the launcher")
        publish_run(store, run_dir, f"{host}:{store.port}", lighthouses)
    stopping = forward_signals(procs, STOPPING)
    try:
        if cfg.elastic.enabled:
            timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link)
            workers = [p for p in procs if p.name != "verifier"]
            return watch_elastic(workers, store, membership, run_dir,
                                 logs / f"{writer}.log", out,
                                 grace_s=timeouts.quorum_s + timeouts.heartbeat_s + 10.0, absent=absent,
                                 verifier=next((p for p in procs if p.name == "verifier"), None))
        codes = watch_children(procs, cfg, logs / f"{mesh.worker(0)}.log", out)
    except BaseException as err:  # a second Ctrl-C, or a caller's timeout
        return stop_at_once(procs, err, stopping, f"meshlearn train --resume {run_dir}")
    finally:
        stopping["restore"]()
        for server, _ in lighthouses:
            server.shutdown()
    signum = stopping.get("signum") or _signal_of(codes)
    if signum and all(code in (0, 128 + signum) for code in codes.values()):
        # Stopped by the signal, or finished before it could stop anything: rank 0's closing line,
        # echoed above, says which and how to go on; the exit code says the signal came.
        return 128 + signum
    if all(code == 0 for code in codes.values()):
        return 0
    print(failure_report(codes, abort_message(store), run_dir), file=sys.stderr)
    return 1


def _signal_of(codes: dict[str, int | str]) -> int | None:
    """The signal every worker stopped for when they got it directly (sent to the workers, not to
    this launcher): all exit with the same 128 + SIGINT or SIGTERM."""
    stopped = {code for code in codes.values() if code != 0}
    if len(stopped) == 1 and (code := stopped.pop()) in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        return code - 128
    return None


def watch_children(procs: list, cfg: RunConfig, echo_log: Path, out: TextIO) -> dict[str, int | str]:
    """Wait for every worker; after a first failure, allow the others the time the failure
    detection needs, then kill the rest. Rank 0's log is echoed as it grows."""
    deadlines = derive_deadlines(cfg.dist, cfg.link, 0, 0, 0, 1)
    grace_s = deadlines.dead_after_s + 3 * cfg.dist.heartbeat_s + 10.0
    failed_at: float | None = None
    killed: set[str] = set()
    position = 0
    while True:
        position = echo(echo_log, position, out)
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in alive:
                killed.add(p.name)
            stop(alive, signal.SIGKILL, wait_s=5.0)
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.2)
    echo(echo_log, position, out)
    return {p.name: ("killed by the launcher" if p.name in killed else p.exitcode) for p in procs}


def abort_message(store: dist.Store) -> str | None:
    try:
        prefixed = dist.PrefixStore("meshlearn/0/", store)
        if not prefixed.check([ABORT_KEY]):
            return None
        return prefixed.get(ABORT_KEY).decode() or None
    except Exception:  # noqa: BLE001
        return None


def failure_report(codes: dict[str, int | str], abort: str | None, run_dir: Path) -> str:
    lines = [f"meshlearn: error: {abort or 'a worker failed without publishing an error'}"]
    statuses = {}
    for name, code in codes.items():
        statuses.setdefault(describe_exit(code), []).append(name)
    lines.append("  workers: " + "; ".join(f"{', '.join(names)}: {status}"
                                           for status, names in statuses.items()))
    lines.append(f"  logs: {run_dir / 'logs'}")
    checkpoint = latest_complete(run_dir)
    if checkpoint is not None:
        lines.append(f"  last complete checkpoint: {checkpoint} — continue with: "
                     f"meshlearn train --resume {run_dir}")
    else:
        lines.append("  no complete checkpoint yet: start the run again")
    return "\n".join(lines)
