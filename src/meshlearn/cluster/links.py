"""The cluster's stream connector: every stream of a cluster run with credentials is dialed through
the receiving host's one port and authenticated both ways with the run's certificates.

Why: the plain connector (``distributed/streams.py``) opens a listener per receiving process,
publishes its address on the unauthenticated store and trusts the first hello — anyone who can
reach the port and speaks first takes a link (issue 27). Here a receiving process registers one
destination per channel at its host's ``PortAgent`` (``net/port.py``), ``<process>/<channel>``
(``r0s1/links``, ``verifier/collectives``), and authenticates each socket handed over with a
``LinkGate`` (``net/links.py``): mutual TLS 1.3 under the run's CA, then a hello whose sending
process must run on the host the peer's certificate names (the placement's ``hosts_of``). A
sender dials ``port.dial(host address, host port, destination)`` and ``dial_link``, expecting
the receiver's host at the other end. No process listens on a port of its own, nothing is
published on the store: every address and port comes from ``[cluster.hosts]`` in the config.

A connection is named by its hop, not only by its two processes (a verifier receives every
pipeline link from the same worker): the sending process and ``<receiving process>[<link>]``,
e.g. ``r0s0->verifier[r0s0->r0s1]``, each owned by its process's host.

Set-up: every channel's destination is registered before anything is dialed. A dial that finds
no destination yet (its process is still starting) or is refused is tried again until the
set-up deadline (``dist.init_timeout_s``); each such early dial is counted by the receiving
host's agent (``unknown_destination``). Refused connections are counted here (``counters``).

The entry point builds the connector (``cluster_connector``) when the launcher gave the process
its host's port (``PORT_SOCKET_ENV``) and key (``KEY_ENV``); without them a cluster run keeps the
plain connector. What the process refuses — here, and in the framed collectives over its streams
(``build_groups`` hands them ``counters``) — is kept in its record (``REFUSALS_ENV``, ``refusals.py``)
for the host's security.json.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from meshlearn.cluster.placement import hosts_of, ranks, resolve_address
from meshlearn.cluster.refusals import ProcessRecord
from meshlearn.cluster.role import HOST_ENV
from meshlearn.cluster.slots import SLOT, address_key, holder_key, parse_holder
from meshlearn.config import RunConfig
from meshlearn.distributed.health import store_client
from meshlearn.distributed.streams import Hop, link_name
from meshlearn.distributed.wire import HEADER_ROOM
from meshlearn.errors import ConfigError
from meshlearn.net import port
from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials, KeysError
from meshlearn.net.links import AuthStream, Link, LinkGate, dial_link
from meshlearn.net.tls import Acceptor, Refused, RunTls

PORT_SOCKET_ENV = "MESHLEARN_PORT_SOCKET"  # this host's PortAgent Unix socket (set by the launcher)
KEY_ENV = "MESHLEARN_KEY"  # this host's private key, NAME.key; NAME.crt, ca.crt, ca.crl beside it
REFUSALS_ENV = "MESHLEARN_REFUSALS"  # where this process keeps its record of what it refused (refusals.py)
RETRY_FIRST_S, RETRY_MAX_S = 0.02, 0.5  # a dial that found no destination yet is tried again, backing off


class ClusterConnector:
    """One process's streams through the hosts' ports (``distributed.streams.StreamConnector``).

    ``names``: every process of the run by rank; ``hosts_of``: process → host; ``ports``: host →
    (address, port) of its agent; ``inbox_socket``: this host's agent's Unix socket; ``locate``:
    in an elastic run, the host that holds a worker slot *now* (a joiner runs its slot's process
    on the host it started on: ``cluster/slots.py``), asked at every connect instead of
    ``hosts_of``; ``reach``: where a holder outside ``ports`` (a newcomer) takes connections, as
    the control service published it from its claim."""

    def __init__(self, tls: RunTls, inbox_socket: Path, names: Mapping[int, str],
                 hosts_of: Mapping[str, str], ports: Mapping[str, tuple[str, int]],
                 counters: Counters | None = None, locate: Callable[[str], str] | None = None,
                 reach: Callable[[str], tuple[str, int]] | None = None):
        self.tls, self.inbox_socket = tls, Path(inbox_socket)
        self.names, self.hosts_of, self.ports = dict(names), dict(hosts_of), dict(ports)
        self.placed = frozenset(ports)  # the placement's hosts: their ports never change
        self.locate, self.reach = locate, reach
        self._hosts = dict(self.hosts_of)  # where each process runs (``connect`` asks ``locate``)
        self.counters = counters if counters is not None else Counters()
        self.retries = 0  # dials tried again (the destination was not there yet, or refused us)

    def connect(self, rank: int, channels: Mapping[str, list[Hop]],
                timeout_s: float) -> dict[str, dict[int, AuthStream]]:
        """This process's end of each hop it is on, per channel and hop index: its destinations
        registered first, then every hop it sends on dialed, then every hop it receives on
        awaited; TimeoutError naming what never connected by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._hosts = dict(self.hosts_of)  # where each process runs, for this connect
        if self.locate is not None:
            ranks = {r for hops in channels.values() for _, a, b in hops for r in (a, b)}
            self._hosts |= {self.names[r]: self.locate(self.names[r]) for r in ranks}
        for host in set(self._hosts.values()) - set(self.placed):
            if self.reach is not None:  # a newcomer: its port as its latest claim carried it
                self.ports[host] = self.reach(host)  # read anew: a rejoin may bring another port
        gates: dict[str, tuple[LinkGate, port.Inbox, dict[int, Link]]] = {}
        try:
            for channel, hops in channels.items():
                receiving = {i: self._link(hop) for i, hop in enumerate(hops) if hop[2] == rank}
                if receiving:
                    gate = LinkGate(self.tls, set(receiving.values()), self._owners(hops), HEADER_ROOM)
                    inbox = port.Inbox(self.inbox_socket, f"{self.names[rank]}/{channel}")
                    inbox.serve_into(Acceptor(gate.authenticate, self.counters).submit)
                    gates[channel] = gate, inbox, receiving
            streams: dict[str, dict[int, AuthStream]] = {}
            for channel, hops in channels.items():
                streams[channel] = {i: self._dial(hop, channel, self._owners(hops), deadline)
                                    for i, hop in enumerate(hops) if hop[1] == rank}
            for channel, (gate, _, receiving) in gates.items():
                got = gate.wait_all(deadline)
                streams[channel] |= {i: got[link] for i, link in receiving.items()}
        except TimeoutError as err:
            raise TimeoutError(f"{self.names[rank]}: {err}") from None
        finally:
            for _, inbox, _ in gates.values():  # no further connection is for us
                inbox.close()
        if self.counters.total():
            print(f"meshlearn worker {self.names[rank]}: refused {self.counters.total()} connection(s) "
                  f"while connecting: {self.counters.as_dict()}", file=sys.stderr, flush=True)
        return streams

    def _link(self, hop: Hop) -> Link:
        """The authenticated link's name for ``hop``: (sending process, receiving process[link])."""
        logical, a, b = hop
        return self.names[a], f"{self.names[b]}[{link_name(logical)}]"

    def _owners(self, hops: list[Hop]) -> dict[str, str]:
        """Every name the links of ``hops`` use → the host that runs it."""
        owners = {}
        for hop in hops:
            sender, receiver = self._link(hop)
            owners[sender] = self._hosts[sender]
            owners[receiver] = self._hosts[self.names[hop[2]]]
        return owners

    def _dial(self, hop: Hop, channel: str, owners: Mapping[str, str], deadline: float) -> AuthStream:
        """The stream for ``hop`` from this process, tried again until ``deadline``."""
        link, receiver = self._link(hop), self.names[hop[2]]
        address, agent_port = self.ports[self._hosts[receiver]]
        wait, why = RETRY_FIRST_S, "no attempt"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the link {link_name(link)} to {address}:{agent_port} never "
                                   f"connected (last: {why})")
            try:
                sock = port.dial(address, agent_port, f"{receiver}/{channel}", left)
                return dial_link(sock, self.tls, link, owners, deadline, HEADER_ROOM)
            except (Refused, OSError) as err:
                why = f"{type(err).__name__}: {err}"
            self.retries += 1
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(2 * wait, RETRY_MAX_S)


