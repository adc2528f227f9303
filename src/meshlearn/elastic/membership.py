"""The launcher's side of an elastic run: a lighthouse per stage, and a membership log.

Unlike the fixed-membership launcher, a worker that exits does not end the run: each exit is
recorded in ``workers.json`` (the worker, its exit status, the last step it finished) and the
others go on. The run succeeds if at least one pipeline row — every stage of one replica —
trained to the end.

Slots and generations: slot ``rRsS`` is held by one process at a time; the launcher's own is
generation 0, each joiner that takes the slot over the next one. When generation g leaves, the
launcher marks it free (``free_key``); a joiner takes it with compare-and-set on ``taken_key``
(two joiners never take the same one), and reports its join and its end in the store. Every
holder also reports when its row breaks (``spectates``), trains again (``contributes``; a
joiner's first step trained too) and links anew while it still held links (``relinks``: the row
agreement found its members holding different ones); the launcher copies all of it to
``workers.json``.

In a cluster run every host's launcher runs this watch for the processes on its machine, says
each end in the store (``ended_key``) and follows the others' from there (``elastic/remote.py``);
a claim there names its host (``cluster/slots.py``), whose launcher watches the joiner's pid.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from meshlearn.atomic import atomic_write_json
from meshlearn.checkpoint_layout import MANIFEST, latest_complete
from meshlearn.distributed.health import EXIT_EVICTED, EXIT_LEFT, EXIT_PEER_FAILURE
from meshlearn.distributed.procs import echo, stop
from meshlearn.elastic.binding import start_lighthouse
from meshlearn.elastic.links import generation_key
from meshlearn.elastic.remote import ClusterWatch, Lapses, claimant
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.mesh.topology import MeshShape, WorkerId

LIGHTHOUSES_ENV = "MESHLEARN_LIGHTHOUSES"  # the stages' lighthouse addresses, comma-separated
LIGHTHOUSES_KEY = "elastic/lighthouses"  # the same, in the run's store, for joiners
JOIN_ENV = "MESHLEARN_JOIN"  # "1" in a process started by `meshlearn worker --join`
GENERATION_ENV = "MESHLEARN_GENERATION"  # the slot's generation this process holds (joiners: >= 1)
# The worker that writes config.toml and run.json and starts (or truncates) metrics.jsonl: the
# first last-stage worker the launcher starts (a resume may not start r0s{P-1}); never a joiner.
WRITER_ENV = "MESHLEARN_WRITER"
STARTED_ENV = "MESHLEARN_STARTED"  # how many workers the launcher started (resume: the checkpoint's)
RUN_FILE = "elastic.json"  # in the run folder: the store's address, for `meshlearn worker --join`
WORKERS_FILE = "workers.json"  # worker → rank, pid, and its membership events (joined, left)


def start_lighthouses(cfg, host: str) -> list[tuple[object, str]]:
    """One lighthouse per pipeline stage, in this process, listening on ``host`` only."""
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link)
    return [start_lighthouse(host, cfg.elastic.min_replicas, timeouts.join_ms, timeouts.heartbeat_ms)
            for _ in range(cfg.mesh.stages)]


def free_key(wid: WorkerId, generation: int) -> str:
    """Set (to the last step it finished) once generation ``generation`` of slot ``wid`` has left."""
    return f"elastic/free/{wid}/{generation}"


def banned_key(wid: WorkerId, generation: int) -> str:
    """Set by SENTINEL's verifier (JSON: step, reason) once holder ``generation`` of ``wid`` is
    banned: that identity never comes back (elastic/evictions.py)."""
    return f"elastic/banned/{wid}/{generation}"


def taken_key(wid: WorkerId, generation: int) -> str:
    """The pid of the joiner that took slot ``wid`` after generation ``generation`` left (in a
    cluster run ``HOST:PID``, its host's claim: ``cluster/slots.py``)."""
    return f"elastic/taken/{wid}/{generation}"


def claim_first_free(store, mesh: MeshShape, mine: str,
                     generation_of: Callable[[WorkerId], int | None]) -> tuple[WorkerId, int] | None:
    """The first slot (row order: a partly taken row is filled first) whose holder of generation
    ``generation_of(slot)`` has left, claimed by a compare-and-set of its ``taken_key`` to ``mine``:
    the slot and that generation, or None when no slot is free. A claim the store refuses (in a
    cluster run: another claimant moved the slot first) is a lost race; any other error is raised."""
    for wid in mesh.workers():
        generation = generation_of(wid)
        if generation is None or not store.check([free_key(wid, generation)]):
            continue
        try:
            won = store.compare_set(taken_key(wid, generation), "", mine)
        except RuntimeError as err:  # torch's store wraps the control service's refusal
            if "refused" not in str(err):
                raise
            continue
        if (won.decode() if isinstance(won, bytes) else str(won)) == mine:
            return wid, generation
    return None


def ended_key(wid: WorkerId, generation: int) -> str:
    """Set (JSON: exit code, why) by the launcher of the host that ran generation ``generation`` of
    slot ``wid`` once it ended: how a cluster's other launchers learn of a remote worker's end."""
    return f"elastic/ended/{wid}/{generation}"


def resume_absent(cfg, run_dir: Path) -> list[str]:
    """The workers a resumed elastic run does not start: those its latest complete checkpoint does
    not list (they had left when it was taken; the listed ones form its rows again, re-paired
    where their rows broke at different stages)."""
    from meshlearn.elastic.checkpoints import listed_workers

    folder = latest_complete(run_dir)
    if folder is None:
        return []
    listed = listed_workers(json.loads((folder / MANIFEST).read_text())["shards"])
    return [str(w) for w in MeshShape(cfg.mesh.replicas, cfg.mesh.stages).workers() if w not in listed]


def stopped_by_signal(code: int) -> bool:
    """A graceful stop (SIGINT/SIGTERM): the worker stopped at the agreed step, with a checkpoint."""
    return code in (128 + signal.SIGINT, 128 + signal.SIGTERM)


def describe_exit(code: int) -> str:
    if code == 0:
        return "finished"
    if stopped_by_signal(code):
        return f"stopped by {signal.Signals(code - 128).name}, with a checkpoint"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == EXIT_LEFT:
        return "left: its pipeline row broke"
    if code == EXIT_EVICTED:
        return "evicted: banned by SENTINEL"
    if code == EXIT_PEER_FAILURE:
        return "stopped: a peer failed"
    return f"exit code {code}"


def _last_step(store: dist.Store, name: str) -> int:
    try:
        key = f"progress/{name}"
        return int(store.get(key).decode()) if store.check([key]) else 0
    except Exception:  # noqa: BLE001 — a store read must not end the watch
        return -1


def _tell(store: dist.Store, key: str, value: str) -> None:
    """Say a slot's end in the store. Refused when the slot has moved on (the coordinator freed it,
    its machine having been silent, and a joiner took it): what it says is no longer this host's
    to say, and the watch goes on."""
    try:
        store.set(key, value)
    except Exception as err:  # noqa: BLE001 — a refusal (authority) or a lost coordinator
        print(f"meshlearn: could not record {key} ({type(err).__name__}: {err})", file=sys.stderr)


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
    """Whether ``pid`` (not necessarily our child) still runs; a zombie has exited. A process that
    ends while its stat is read makes the read fail with ESRCH (ProcessLookupError), not ENOENT."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@dataclass
class Slot:
    """One worker slot as the launcher follows it: its current holder and how it ended."""

    name: str
    generation: int = 0
    proc: object | None = None  # the launcher's own child (generation 0)
    pid: int | None = None  # a joiner holding it (generation >= 1), not this process's child
    remote: bool = False  # held on another host of a cluster run: its end comes from ``ended_key``
    joined: bool = False  # the joiner said it healed (``elastic/joined/...``)
    events: int = 0  # the holder's events recorded so far (``elastic/events/...``: spectates, contributes)
    code: int | None = None  # the last holder's end: 0 finished, else left (None: holds it now)
    banned_at: float | None = None  # when the launcher saw SENTINEL's ban of the holder (monotonic)


def watch_elastic(procs: list, store: dist.Store, membership: dict, run_dir: Path, echo_log: Path,
                  out: TextIO, grace_s: float, absent: list[str] = (), verifier=None,
                  cluster: ClusterWatch | None = None) -> int:
    """Wait for every worker, logging each exit, each join and each joiner's first step trained;
    0 if some pipeline row finished every stage. Once a worker has finished, the others have
    ``grace_s`` to exit too; a worker still there then (frozen, say: SIGSTOP) is killed and logged
    as such. Joiners (``meshlearn worker --join``) are not this process's children: they are found
    through the store, watched by pid, and report their own end there. ``absent``: slots with no
    process at start (a resume from a checkpoint they were not in), free for joiners at once.
    ``verifier``: SENTINEL's process; a holder it banned is recorded (``banned``), its slot stays
    closed, and it is killed if it has not left ``grace_s`` after the ban. ``cluster``: this host
    of a cluster run — it watches the processes that run here (its children, and the joiners that
    claimed a slot from here), tells the others of each end (``ended_key``), and follows the
    slots held elsewhere through theirs; only the coordinator writes workers.json."""
    prefixed = dist.PrefixStore("meshlearn/0/", store)
    slots = {p.name: Slot(p.name, proc=p) for p in procs}
    for name in cluster.remote if cluster else ():
        slots[name] = Slot(name, remote=True)
    lapses = (Lapses(prefixed, cluster.ranks, cluster.dead_after_s)
              if cluster is not None and cluster.coordinator and cluster.dead_after_s > 0 else None)
    for name in absent:
        remote = cluster is not None and name in cluster.remote
        slots[name] = Slot(name, code=EXIT_LEFT, remote=remote)
        if not remote:  # its host frees it; the others follow its claim
            prefixed.set(generation_key(WorkerId.parse(name)), "0")
            prefixed.set(free_key(WorkerId.parse(name), 0), str(_last_step(prefixed, name)))
    killed: set[str] = set()
    outliers: set[tuple] = set()  # DP outlier reports printed: (worker, step)
    finished_at: float | None = None
    position = 0

    def record(name: str, event: dict) -> None:
        membership[name]["events"].append(event)
        if cluster is None or cluster.coordinator:
            atomic_write_json(run_dir / WORKERS_FILE, membership)

    def note_ban(slot: Slot) -> None:
        """SENTINEL banned the holder (the verifier wrote it before its verdict): a membership change."""
        key = banned_key(WorkerId.parse(slot.name), slot.generation)
        if slot.banned_at is not None or not prefixed.check([key]):
            return
        slot.banned_at = time.monotonic()
        ban = json.loads(prefixed.get(key).decode())
        record(slot.name, {"event": "banned", "step": ban["step"] + 1, "generation": slot.generation,
                           "why": ban["reason"]})
        out.write(f"meshlearn: worker {slot.name} {ban['reason']}: evicted from its stage's quorum, "
                  f"its slot closed; the others go on\n")

    def follow_events(slot: Slot) -> None:
        """What the holder reported since (``ElasticDriver._event``): its row broke and it
        spectates (``spectates``: the first step it did not train, why); its row trains again,
        or a joiner's for the first time (``contributes``: the first step it trained); its row
        linked anew while it held links (``relinks``: the step, why); a DP outlier report of its
        stage (``dp_outlier``: the step, the worker; printed once, whoever saw it first)."""
        base = f"elastic/events/{slot.name}/{slot.generation}"
        for i in range(slot.events, int(prefixed.add(f"{base}/count", 0))):
            event = _event_report(prefixed, f"{base}/{i}")
            slot.events = i + 1
            if event is None:  # a holder elsewhere wrote what no worker writes: not believed
                out.write(f"meshlearn: worker {slot.name}'s event {i} is malformed; ignored\n")
                continue
            record(slot.name, event)
            report = (event.get("worker"), event["step"])
            if event["event"] == "dp_outlier" and report not in outliers:  # each member of the stage saw it
                outliers.add(report)
                out.write(f"meshlearn: worker {slot.name} reports {event.get('worker')} a DP outlier at step "
                          f"{event['step'] + 1} (its contributions far from its stage's aggregate in "
                          f"{event.get('count')} of its last updates; score {event.get('score')}); "
                          "not evicted\n")
            if event["event"] == "spectates":
                out.write(f"meshlearn: worker {slot.name} spectates from step {event['step'] + 1} "
                          f"({_shown(event['why'])}); it stays in its stage's quorum\n")

    def ended(slot: Slot, code: int, why: str, free: bool = False) -> None:
        """``free``: the coordinator frees a slot held elsewhere (its machine is lost)."""
        note_ban(slot)  # before its exit, if it left before this loop saw the ban
        follow_events(slot)  # what it reported before its end comes before the end
        code = 0 if stopped_by_signal(code) else code  # it ran to the run's (agreed) last step
        slot.code = code
        step = _last_step(prefixed, slot.name)
        if cluster is not None and not slot.remote:  # the other hosts learn of it here
            _tell(prefixed, ended_key(WorkerId.parse(slot.name), slot.generation),
                  json.dumps({"code": code, "why": why}))
        if code != 0 and slot.banned_at is None and (free or not slot.remote):  # free before workers.json
            _tell(prefixed, free_key(WorkerId.parse(slot.name), slot.generation), str(step))  # says it left
        record(slot.name, {"event": "finished" if code == 0 else "left", "step": step, "why": why})
        if code != 0:
            out.write(f"meshlearn: worker {slot.name} left after step {step} ({why}); the others go on\n")

    while any(slot.code is None for slot in slots.values()):  # a holder whose end is not recorded
        position = echo(echo_log, position, out)
        for slot in slots.values():
            wid, g = WorkerId.parse(slot.name), slot.generation
            if slot.code is None and slot.proc is not None and slot.proc.exitcode is not None:
                code = slot.proc.exitcode
                why = "killed by the launcher: " + ("still there after its ban's grace period"
                                                    if slot.banned_at is not None else
                                                    "no answer after the run ended")
                ended(slot, code, why if slot.name in killed else describe_exit(code))
            joined = f"elastic/joined/{slot.name}/{g}"
            if slot.code is None and slot.generation > 0 and not slot.joined and prefixed.check([joined]):
                slot.joined = True  # a joiner reports its heal before any other event
                info = _report(prefixed, joined, {"step": int}) or {"step": -1}
                record(slot.name, {"event": "joined", "step": info["step"], "pid": info.get("pid", slot.pid),
                                   "generation": g, "at": info.get("at")})
                out.write(f"meshlearn: worker {slot.name} joined at step {info['step'] + 1} "
                          f"(pid {info.get('pid', slot.pid)})\n")
            if slot.code is None:
                follow_events(slot)
            if slot.code is None and slot.pid is not None and not _alive(slot.pid):
                done = prefixed.check([f"elastic/finished/{slot.name}/{g}"])
                ended(slot, 0 if done else 1, "finished" if done else "exited before the end")
            if slot.code is None and slot.remote and prefixed.check([ended_key(wid, g)]):
                end = _report(prefixed, ended_key(wid, g), {"code": int, "why": str})
                end = end or {"code": 1, "why": "its host's report of its end is malformed"}
                ended(slot, end["code"], end["why"])
            if slot.code is None and slot.remote and lapses and (silent := lapses.lapsed(slot.name, g)):
                ended(slot, 1, f"its machine stopped answering: no heartbeat for {silent:.1f} s; the "
                               "coordinator freed its slot", free=True)
            if slot.code is None:
                note_ban(slot)
            if (slot.code is None and slot.banned_at is not None and slot.proc is not None
                    and time.monotonic() - slot.banned_at > grace_s):
                killed.add(slot.name)  # banned and still there: the launcher enforces the eviction
                stop([slot.proc], signal.SIGKILL, wait_s=5.0)
            elif slot.code not in (None, 0) and prefixed.check([taken_key(wid, g)]):
                slot.generation, slot.proc, slot.code = g + 1, None, None  # a joiner took it
                host, slot.pid = claimant(prefixed.get(taken_key(wid, g)).decode(), cluster)
                slot.remote = cluster is not None and host != cluster.host  # watched where it runs
                slot.joined, slot.events = False, 0
                membership[slot.name]["pid"] = slot.pid
                if cluster is not None:
                    membership[slot.name]["host"] = host
        # the run's end is seen by a worker of this host that finished: another host's report of its
        # own worker's end is believed for that slot, never as the end of this host's workers
        if finished_at is None and any(slot.code == 0 and not slot.remote for slot in slots.values()):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            stragglers = [p for p in procs if p.exitcode is None]
            killed.update(p.name for p in stragglers)
            stop(stragglers, signal.SIGKILL, wait_s=5.0)
            for slot in slots.values():  # a host that never said how its worker ended (it is gone)
                if slot.remote and slot.code is None and time.monotonic() - finished_at > 2 * grace_s:
                    ended(slot, 1, "its host said nothing of it after the run ended")
        alive = [p.sentinel for p in procs if p.exitcode is None]
        if alive:
            multiprocessing.connection.wait(alive, timeout=0.2)
        else:
            time.sleep(0.2)
    echo(echo_log, position, out)
    if verifier is not None:  # it ends once every worker still in the run has finished
        verifier.join(timeout=grace_s)
        if verifier.exitcode is None:
            stop([verifier], signal.SIGKILL, wait_s=5.0)
        code = verifier.exitcode
        record("verifier", {"event": "finished" if code == 0 else "left", "why": describe_exit(code)})
    codes = {name: slot.code for name, slot in slots.items() if slot.code is not None}
    # A row finished if each stage has a replica that did: rows are re-paired across replicas.
    finished = {WorkerId.parse(name).stage for name, code in codes.items() if code == 0}
    if finished == {WorkerId.parse(name).stage for name in slots}:
        return 0
    print(_failure_report(codes, killed, run_dir), file=sys.stderr)
    return 1


def _failure_report(codes: dict[str, int], killed: set[str], run_dir: Path) -> str:
    """No row finished: name the stage that lost every replica by itself (not by a broken row), if
    one did, and say how to resume."""
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


# What each membership event carries beside its kind and step (``ElasticDriver._event``), by type.
EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "spectates": {"why": str}, "contributes": {}, "relinks": {"row": (int, list), "why": str},
    "repaired": {"row": (int, list), "partners": list},  # a row: its replica, or its assignment
    "dp_outlier": {"worker": str, "score": (int, float), "count": int},
}
SHOWN_CHARS = 300  # of a reason another host wrote, at most, on this launcher's console


def _event_report(store, key: str) -> dict | None:
    """A membership event at ``key`` with the fields of its kind (a ``dp_outlier``'s worker a
    worker of the run's form); None when it is not one."""
    event = _report(store, key, {"event": str, "step": int})
    if event is None or event["event"] not in EVENT_FIELDS:
        return None
    if not all(isinstance(event.get(k), t) for k, t in EVENT_FIELDS[event["event"]].items()):
        return None
    if event["event"] == "dp_outlier":
        try:
            WorkerId.parse(event["worker"])
        except ValueError:
            return None
    return event


def _shown(text: str) -> str:
    """Text another host wrote, fit for this console: one line of printable characters, bounded."""
    line = "".join(c if c.isprintable() else "\ufffd" for c in text)
    return line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "…"


def _report(store, key: str, fields: dict[str, type]) -> dict | None:
    """A JSON object a worker (maybe on another host) wrote at ``key``, with ``fields`` of their
    types; None when it is not one (its writer is not believed, and this launcher goes on)."""
    try:
        value = json.loads(store.get(key).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not all(isinstance(value.get(k), t) for k, t in fields.items()):
        return None
    return value
