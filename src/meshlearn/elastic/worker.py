"""An elastic worker's pieces: its stage's quorum, the commit vote, the ElasticDriver — and joining.

The launcher (``distributed/launch.py``) hosts one lighthouse per stage; their addresses reach the
initial workers in ``MESHLEARN_LIGHTHOUSES`` (comma-separated, stage order) beside torchrun's
environment, and anyone else through the run's store (key ``elastic/lighthouses``).

``meshlearn worker --join HOST:PORT --out RUN`` starts a participant that finds the run through its
store (the address is in ``RUN/elastic.json``), takes the slot of a worker that left, heals from a
live replica of its stage at the next step (weights, optimizer state, step counter) and trains from
that step on. For now only a mesh of one stage can be joined (``mesh.stages = 1``): a new replica of
a deeper mesh needs every stage of its row, and their pipeline links, at once (docs/elastic.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from meshlearn.config import ConfigError, RunConfig, load_config
from meshlearn.distributed.health import store_client
from meshlearn.elastic.driver import ElasticDriver
from meshlearn.elastic.membership import JOIN_ENV, LIGHTHOUSES_ENV, LIGHTHOUSES_KEY, RUN_FILE, left_key
from meshlearn.elastic.quorum import CommitVote, StageQuorum
from meshlearn.elastic.settings import derive_timeouts
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


def build_elastic_driver(cfg, session, worker, links) -> ElasticDriver:
    mesh, me = session.mesh, session.me
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link, 4 * worker.n_params, mesh.replicas)
    driver: list[ElasticDriver] = []  # the quorum's state functions call the driver built below
    quorum = StageQuorum(me, cfg.elastic.host, lighthouse_of(me.stage, mesh.stages), timeouts,
                         cfg.elastic.min_replicas, lambda: driver[0].heal_state(),
                         lambda state: driver[0].load_heal_state(state))
    store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeouts.quorum_s)
    if not joining():
        # Every initial replica heartbeats to its lighthouse before anyone asks for a quorum, so the
        # first quorum of each stage holds them all (else the first to ask would form one alone).
        store.add("elastic/started", 1)
        end = time.monotonic() + cfg.dist.init_timeout_s
        while int(store.add("elastic/started", 0)) < mesh.world_size:
            session.health.check()
            if time.monotonic() > end:
                raise TimeoutError("not every worker reached the start of the elastic run within "
                                   f"dist.init_timeout_s = {cfg.dist.init_timeout_s:g} s")
            time.sleep(0.01)
    vote = CommitVote(dist.PrefixStore("elastic/", store), mesh.stages, timeouts.collective_s)
    driver.append(ElasticDriver(cfg, worker, session.health, session.device, session.comm, links,
                                quorum, vote, store))
    if joining():
        driver[0].join()
    return driver[0]


def prepare_join(address: str, run_dir: Path) -> RunConfig:
    """Find the run behind ``address`` (its store), take a free slot, and set this process's
    environment as the launcher sets it for its own workers; returns the run's config."""
    config = run_dir / "config.toml"
    if not config.is_file():
        raise ConfigError("--out", str(run_dir), "not a run folder (no config.toml in it)")
    cfg = load_config(config, [])
    if not cfg.elastic.enabled:
        raise ConfigError("--join", address, f"the run in {run_dir} is not elastic (elastic.enabled = false)")
    if cfg.mesh.stages != 1:
        raise ConfigError("--join", address, f"joining needs mesh.stages = 1 for now (this run has "
                                             f"{cfg.mesh.stages}: a new row needs all its stages at once)")
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError("--join", address, f"must be HOST:PORT (the store address in {run_dir / RUN_FILE})")
    store = store_client(host, int(port), cfg.dist.init_timeout_s)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    for wid in mesh.workers():
        if not store.check([left_key(wid)]):
            continue
        taken = store.compare_set(f"elastic/taken/{wid}", "", str(os.getpid()))
        if (taken.decode() if isinstance(taken, bytes) else str(taken)) == str(os.getpid()):
            break
    else:
        raise ConfigError("--join", address, "no free slot: every worker of the run is still in it")
    os.environ.update({"RANK": str(mesh.rank(wid)), "WORLD_SIZE": str(mesh.world_size),
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": host, "MASTER_PORT": port,
                       LIGHTHOUSES_ENV: store.get(LIGHTHOUSES_KEY).decode(), JOIN_ENV: "1",
                       "MESHLEARN_STORE_OWNER": f"the launcher's store at {address}"})
    return cfg
