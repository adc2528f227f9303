"""An elastic worker's pieces: its stage's quorum, the commit vote, the row agreement, its row's
links, the ElasticDriver — and joining.

The launcher (``entry/launch.py``) hosts one lighthouse per stage; their addresses reach the
initial workers in ``MESHLEARN_LIGHTHOUSES`` (comma-separated, stage order) beside torchrun's
environment, and anyone else through the run's store (key ``elastic/lighthouses``).

``meshlearn worker --join HOST:PORT --out RUN`` starts one participant: it finds the run through
its store (the address is in ``RUN/elastic.json``), takes a free slot (the first, in row order, of
a worker that left: so joiners fill a row together), heals from a live replica of its stage at
the next step (weights, optimizer state, step counter, data position) and spectates until every
stage of its row is in (``elastic/rows.py``); from then on its row trains. A row whose one stage
replica died keeps its other members (they spectate): one such command completes it; a row with
no member left takes P commands, started in any order.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from meshlearn.config import RunConfig, load_config
from meshlearn.distributed.health import store_client
from meshlearn.distributed.streams import PlainConnector, listen_address
from meshlearn.elastic.binding import interface_of
from meshlearn.elastic.control_quorum import ControlQuorum, CountingStore, SettlingVote
from meshlearn.elastic.driver import ElasticDriver
from meshlearn.elastic.evictions import refuse_join_when_verified
from meshlearn.elastic.links import RowLinks, generation_key
from meshlearn.elastic.membership import (
    GENERATION_ENV,
    JOIN_ENV,
    LIGHTHOUSES_ENV,
    LIGHTHOUSES_KEY,
    RUN_FILE,
    STARTED_ENV,
    WRITER_ENV,
    claim_first_free,
)
from meshlearn.elastic.peer_vote import PeerVote, ReusedRows
from meshlearn.elastic.progress import ProgressBeacon
from meshlearn.elastic.quorum import CommitVote, StageQuorum
from meshlearn.elastic.rows import RowAgreement
from meshlearn.elastic.settings import derive_timeouts
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape


def lighthouse_of(stage: int, stages: int) -> str:
    value = os.environ.get(LIGHTHOUSES_ENV, "")
    addresses = [a for a in value.split(",") if a]
    if len(addresses) != stages:
        raise ConfigError(LIGHTHOUSES_ENV, value or None,
                          f"must list one lighthouse per stage ({stages}); `meshlearn train --backend "
                          f"dist` with elastic.enabled sets it")
    return addresses[stage]


def joining() -> bool:
    return os.environ.get(JOIN_ENV) == "1"


def build_elastic_driver(cfg, session, worker) -> ElasticDriver:
    mesh, me = session.mesh, session.me
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link, 4 * worker.n_params, mesh.replicas)
    generation = int(os.environ.get(GENERATION_ENV, "0"))
    driver: list[ElasticDriver] = []  # the quorum's state functions call the driver built below
    state, load = lambda: driver[0].heal_state(), lambda state: driver[0].load_heal_state(state)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = store_client(host, port, timeouts.quorum_s)
    streams = None  # the rows' links: pair groups (torchft), or streams from this connector
    if cfg.elastic.membership == "control":
        streams = session.connector or PlainConnector(store, listen_address(host, port))
        quorum = control_quorum(cfg, session, timeouts, (host, port), f"{me}.{generation}", state, load)
    else:
        quorum = StageQuorum(me, f"{me}.{generation}", cfg.elastic.host, lighthouse_of(me.stage, mesh.stages),
                             timeouts, cfg.elastic.min_replicas, state, load)
    links = RowLinks(store, mesh, me, generation, interface_of(cfg.elastic.host), timeouts.quorum_s,
                     relayed=cfg.verify.name == "sentinel", connector=streams)
    links.announce()
    if not joining():
        # Every initial replica heartbeats to its lighthouse (or asked to join its stage's record)
        # before anyone asks for a quorum, so the first quorum of each stage holds them all (else
        # the first to ask would form one alone).
        started = int(os.environ.get(STARTED_ENV, str(mesh.world_size)))
        store.add("elastic/started", 1)
        end = time.monotonic() + cfg.dist.init_timeout_s
        while int(store.add("elastic/started", 0)) < started:
            session.health.check()
            if time.monotonic() > end:
                raise TimeoutError("not every worker reached the start of the elastic run within "
                                   f"dist.init_timeout_s = {cfg.dist.init_timeout_s:g} s")
            time.sleep(0.01)
    shared = CountingStore(dist.PrefixStore("elastic/", store))  # the vote's and the rows' requests
    vote = CommitVote(shared, mesh.stages, timeouts.collective_s)
    sentinel = cfg.verify.name == "sentinel"  # the relay's hops are the slot rows; its bans evict
    rows = RowAgreement(shared, mesh.stages, mesh.replicas, timeouts.quorum_s,  # a quorum may wait
                        repair=not sentinel, evictions=sentinel)
    counted = [shared]
    if isinstance(quorum, ControlQuorum):  # the vote over streams, the rows reused until a change
        # the vote's streams connect in a thread: their rendezvous has a store client of its own
        own = store_client(host, port, timeouts.quorum_s)
        counted.append(CountingStore(dist.PrefixStore("elastic/", own)))
        peers = PeerVote(shared, session.connector or PlainConnector(counted[1], listen_address(host, port)),
                         mesh, me, vote, timeouts.collective_s, timeouts.quorum_s,
                         steady=lambda: driver[0].steady())
        rows = ReusedRows(rows, peers, lambda step: driver[0].checkpoint_membership.taken_since(step))
        vote = SettlingVote(peers, quorum)  # its fast path needs the outcome
    beacon = ProgressBeacon(store_client(host, port, timeouts.quorum_s), f"progress/{me}")
    driver.append(ElasticDriver(cfg, worker, session.health, session.device, session.comm, quorum, vote, rows,
                                links, store, beacon, requests=lambda: sum(c.requests for c in counted)))
    if joining():
        driver[0].join()
    return driver[0]


def control_quorum(cfg, session, timeouts, address: tuple[str, int], member: str, state,
                   load) -> ControlQuorum:
    """The stage's membership on the run's store at ``address`` (``elastic/control_quorum.py``):
    its records and heartbeats under ``elastic/q/s<stage>/``, its sums over streams from the
    session's connector (a cluster run's authenticated one; else plain streams rendezvoused on
    the store)."""
    host, port = address

    def stage_store():
        return dist.PrefixStore(f"elastic/q/s{session.me.stage}", store_client(host, port, timeouts.quorum_s))
    store = CountingStore(stage_store())  # the quorum's requests, counted (``QuorumStep.requests``)
    connector = session.connector or PlainConnector(store, listen_address(host, port))
    return ControlQuorum(session.mesh, session.me, member, store, stage_store(), connector, timeouts,
                         cfg.elastic.min_replicas, state, load, joining=joining())


def prepare_join(address: str, run_dir: Path) -> RunConfig:
    """Find the run behind ``address`` (its store), take a free slot, and set this process's
    environment as the launcher sets it for its own workers; returns the run's config."""
    config = run_dir / "config.toml"
    if not config.is_file():
        raise ConfigError("--out", str(run_dir), "not a run folder (no config.toml in it)")
    cfg = load_config(config, [])
    if not cfg.elastic.enabled:
        raise ConfigError("--join", address, f"the run in {run_dir} is not elastic (elastic.enabled = false)")
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError("--join", address, f"must be HOST:PORT (the store address in {run_dir / RUN_FILE})")
    refuse_join_when_verified(cfg, address)
    store = store_client(host, int(port), cfg.dist.init_timeout_s)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    claimed = claim_first_free(store, mesh, str(os.getpid()), lambda wid: (
        int(store.get(generation_key(wid)).decode()) if store.check([generation_key(wid)]) else None))
    if claimed is None:
        raise ConfigError("--join", address, "no free slot: every worker of the run is still in it")
    wid, held = claimed
    os.environ.update({"RANK": str(mesh.rank(wid)), "WORLD_SIZE": str(mesh.world_size),
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": host, "MASTER_PORT": port,
                       LIGHTHOUSES_ENV: store.get(LIGHTHOUSES_KEY).decode(), JOIN_ENV: "1",
                       GENERATION_ENV: str(held + 1), WRITER_ENV: "",  # a joiner never starts the files
                       "MESHLEARN_STORE_OWNER": f"the launcher's store at {address}"})
    return cfg
