"""The launcher's side of an elastic run: a lighthouse per stage, and a membership log.

Unlike the fixed-membership launcher, a worker that exits does not end the run: each exit is
recorded in ``workers.json`` (the worker, its exit status, the last step it finished) and the
others go on. The run succeeds if at least one pipeline row — every stage of one replica —
trained to the end.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from meshlearn.distributed.health import EXIT_LEFT, EXIT_PEER_FAILURE
from meshlearn.elastic.binding import start_lighthouse
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.mesh.topology import WorkerId
from meshlearn.train.files import atomic_write_json

LIGHTHOUSES_ENV = "MESHLEARN_LIGHTHOUSES"  # the stages' lighthouse addresses, comma-separated
LIGHTHOUSES_KEY = "elastic/lighthouses"  # the same, in the run's store, for joiners
JOIN_ENV = "MESHLEARN_JOIN"  # "1" in a process started by `meshlearn worker --join`
RUN_FILE = "elastic.json"  # in the run folder: the store's address, for `meshlearn worker --join`
WORKERS_FILE = "workers.json"  # worker → rank, pid, and its membership events (joined, left)


def start_lighthouses(cfg, host: str) -> list[tuple[object, str]]:
    """One lighthouse per pipeline stage, in this process, listening on ``host`` only."""
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link)
    return [start_lighthouse(host, cfg.elastic.min_replicas, timeouts.join_ms, timeouts.heartbeat_ms)
            for _ in range(cfg.mesh.stages)]


def left_key(wid: WorkerId) -> str:
    """Set in the run's store (to the last step it finished) once worker ``wid`` has left."""
    return f"elastic/left/{wid}"


def describe_exit(code: int) -> str:
    if code == 0:
        return "finished"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == EXIT_LEFT:
        return "left: its pipeline row broke"
    if code == EXIT_PEER_FAILURE:
        return "stopped: a peer failed"
    return f"exit code {code}"


def _last_step(store: dist.Store, name: str) -> int:
    try:
        key = f"progress/{name}"
        return int(store.get(key).decode()) if store.check([key]) else 0
    except Exception:  # noqa: BLE001 — a store read must not end the watch
        return -1


def _error_line(log: Path) -> str | None:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    errors = [line for line in lines if "error:" in line]
    return errors[-1] if errors else None


def publish_run(store: dist.Store, run_dir: Path, address: str, lighthouses: list) -> None:
    """What a joiner needs to find the run: the store's address in the run folder, the stages'
    lighthouses in the store."""
    prefixed = dist.PrefixStore("meshlearn/0/", store)
    prefixed.set(LIGHTHOUSES_KEY, ",".join(a for _, a in lighthouses))
    atomic_write_json(run_dir / RUN_FILE, {"store": address})


