"""A process's place in a dist run, and the bootstrap every role shares.

``start_session`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), joins the process group and starts the heartbeat; a worker, the SENTINEL
verifier and an anchor stage all begin with it (the entry point, ``meshlearn.entry.worker``, then
picks the role). ``train_tokenizer_once``: rank 0 trains a BPE tokenizer, every other rank waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshlearn.config import RunConfig
from meshlearn.data.corpus import load_corpus
from meshlearn.distributed.bound_store import BoundStore
from meshlearn.distributed.groups import anchor_id, anchors, verifier_rank, world_size
from meshlearn.distributed.health import Health, group_store, store_client
from meshlearn.distributed.settings import derive_deadlines, links_trusted
from meshlearn.distributed.streams import StreamConnector
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape, WorkerId


@dataclass
class Session:
    """This process's place in the run, and its liveness monitor."""

    rank: int
    world: int
    local_world: int
    mesh: MeshShape
    me: WorkerId | None  # None: the verifier process, or an anchor stage
    device: torch.device
    comm: str
    health: Health
    run_dir: Path
    anchor: WorkerId | None = None  # an anchor stage's id (distributed/anchor.py)
    rendezvous: object | None = None  # the store this process hosts, if any (join_without_group)
    connector: StreamConnector | None = None  # who makes its streams (None: streams.PlainConnector)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(name, None, "not set: start workers with torchrun or `meshlearn train "
                                          "--backend dist`, which set RANK, WORLD_SIZE, MASTER_ADDR/PORT")
        return default
    return int(value)


def start_session(cfg: RunConfig, run_dir: Path, gloo_interface: Callable[[], str] | None = None,
                  connector: StreamConnector | None = None) -> Session:
    """Join the process group (deadline: dist.init_timeout_s) and start the heartbeat.

    ``gloo_interface`` (elastic runs, given by the entry point): the network interface gloo's sockets
    must use (``elastic.host``'s), asked once this process's place in the run checks out.
    ``connector`` (given by the entry point): who makes this process's streams, kept in the session
    for every role's ``build_groups``."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    expected = world_size(cfg, mesh)
    if world != expected:
        extra = (f" + anchor.z × mesh.stages = {anchors(cfg) * mesh.stages} anchor stages" if anchors(cfg)
                 else " + 1 verifier (verify.name = sentinel)" if expected > mesh.world_size else "")
        raise ConfigError("mesh", f"{mesh.replicas}×{mesh.stages}",
                          f"needs {expected} processes (mesh.replicas × mesh.stages{extra}) but "
                          f"WORLD_SIZE = {world}")
    verifying = verifier_rank(cfg, mesh) is not None
    cuda = torch.cuda.is_available() and not verifying  # the verifier relays over gloo (CPU)
    comm = cfg.dist.comm if cfg.dist.comm != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if comm == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = cfg.dist.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    scope = None
    if cfg.elastic.enabled:
        # gloo's sockets on elastic.host's interface only; a dead peer outside this worker's
        # pipeline row is not this worker's failure.
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface()
        # its row's ranks once the row trains (elastic/driver.py: _link_row); the verifier's
        # failures, and the deaths it sees, are the whole run's (every row's links pass it)
        scope = {rank} if rank < mesh.world_size else None
    # Elastic rows link over the store (joiners); untrusted links (dist.trusted_links): no group.
    grouped = not cfg.elastic.enabled and links_trusted(cfg)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if grouped:
        met = group_store(host, port, cfg.dist.init_timeout_s)
        placed = {} if met is None else {"store": met, "rank": rank, "world_size": world}
        dist.init_process_group(comm, timeout=timedelta(seconds=cfg.dist.init_timeout_s),
                                device_id=device if device.type == "cuda" else None, **placed)
    deadlines = derive_deadlines(cfg.dist, cfg.link, 0, 0, 0, 1)
    rendezvous = None
    if not cfg.elastic.enabled and not grouped:
        rendezvous = join_without_group(host, port, rank, world, cfg.dist.init_timeout_s)
    store = store_client(host, port, deadlines.dead_after_s)
    owner = os.environ.get("MESHLEARN_STORE_OWNER", f"rendezvous store at {host}:{port}")
    health = Health(store, mesh, rank, cfg.dist.heartbeat_s, deadlines.dead_after_s, owner, world=world,
                    scope=scope, anchors=anchors(cfg))
    if cfg.elastic.enabled and scope is None:
        # The verifier: with no world group to wait for, a worker may still be starting (importing,
        # on a loaded host) when this watch begins; it watches them once its links are built
        # (elastic/evictions.py: elastic_relay), so a slow start is not taken for a death that ends the run.
        health.ignore(set(range(mesh.world_size)))
    health.start()
    me = mesh.worker(rank) if rank < mesh.world_size else None  # None: the verifier, or an anchor
    anchor = None
    if me is None and anchors(cfg):
        z, s = divmod(rank - mesh.world_size, mesh.stages)
        anchor = anchor_id(mesh, z, s)
    return Session(rank, world, local_world, mesh, me, device, comm, health, Path(run_dir), anchor,
                   rendezvous, connector)


def join_without_group(host: str, port: int, rank: int, world: int, timeout_s: float) -> BoundStore | None:
    """What joining the world group does, for a run without one (untrusted links): under a plain
    env:// rendezvous (no agent store: torchrun's or our launchers') rank 0 hosts the store, bound
    to ``host`` only; every rank registers and returns once all are up (``timeout_s``:
    dist.init_timeout_s), so no heartbeat is judged before its process exists. Returns the store
    this process hosts (to keep for the run), or None."""
    hosted = None
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        hosted = BoundStore(host, timeout_s, world_size=world, port=port)
    store = store_client(host, port, timeout_s)
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    return hosted


def train_tokenizer_once(cfg: RunConfig, run_dir: Path, session: Session) -> None:
    """BPE is trained by rank 0 and cached in the run folder; the others wait, then load it
    (elastic runs and runs with untrusted links have no world group: they wait on a key of the
    store)."""
    grouped = not cfg.elastic.enabled and links_trusted(cfg)
    if session.rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        load_corpus(cfg, Path(run_dir))
        if not grouped:
            session.health.store.set("tokenizer/ready", "1")
    if not grouped:
        end = time.monotonic() + cfg.dist.init_timeout_s
        while not session.health.store.check(["tokenizer/ready"]):
            session.health.check()
            if time.monotonic() > end:
                raise TimeoutError(f"rank 0's tokenizer did not come within dist.init_timeout_s = "
                                   f"{cfg.dist.init_timeout_s:g} s")
            time.sleep(0.05)
        return
    work = dist.barrier(async_op=True)
    session.health.wait_work(work, "the wait for rank 0's tokenizer", cfg.dist.init_timeout_s)