def cluster_connector(cfg: RunConfig, environ: Mapping[str, str] = os.environ) -> ClusterConnector | None:
    """The connector of a cluster run whose launcher gave this process its host's port and key,
    None outside one (the plain connector stays); ConfigError (one line) for a half-given or
    wrong credential, before any work."""
    socket_path, key = environ.get(PORT_SOCKET_ENV), environ.get(KEY_ENV)
    if not cfg.cluster.enabled or cfg.backend != "dist" or (socket_path is None and key is None):
        return None
    for name, value in ((PORT_SOCKET_ENV, socket_path), (KEY_ENV, key), (HOST_ENV, environ.get(HOST_ENV))):
        if not value:
            raise ConfigError(name, value, f"must be set with {PORT_SOCKET_ENV} and {KEY_ENV} in a "
                                           "cluster run (its launcher sets all three)")
    host, key_path = environ[HOST_ENV], Path(key)
    try:
        tls = RunTls(Credentials.in_folder(key_path.parent, key_path.stem))
    except KeysError as err:
        raise ConfigError(KEY_ENV, key, err.allowed) from None
    except (OSError, ValueError) as err:
        raise ConfigError(KEY_ENV, key, f"not a credential of this run ({type(err).__name__}: {err}): "
                                        f"{key_path.stem}.key, .crt, ca.crt and ca.crl, as "
                                        "`meshlearn keys` writes them") from None
    if tls.identity.name != host:
        raise ConfigError(KEY_ENV, key, f"is {tls.identity}'s credential, but this process runs on "
                                        f"host {host}")
    names = {rank: process for process, rank in ranks(cfg).items()}
    ports = {name: (resolve_address(f"cluster.hosts.{name}.address", h.address), h.port)
             for name, h in cfg.cluster.hosts.items()}
    record, rank = environ.get(REFUSALS_ENV), environ.get("RANK", "")
    counters = Counters(ProcessRecord(Path(record), names[int(rank)])) if record and rank.isdigit() else None
    if not cfg.elastic.enabled:
        return ClusterConnector(tls, Path(socket_path), names, hosts_of(cfg), ports, counters)
    locate, reach = slot_holders(cfg)
    return ClusterConnector(tls, Path(socket_path), names, hosts_of(cfg), ports, counters, locate, reach)


def slot_holders(cfg: RunConfig) -> tuple[Callable[[str], str], Callable[[str], tuple[str, int]]]:
    """Where a worker slot's process runs now, as the coordinator's control service publishes it
    (``cluster/slots.py``), any other process (none in an elastic run) where the placement puts it;
    and where a newcomer holding a slot takes connections (published from its own claim)."""
    placed = hosts_of(cfg)
    clients: list = []  # one store client, made at first use (the rendezvous is set up by then)

    def client():
        if not clients:
            clients.append(store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        cfg.dist.init_timeout_s))
        return clients[0]

    def locate(process: str) -> str:
        if not SLOT.match(process):
            return placed[process]
        return parse_holder(client().get(holder_key(process)).decode())[0]

    def reach(newcomer: str) -> tuple[str, int]:
        address, _, port = client().get(address_key(newcomer)).decode().rpartition(":")
        return address, int(port)
    return locate, reach

