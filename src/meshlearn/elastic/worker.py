"""An elastic worker's pieces: its stage's quorum, the commit vote, and the ElasticDriver.

The launcher (``distributed/launch.py``) hosts one lighthouse per stage and passes their addresses
in ``MESHLEARN_LIGHTHOUSES`` (comma-separated, stage order), beside torchrun's environment.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from meshlearn.config import ConfigError
from meshlearn.distributed.health import store_client
from meshlearn.elastic.driver import ElasticDriver
from meshlearn.elastic.membership import LIGHTHOUSES_ENV
from meshlearn.elastic.quorum import CommitVote, StageQuorum
from meshlearn.elastic.settings import derive_timeouts


def lighthouse_of(stage: int, stages: int) -> str:
    value = os.environ.get(LIGHTHOUSES_ENV, "")
    addresses = [a for a in value.split(",") if a]
    if len(addresses) != stages:
        raise ConfigError(LIGHTHOUSES_ENV, value or None,
                          f"must list one lighthouse per stage ({stages}); `meshlearn train --backend "
                          f"dist` with elastic.enabled sets it")
    return addresses[stage]


def build_elastic_driver(cfg, session, worker, links) -> ElasticDriver:
    mesh, me = session.mesh, session.me
    timeouts = derive_timeouts(cfg.elastic, cfg.dist, cfg.link, 4 * worker.n_params, mesh.replicas)
    quorum = StageQuorum(me, cfg.elastic.host, lighthouse_of(me.stage, mesh.stages), timeouts,
                         cfg.elastic.min_replicas, worker.state_dict, worker.load_state_dict)
    # Every initial replica heartbeats to its lighthouse before anyone asks for a quorum, so the
    # first quorum of each stage holds them all (else the first to ask would form one alone).
    session.health.wait_work(dist.barrier(async_op=True), "the start of the elastic run",
                             cfg.dist.init_timeout_s)
    store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeouts.quorum_s)
    vote = CommitVote(dist.PrefixStore("elastic/", store), mesh.stages, timeouts.collective_s)
    return ElasticDriver(cfg, worker, session.health, session.device, session.comm, links,
                         quorum, vote, store)
