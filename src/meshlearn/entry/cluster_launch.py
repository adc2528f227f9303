"""``meshlearn train --backend dist --host NAME --key FILE``: start this machine's part of a cluster run.

Every machine runs the same command with its own ``--host`` and its own key. The launcher starts
only the processes the placement gives this host, with the ranks the placement gives them
(independent of which machine starts first), and hands each torchrun's environment plus its
host's address and credentials:

- this machine listens on one TCP port, ``cluster.hosts.NAME.address:port``: its ``PortAgent``
  (``cluster/hostport.py``), which hands each connection to the local process it names;
- the run's control state (rendezvous, heartbeats, abort, agreements) is the coordinator's
  control service (``cluster/control.py``), behind the coordinator's port, reached by every
  process over mutual TLS and allowed only what its host may say (``cluster/authority.py``);
- gloo binds to the interface that carries the host's address (``GLOO_SOCKET_IFNAME``) and the
  link listeners to the address itself (``streams.BIND_ADDRESS_ENV``): nothing is guessed from
  the hostname or the route.

Before any worker starts, the coordinator's decisions reach every host (``cluster/shared.py``), and
so does the revocation list in force: a host that is not the coordinator follows the one the
coordinator publishes for the whole run (``control_store.follow_revocations``), keeping it beside
its key, where its workers and a resume read it.
The coordinator's launcher keeps the service up until every host's workers are done, then adds
every host's refusals to the run's summary.json (each host also keeps its own security.json).

An elastic run (``elastic.membership = "control"``): each launcher watches its own workers and the
joiners that claimed a slot from this machine, and follows the slots held elsewhere
(``elastic/membership.watch_elastic`` with ``elastic/remote.ClusterWatch``); the coordinator's
control service keeps which host holds each slot (``cluster/slots.py``), and its launcher frees a
lost machine's slots; ``RUN/port.json`` tells a joiner on this machine where its port agent is
(``entry/cluster_join.py``). Its ``--resume``: the launchers report what their folders hold and
the coordinator's picks the agreed step and the slots that start (``cluster/elastic_resume.py``);
the others are ``absent`` and free for joiners.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from meshlearn.atomic import atomic_write_json
from meshlearn.cluster.authority import Authority
from meshlearn.cluster.checkpoints import agreed_steps
from meshlearn.cluster.control import ControlService
from meshlearn.cluster.control_store import ControlLine, ControlStore, follow_revocations
from meshlearn.cluster.control_wire import ControlRefused
from meshlearn.cluster.elastic_checkpoints import RESUME_STEP_ENV
from meshlearn.cluster.elastic_resume import ResumePlan, plan_resume
from meshlearn.cluster.hostport import HostPort
from meshlearn.cluster.placement import PORT_FILE, Placement, elastic_writer
from meshlearn.cluster.role import HOST_ENV
from meshlearn.cluster.security import collect_records, record_refusals
from meshlearn.cluster.shared import KEYS, share_run
from meshlearn.config import RunConfig
from meshlearn.distributed.procs import forward_signals, stop_at_once
from meshlearn.distributed.settings import derive_deadlines, links_trusted
from meshlearn.distributed.streams import BIND_ADDRESS_ENV
from meshlearn.elastic.membership import (
    STARTED_ENV,
    WORKERS_FILE,
    WRITER_ENV,
    watch_elastic,
)
from meshlearn.elastic.remote import ClusterWatch
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.entry.launch import (  # one machine's launcher: the same children and watch
    abort_message,
    failure_report,
    run_child,
    watch_children,
)
from meshlearn.entry.worker import refuse_resume
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.net.keys import Credentials
from meshlearn.net.tls import Refused, RunTls
from meshlearn.train.signals import STOPPING


def launch_host(worker_argv: list[str], cfg: RunConfig, run_dir: Path, placement: Placement,
                credentials: Credentials, out: TextIO | None = None) -> int:
    """Run this host's processes of the cluster run; return the exit code (as ``launch_local``)."""
    out = out or sys.stdout
    resume = "--resume" in worker_argv
    if resume:
        refuse_resume(cfg, run_dir)
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = HostPort(placement, credentials)
    service = watch = None
    try:
        tls = RunTls(credentials)
        if placement.is_coordinator:  # the run's control state, behind this host's port
            authority = Authority(placement.hosts_of, placement.ranks, placement.coordinator,
                                  trusted_groups=_groups_trusted(cfg), elastic=cfg.elastic.enabled,
                                  stages=cfg.mesh.stages, hosts=cfg.cluster.hosts,
                                  trusted_ends=(cfg.verify.name == "sentinel"  # as the compat row reads it
                                                and cfg.verify.ends_trusted(cfg.mesh.replicas)))
            service = ControlService(tls, authority, port.counters, log=_log)
            service.serve(port.socket_path)
            service.watch_revocations()  # the owner revokes by replacing ca.crl here: no restart
        line = ControlLine(tls, placement.store_address, placement.store_port, placement.coordinator)
        store = _join_coordinator(cfg, run_dir, placement, line, resume)
        plan = None
        if resume and cfg.elastic.enabled:  # the step, and the slots whose shards are on their hosts
            plan = plan_resume(store, run_dir, placement, sorted(cfg.cluster.hosts), cfg.mesh.stages,
                               cfg.dist.init_timeout_s)
        if cfg.elastic.enabled:  # where a joiner on this machine finds its host's port
            atomic_write_json(run_dir / PORT_FILE, {"socket": str(port.socket_path), "host": placement.host})
        if not placement.is_coordinator:  # the coordinator's list, here too
            watch = follow_revocations(line, port.counters, _log)
            watch.look()  # before any worker starts: its links listen under the coordinator's list
            watch.start()
        return _run_workers(worker_argv, cfg, run_dir, placement, port, store, out, plan)
    finally:
        if watch is not None:
            watch.close()
        if service is not None:
            service.close()
        port.close()


