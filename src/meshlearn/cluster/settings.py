"""The ``[cluster]`` config section: which machine runs which process of a dist run, and its checks.

A cluster is a placement: a coordinator and, per host, its address, its inbound port and the
workers it runs. Every worker ``r{r}s{s}`` of the mesh is placed on exactly one host; the extra
processes of a dist run (the SENTINEL ``verifier``, the anchor stages ``a{z}s{s}``) may be placed
too and otherwise run on the coordinator. Without hosts the section is empty and a dist run
starts every process on this machine, as before. The simulator ignores the placement.

Kept free of torch so the config tree can import it; ``validate_cluster`` is called by
``config.validate``. Whether this machine is the host it claims to be is checked where a host is
chosen (``cluster/placement.py``), not here: a config is valid on any machine.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\Z")
# One label of a DNS name (RFC 1123): letters, digits and inner hyphens.
DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


@dataclass(frozen=True)
class HostConfig:
    """One machine of the cluster: ``[cluster.hosts.NAME]``."""

    address: str = ""
    """Where this machine is reached, and the one address its processes bind to: an IP address
    or a name that resolves to one. It must be an address of the machine's own interfaces."""
    port: int = 29500
    """Its one inbound TCP port: the machine's port agent, which hands each connection to the local
    process it is for. The coordinator's also serves the run's control plane. The plain link
    listeners still take OS-chosen ports of ``address`` while the run starts (docs/cluster.md)."""
    workers: tuple[str, ...] = ()
    """The processes this machine runs: workers ``r{r}s{s}`` (each of the mesh on exactly one
    host), and optionally ``verifier`` (verify.name = sentinel) or anchor stages ``a{z}s{s}``
    (anchor.z > 0), which run on the coordinator when no host names them."""
    trusted: bool = False
    """The run owner vouches for this machine. Where SENTINEL's threat model assumes the first and last
    stages honest (``verify.trusted_ends``), a verified run places their workers only on trusted hosts."""


@dataclass(frozen=True)
class ClusterConfig:
    """Multi-machine runs (docs/cluster.md). Config keys under ``cluster.``; hosts as TOML tables
    ``[cluster.hosts.NAME]``. Empty (no hosts): every process on this machine."""

    coordinator: str = ""
    """The host that holds the run's control plane: its launcher serves the authenticated control
    service behind its ``address:port``, and its run folder gets the metrics, the summary and
    workers.json."""
    # hash=False: a dict cannot be hashed, and a RunConfig is (the planner caches by it); two
    # configs that differ only in their hosts still compare unequal.
    hosts: dict[str, HostConfig] = field(default_factory=dict, hash=False)
    """The machines of the run, by name."""

    @property
    def enabled(self) -> bool:
        return bool(self.hosts)


def worker_names(replicas: int, stages: int) -> list[str]:
    """Every worker of a D × P mesh, in rank order (rank = replica · P + stage)."""
    return [f"r{r}s{s}" for r in range(replicas) for s in range(stages)]


def extra_names(cfg) -> list[str]:
    """The processes of a dist run beside its workers, which a host may name: the verifier, or
    the anchor stages (``distributed/groups.py``: the two are never combined)."""
    if cfg.verify.name == "sentinel":
        return ["verifier"]
    return [f"a{z}s{s}" for z in range(cfg.anchor.z) for s in range(cfg.mesh.stages)]


def check_address(address: str) -> str | None:
    """Why ``address`` cannot be a host's address (None: it can)."""
    try:
        ipaddress.ip_address(address)
        return None
    except ValueError:
        pass
    labels = address.removesuffix(".").split(".")
    if not address or len(address) > 253 or not all(DNS_LABEL.match(label) for label in labels):
        return "must be an IP address or a host name"
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        return f"does not resolve to an address ({err})"
    return None


def validate_cluster(cfg, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``cluster.*`` run by ``config.validate`` (``require(ok, key, value, allowed)``
    raises the ConfigError)."""
    cluster = cfg.cluster
    if not cluster.hosts:
        require(not cluster.coordinator, "cluster.coordinator", cluster.coordinator,
                "needs hosts: add a [cluster.hosts.NAME] table per machine (docs/cluster.md)")
        return
    names = sorted(cluster.hosts)
    require(cluster.coordinator in cluster.hosts, "cluster.coordinator", cluster.coordinator,
            f"must name one of the hosts: {names}")
    if cfg.elastic.enabled:
        require(cfg.elastic.membership == "control", "elastic.membership", cfg.elastic.membership,
                "with a [cluster] placement: must be 'control' (torchft's lighthouse, manager servers "
                "and stores open unauthenticated ports on every machine; docs/cluster.md, 'Joining')")
    for name, host in cluster.hosts.items():
        key = f"cluster.hosts.{name}"
        require(bool(HOST_NAME.match(name)), key, name,
                "host names are letters, digits, '-' and '_' (they name files and keys)")
        why = check_address(host.address)
        require(why is None, f"{key}.address", host.address, str(why))
        require(1 <= host.port <= 65535, f"{key}.port", host.port, "must be a TCP port in [1, 65535]")
    workers = worker_names(cfg.mesh.replicas, cfg.mesh.stages)
    extras = extra_names(cfg)
    placed: dict[str, str] = {}
    for name, host in cluster.hosts.items():
        for process in host.workers:
            key = f"cluster.hosts.{name}.workers"
            require(process in workers or process in extras, key, process,
                    f"not a process of this run: workers {workers[0]} … {workers[-1]} of the "
                    f"{cfg.mesh.replicas} × {cfg.mesh.stages} mesh" + (f", or {', '.join(extras)}"
                                                                         if extras else ""))
            require(process not in placed, key, process, f"placed twice (also on {placed.get(process)})")
            placed[process] = name
    require(any(w in workers for w in cluster.hosts[cluster.coordinator].workers),
            f"cluster.hosts.{cluster.coordinator}.workers", cluster.hosts[cluster.coordinator].workers,
            "the coordinator must run at least one worker (its run folder gets the run's records)")
    last = [f"r{r}s{cfg.mesh.stages - 1}" for r in range(cfg.mesh.replicas)]
    require(not cfg.elastic.enabled or any(w in last for w in cluster.hosts[cluster.coordinator].workers),
            f"cluster.hosts.{cluster.coordinator}.workers", cluster.hosts[cluster.coordinator].workers,
            f"with elastic.enabled: the coordinator must run a last-stage worker ({', '.join(last)}): "
            "that worker starts the run's config.toml, run.json and metrics.jsonl, which are the "
            "coordinator's to hold")
    missing = [w for w in workers if w not in placed]
    require(not missing, "cluster.hosts", names,
            f"worker {missing[0] if missing else ''} is placed on no host: every worker of the mesh "
            "must be in one host's workers")
