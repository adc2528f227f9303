"""A worker's part in a cluster run: which files it writes, and its checkpoint store.

The launcher names the host in the worker's environment (``HOST_ENV``); everything else follows
from the config's placement. Outside a cluster run ``role_of`` is None and nothing changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshlearn.cluster.checkpoints import ClusterCheckpoint, StoreWaits
from meshlearn.cluster.placement import Placement, newcomer_placement, place
from meshlearn.cluster.settings import worker_names
from meshlearn.config import RunConfig
from meshlearn.distributed.streams import BIND_ADDRESS_ENV

HOST_ENV = "MESHLEARN_HOST"


@dataclass(frozen=True)
class Role:
    placement: Placement
    me: str
    workers: list[str]  # every worker of the mesh, in rank order

    @property
    def local_workers(self) -> list[str]:
        return [w for w in self.workers if self.placement.hosts_of[w] == self.placement.host]

    @property
    def writes_records(self) -> bool:
        """The run's metrics, summary and report inputs: one worker, on the coordinator."""
        return self.me == self.placement.writer

    @property
    def writes_run_files(self) -> bool:
        """config.toml and run.json: the first worker of each host, in its own folder."""
        return self.me == self.local_workers[0]

    def checkpoints(self, run_dir: Path, store, health, deadline_s: float, resume_deadline_s: float,
                    keep: int) -> ClusterCheckpoint:
        hosts: dict[str, list[str]] = {}
        for w in self.workers:
            hosts.setdefault(self.placement.hosts_of[w], []).append(w)
        return ClusterCheckpoint(run_dir, self.me, self.placement.host, self.local_workers, hosts,
                                 self.placement.coordinator, StoreWaits(store, health), deadline_s,
                                 resume_deadline_s, keep)


def role_of(cfg: RunConfig, me: object) -> Role | None:
    """This worker's role, when a cluster host's launcher started it (else None)."""
    host = os.environ.get(HOST_ENV)
    if not host or not cfg.cluster.enabled:
        return None
    if host in cfg.cluster.hosts:
        placement = place(cfg, host)
    else:  # a newcomer (``entry/cluster_join.py``): its own address, and the slot it claimed
        placement = newcomer_placement(cfg, host, (os.environ[BIND_ADDRESS_ENV], 0), str(me))
    return Role(placement, str(me), worker_names(cfg.mesh.replicas, cfg.mesh.stages))
