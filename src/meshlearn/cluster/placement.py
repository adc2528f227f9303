"""Which processes a host runs, with which ranks, bound where — from the ``[cluster]`` placement.

Ranks do not depend on which machine starts first: a worker's rank is its place in the mesh
(replica · P + stage), the verifier's and the anchor stages' follow the workers as on one machine
(``distributed/groups.py``). Processes beside the workers that no host names run on the
coordinator. The records' writer is the coordinator's first worker, so that the metrics, the
summary and workers.json are all in the coordinator's folder.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil

from meshlearn.cluster.settings import HostConfig, worker_names
from meshlearn.config import ConfigError, RunConfig
from meshlearn.distributed.groups import anchors, world_size
from meshlearn.distributed.health import process_name
from meshlearn.mesh.topology import MeshShape

PORT_FILE = "port.json"  # in an elastic cluster run's folder: its host's port agent, for a joiner here


@dataclass(frozen=True)
class Placement:
    """This machine's part of a cluster run."""

    host: str
    address: str  # this host's address, resolved to an IP
    port: int  # this host's one inbound TCP port
    interface: str  # the network interface that carries it (for GLOO_SOCKET_IFNAME)
    coordinator: str
    store_address: str  # the rendezvous: the coordinator's address (resolved) ...
    store_port: int  # ... and its port
    processes: dict[str, int]  # this host's processes → their ranks, in rank order
    hosts_of: dict[str, str]  # every process of the run → its host
    ranks: dict[str, int]  # every process of the run → its rank, in rank order
    world: int
    writer: str  # the worker that writes the run's records (on the coordinator)

    @property
    def is_coordinator(self) -> bool:
        return self.host == self.coordinator


def ranks(cfg: RunConfig) -> dict[str, int]:
    """Every process of the dist run → its rank."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    return {process_name(mesh, rank, anchors(cfg)): rank for rank in range(world_size(cfg, mesh))}


def hosts_of(cfg: RunConfig) -> dict[str, str]:
    """Every process of the run → the host that runs it (unplaced extras: the coordinator)."""
    placed = {p: name for name, host in cfg.cluster.hosts.items() for p in host.workers}
    return {p: placed.get(p, cfg.cluster.coordinator) for p in ranks(cfg)}


def records_writer(cfg: RunConfig) -> str:
    """The coordinator's first worker in rank order (settings.py checks it runs one)."""
    mine = set(cfg.cluster.hosts[cfg.cluster.coordinator].workers)
    return next(w for w in worker_names(cfg.mesh.replicas, cfg.mesh.stages) if w in mine)


def elastic_writer(cfg: RunConfig) -> str:
    """An elastic run's first writer of config.toml, run.json and metrics.jsonl, and its preferred
    records claimant: the coordinator's first last-stage worker (settings.py checks it runs one),
    so the run's records are in the coordinator's folder while that worker is in the run."""
    mine = set(cfg.cluster.hosts[cfg.cluster.coordinator].workers)
    return next(f"r{r}s{cfg.mesh.stages - 1}" for r in range(cfg.mesh.replicas)
                if f"r{r}s{cfg.mesh.stages - 1}" in mine)


def resolve_address(key: str, address: str) -> str:
    """``address`` as an IP address (a name is looked up once, here)."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError) as err:
        raise ConfigError(key, address, f"does not resolve to an address ({err})") from None


def interface_of(key: str, address: str) -> str:
    """The interface of this machine that has ``address``; ConfigError naming what it has otherwise."""
    owned: dict[str, str] = {}
    for interface, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                owned.setdefault(entry.address.split("%")[0], interface)
    if address not in owned:
        raise ConfigError(key, address, f"is not an address of this machine (its interfaces have "
                                        f"{', '.join(sorted(owned)) or 'none'}): start this machine "
                                        "with its own --host")
    return owned[address]


def place(cfg: RunConfig, host: str) -> Placement:
    """This machine's part of the run as ``host``; ConfigError (one line) when ``host`` is not a host
    of the config or this machine does not own its address."""
    cluster = cfg.cluster
    if not cluster.enabled:
        raise ConfigError("--host", host, "needs a [cluster] section in the config (docs/cluster.md)")
    if host not in cluster.hosts:
        raise ConfigError("--host", host, f"not a host of [cluster]: allowed {sorted(cluster.hosts)}")
    mine: HostConfig = cluster.hosts[host]
    key = f"cluster.hosts.{host}.address"
    address = resolve_address(key, mine.address)
    interface = interface_of(key, address)
    coordinator = cluster.hosts[cluster.coordinator]
    store_address = resolve_address(f"cluster.hosts.{cluster.coordinator}.address", coordinator.address)
    where = hosts_of(cfg)
    by_rank = ranks(cfg)
    return Placement(host, address, mine.port, interface, cluster.coordinator, store_address,
                     coordinator.port, {p: r for p, r in by_rank.items() if where[p] == host}, where,
                     by_rank, len(by_rank), records_writer(cfg))


def newcomer_placement(cfg: RunConfig, name: str, address: tuple[str, int],
                       slot: str | None = None) -> Placement:
    """A newcomer's part of the run (a machine outside ``[cluster.hosts]``, joining under its joiner
    credential's ``name``): its own address and port, and the ``slot`` it holds (once it has one)."""
    if name in cfg.cluster.hosts:
        raise ConfigError("--host", name, "is a host of the run's placement; a newcomer joins under the "
                                          "name its joiner credential was issued to")
    chief = cfg.cluster.coordinator
    by_rank, mine = ranks(cfg), {slot: name} if slot else {}
    store = resolve_address(f"cluster.hosts.{chief}.address", cfg.cluster.hosts[chief].address)
    return Placement(name, address[0], address[1], interface_of("--address", address[0]), chief, store,
                     cfg.cluster.hosts[chief].port, {s: by_rank[s] for s in mine}, hosts_of(cfg) | mine,
                     by_rank, len(by_rank), records_writer(cfg))


def host_of_command(cfg: RunConfig, host: str | None) -> Placement | None:
    """``meshlearn train``'s ``--host``: this machine's part of a dist cluster run, None for a run
    on one machine (a simulator run ignores the placement); ConfigError when they do not fit."""
    if host is not None and cfg.backend != "dist":
        raise ConfigError("--host", host, "needs --backend dist (the simulator runs every worker in one "
                                          "process and ignores [cluster])")
    if host is None and cfg.backend == "dist" and cfg.cluster.enabled:
        raise ConfigError("--host", None, f"a [cluster] run starts on each machine with --host NAME, "
                                          f"one of {sorted(cfg.cluster.hosts)} (docs/cluster.md)")
    return place(cfg, host) if host is not None else None