def _log(line: str) -> None:
    """The launcher's log: its standard error."""
    print(line, file=sys.stderr, flush=True)


def _run_workers(worker_argv: list[str], cfg: RunConfig, run_dir: Path, placement: Placement, port: HostPort,
                 store: dist.Store, out: TextIO, plan: ResumePlan | None = None) -> int:
    """``plan``: an elastic resume's (``cluster/elastic_resume.py``): only its slots start, from its step."""
    logs = run_dir / "logs"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["meshlearn.entry.worker", "torch._dynamo"])
    local = len(placement.processes)
    absent = [] if plan is None else [name for name in placement.ranks if name not in plan.start]
    procs = []
    for local_rank, (name, rank) in enumerate(placement.processes.items()):
        if name in absent:
            continue
        env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(placement.world),
               "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": "0",
               "MASTER_ADDR": placement.store_address, "MASTER_PORT": str(placement.store_port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
               "MESHLEARN_STORE_OWNER": f"the coordinator {placement.coordinator}'s control service at "
                                        f"{placement.store_address}:{placement.store_port}",
               "GLOO_SOCKET_IFNAME": placement.interface, BIND_ADDRESS_ENV: placement.address,
               HOST_ENV: placement.host, **port.worker_env(run_dir)}
        if cfg.elastic.enabled:  # every initial worker of every host, and the records' first writer
            env |= {STARTED_ENV: str(len(plan.start) if plan else cfg.mesh.replicas * cfg.mesh.stages),
                    WRITER_ENV: _first_writer(cfg, plan)}
        if plan is not None:
            env[RESUME_STEP_ENV] = str(plan.step)
        log = logs / f"{name}.log"
        with log.open("a") as f:
            f.write(f"--- meshlearn worker {name} (rank {rank}) on host {placement.host} "
                    f"{' '.join(worker_argv)}\n")
        proc = ctx.Process(target=run_child, args=(worker_argv, env, str(log)), name=name)
        proc.start()
        procs.append(proc)
    pids = {p.name: p.pid for p in procs}
    membership = {name: {"rank": rank, "host": placement.hosts_of[name], "pid": pids.get(name),
                         "events": [{"event": "joined", "step": 0}]}
                  for name, rank in placement.ranks.items()}
    for name in absent:
        membership[name] |= {"pid": None, "events": [{"event": "absent", "why": _absent_why(name, plan)}]}
    if placement.is_coordinator:
        atomic_write_json(run_dir / WORKERS_FILE, membership)
    writer = _first_writer(cfg, plan) if cfg.elastic.enabled else placement.writer
    echo = writer if placement.is_coordinator else next(iter(placement.processes), None)
    echo_log = logs / f"{echo}.log"  # a host with no worker of its own echoes nothing
    stopping = forward_signals(procs, STOPPING)
    try:
        if cfg.elastic.enabled:
            timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link)
            remote = tuple(name for name in placement.ranks if name not in placement.processes)
            watch = ClusterWatch(placement.host, remote, placement.is_coordinator, placement.ranks,
                                 dead_after_s=2 * timeouts.heartbeat_s + 5.0)  # a lost machine's slots
            code = watch_elastic(procs, store, membership, run_dir, echo_log, out,
                                 grace_s=timeouts.quorum_s + timeouts.heartbeat_s + 10.0, absent=absent,
                                 cluster=watch)
            _finish(store, cfg, placement, port, run_dir)
            return code
        codes = watch_children(procs, cfg, echo_log, out)
    except BaseException as err:  # a second Ctrl-C, or a caller's timeout
        resume = f"meshlearn train --resume {run_dir} --host {placement.host} --key FILE"
        return stop_at_once(procs, err, stopping, resume)
    finally:
        stopping["restore"]()
    _finish(store, cfg, placement, port, run_dir)
    if all(code == 0 for code in codes.values()):
        return 0
    signum = stopping.get("signum")
    if signum and all(code == 128 + signum for code in codes.values()):
        if not placement.is_coordinator:  # the coordinator echoes the writer's closing line, which says it
            print(f"meshlearn: stopped by {signal.Signals(signum).name} with a checkpoint; continue with: "
                  f"meshlearn train --resume {run_dir} --host {placement.host} --key FILE", file=sys.stderr)
        return 128 + signum
    report = failure_report(codes, abort_message(store), run_dir).splitlines()[:3]  # error, workers, logs
    agreed = agreed_steps(run_dir)
    report.append(f"  last agreed checkpoint: step {agreed[-1]} — continue on every machine with: meshlearn "
                  f"train --resume {run_dir} --host NAME --key FILE" if agreed else
                  "  no agreed checkpoint yet: start the run again")
    print("\n".join(report), file=sys.stderr)
    return 1