def _alive(pid: int) -> bool:
    """Whether ``pid`` (not necessarily our child) still runs; a zombie has exited."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def watch_elastic(procs: list, store: dist.Store, membership: dict, run_dir: Path, echo_log: Path,
                  out: TextIO, grace_s: float) -> int:
    """Wait for every worker, logging each exit and each join; 0 if some pipeline row finished
    every stage. Once a worker has finished, the others have ``grace_s`` to exit too; a worker still
    there then (frozen, say: SIGSTOP) is killed and logged as such. Joiners (``meshlearn worker
    --join``) are not this process's children: they are found through the store, watched by pid,
    and report their own end there."""
    from meshlearn.distributed.launch import _echo, _stop

    prefixed = dist.PrefixStore("meshlearn/0/", store)
    codes: dict[str, int] = {}
    joiners: dict[str, int] = {}  # slot → pid of the process that took it
    killed: set[str] = set()
    finished_at: float | None = None
    position = 0

    def record(name: str, event: dict) -> None:
        membership[name]["events"].append(event)
        atomic_write_json(run_dir / WORKERS_FILE, membership)

    while len(codes) < len(procs) or any(_alive(pid) for pid in joiners.values()):
        position = _echo(echo_log, position, out)
        for p in procs:
            if p.name in codes or p.exitcode is None:
                continue
            codes[p.name] = p.exitcode
            step = _last_step(prefixed, p.name)
            what = ("killed by the launcher: no answer after the run ended" if p.name in killed
                    else describe_exit(p.exitcode))
            record(p.name, {"event": "finished" if p.exitcode == 0 else "left", "step": step, "why": what})
            if p.exitcode != 0:
                prefixed.set(left_key(WorkerId.parse(p.name)), str(step))  # a free slot for a joiner
                out.write(f"meshlearn: worker {p.name} left after step {step} ({what}); the others go on\n")
        for name in [n for n in codes if n not in joiners and codes[n] != 0]:
            key = f"elastic/taken/{name}"
            if prefixed.check([key]) and prefixed.check([f"elastic/joined/{name}"]):
                joiners[name] = pid = int(prefixed.get(key).decode())
                step = int(prefixed.get(f"elastic/joined/{name}").decode())
                membership[name]["pid"] = pid
                record(name, {"event": "joined", "step": step, "pid": pid})
                out.write(f"meshlearn: worker {name} joined at step {step + 1} (pid {pid})\n")
        for name, pid in list(joiners.items()):
            if codes.get(name, 0) != 0 and not _alive(pid):
                done = prefixed.check([f"elastic/finished/{name}"])
                codes[name] = 0 if done else 1
                record(name, {"event": "finished" if done else "left", "step": _last_step(prefixed, name),
                              "why": "finished" if done else "exited before the end"})
        if finished_at is None and 0 in codes.values():
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            stragglers = [p for p in procs if p.exitcode is None]
            killed.update(p.name for p in stragglers)
            _stop(stragglers, signal.SIGKILL, wait_s=5.0)
        alive = [p.sentinel for p in procs if p.exitcode is None]
        if alive:
            multiprocessing.connection.wait(alive, timeout=0.2)
        else:
            time.sleep(0.2)
    _echo(echo_log, position, out)
    rows: dict[int, list[int]] = {}
    for name, code in codes.items():
        rows.setdefault(WorkerId.parse(name).replica, []).append(code)
    if any(all(code == 0 for code in row) for row in rows.values()):
        return 0
    print(_failure_report(codes, killed, run_dir), file=sys.stderr)
    return 1


def _failure_report(codes: dict[str, int], killed: set[str], run_dir: Path) -> str:
    """No row finished: name the stage that lost every replica by itself (not by a broken row), if
    one did, and say how to resume."""
    from meshlearn.train.checkpoint import latest_complete

    stages: dict[int, list[str]] = {}
    for name, code in codes.items():
        if code not in (0, EXIT_LEFT) and name not in killed:
            stages.setdefault(WorkerId.parse(name).stage, []).append(name)
    replicas = len({WorkerId.parse(name).replica for name in codes})
    gone = [s for s, names in sorted(stages.items()) if len(names) == replicas]
    logs = run_dir / "logs"
    if gone:
        first = (f"every replica of stage {gone[0]} is gone "
                 f"({', '.join(f'{n}: {describe_exit(codes[n])}' for n in sorted(stages[gone[0]]))})")
    else:
        first = next((line for name in codes if (line := _error_line(logs / f"{name}.log"))),
                     "no worker said why")
    lines = [f"meshlearn: error: no pipeline row finished the run: {first}",
             "  workers: " + "; ".join(f"{n}: {describe_exit(c)}" for n, c in codes.items()),
             f"  logs: {logs}"]
    checkpoint = latest_complete(run_dir)
    if checkpoint is None:
        lines.append("  no complete checkpoint yet: start the run again")
    else:
        lines.append(f"  last complete checkpoint: {checkpoint} — continue with: "
                     f"meshlearn train --resume {run_dir}")
    return "\n".join(lines)