def _first_writer(cfg: RunConfig, plan: ResumePlan | None) -> str:
    """An elastic run's first writer of config.toml, run.json and metrics.jsonl: the coordinator's
    last stage, or on a resume that does not start it the first last stage that starts."""
    writer = elastic_writer(cfg)
    if plan is None or writer in plan.start:
        return writer
    last = [WorkerId.parse(name) for name in plan.start if WorkerId.parse(name).stage == cfg.mesh.stages - 1]
    return str(min(last, key=lambda w: w.replica))


def _absent_why(name: str, plan: ResumePlan) -> str:
    return (f"its shard of the checkpoint resumed from (step {plan.step}) is not on the host the placement "
            "gives it" if name in plan.listed else f"not in the checkpoint resumed from (step {plan.step})")


def _join_coordinator(cfg: RunConfig, run_dir: Path, placement: Placement, line: ControlLine,
                      resume: bool) -> dist.Store:
    """The coordinator's control service, and what it decided (waits dist.init_timeout_s for both)."""
    where = f"{placement.store_address}:{placement.store_port}"
    try:
        line.reach(cfg.dist.init_timeout_s)
        store = ControlStore(line, cfg.dist.init_timeout_s)
        share_run(cfg, run_dir, placement, store, resume)
    except Refused as err:
        raise ConfigError("--key", str(line.tls.credentials.key),
                          f"the coordinator {placement.coordinator} at {where} refused this host's "
                          f"credentials ({err.detail}): ask the run's owner for a valid key") from None
    except (OSError, ControlRefused) as err:
        raise ConfigError("cluster.coordinator", placement.coordinator,
                          f"its rendezvous at {where} did not answer within dist.init_timeout_s = "
                          f"{cfg.dist.init_timeout_s:g} s ({type(err).__name__}): start `meshlearn "
                          f"train --host {placement.coordinator}` there") from None
    return store


def _finish(store: dist.Store, cfg: RunConfig, placement: Placement, port: HostPort, run_dir: Path) -> None:
    """Say this host is done, with what it refused; the coordinator's launcher waits for every
    host (their workers' last words go through its control service), as long as a failure takes
    to be noticed, then records every host's refusals in the run's summary.json."""
    record = port.write_record(run_dir)
    with contextlib.suppress(Exception):  # the coordinator may be gone already
        store.set(f"{KEYS}/security/{placement.host}", json.dumps(record))
        store.set(f"{KEYS}/done/{placement.host}", "1")
    if not placement.is_coordinator:
        return
    hosts = sorted(set(placement.hosts_of.values()))
    deadlines = derive_deadlines(cfg.dist, cfg.link, 0, 0, 0, 1)
    end = time.monotonic() + deadlines.dead_after_s + 3 * cfg.dist.heartbeat_s + 10.0
    while time.monotonic() < end and not store.check([f"{KEYS}/done/{h}" for h in hosts]):
        time.sleep(0.1)
    records = {placement.host: port.write_record(run_dir)}  # again: the others' last words were refusable
    records |= collect_records(store, f"{KEYS}/security", [h for h in hosts if h != placement.host])
    record_refusals(run_dir, records, placement.host, hosts)


def _groups_trusted(cfg) -> bool:
    """Whether the control service lets any host write process groups' rendezvous keys (``pg/``).
    An elastic cluster run (membership ``control``) uses no process group: only where the user
    declares its links trusted."""
    return cfg.dist.trusted_links == "true" if cfg.elastic.enabled else links_trusted(cfg)
