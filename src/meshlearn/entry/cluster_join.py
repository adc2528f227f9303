"""``meshlearn train --join --host NAME --key FILE --coordinator ADDR:PORT --out RUN``: one process
joins a running elastic cluster run from this machine, knowing only the coordinator's address.

Why it needs no copied config: everything a joiner must agree with comes from the run itself,
over the coordinator's authenticated control service (``cluster/control.py``):

- the coordinator is whoever answers at ``ADDR:PORT`` with a host certificate of the run's CA
  (this host's key is checked against the same CA), and the config it shares must name that host
  as the coordinator at that address — a machine that answers in its place with another host's
  key is refused;
- the config is the coordinator's (``cluster/shared.py``), with this machine's ``data.corpus``
  (``--set data.corpus=PATH``; nothing else may be set); the BPE tokenizer comes with its SHA-256;
- its slot: the first, in row order, whose holder has left, claimed with compare-and-set in this
  host's name (``cluster/slots.py``); two joiners never take the same one;
- this machine's port: the host launcher of ``NAME`` must be running for this run (``RUN`` is its
  folder, where it keeps ``port.json``), because the joiner's links arrive through that port.

A *newcomer* — a machine outside ``[cluster.hosts]``, with the joiner credential the run's owner
issued (``meshlearn keys --add NAME``; ``--host NAME``) — has no launcher: it opens its own one
port at ``--address ADDR:PORT`` (a ``HostPort`` in this process, for the life of the worker), and
its claim carries that address, which the coordinator publishes for the members that must
connect to it (``cluster/slots.py``: one slot, never a trusted end). If it fails, nobody on its
machine frees its slot: the coordinator does, once its heartbeat stands still
(``elastic/remote.py``).

From there the process is an ordinary elastic worker of the slot (``entry/worker.run``): it asks
its stage's quorum to take it, heals from a live replica, spectates until its row is complete and
then trains. If it fails before it contributes, its host's launcher sees the process end and frees
the slot at once (``elastic/membership.py``), for the next joiner.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from meshlearn.cluster.control import DESTINATION
from meshlearn.cluster.control_store import ControlLine, ControlStore, follow_revocations
from meshlearn.cluster.hostport import HostPort
from meshlearn.cluster.identity import host_credentials
from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV, REFUSALS_ENV
from meshlearn.cluster.placement import (
    PORT_FILE,
    newcomer_placement,
    place,
    resolve_address,
)
from meshlearn.cluster.refusals import REFUSALS_DIR
from meshlearn.cluster.role import HOST_ENV
from meshlearn.cluster.shared import KEYS, LOCAL_KEYS, TOKENIZER, install_tokenizer, received_tokenizer
from meshlearn.cluster.slots import claim_value, holder_key, parse_holder
from meshlearn.config import RunConfig, config_from_tree, parse_override
from meshlearn.distributed.streams import BIND_ADDRESS_ENV
from meshlearn.elastic.binding import OWN_PORT_ENV
from meshlearn.elastic.membership import (
    GENERATION_ENV,
    JOIN_ENV,
    STARTED_ENV,
    WRITER_ENV,
    claim_first_free,
)
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.net.counters import Counters
from meshlearn.net.port import dial
from meshlearn.net.tls import HANDSHAKE_TIMEOUT_S, Refused, RunTls

REACH_S = 30.0  # how long the coordinator may take to answer the first contact


def parse_coordinator(text: str | None, flag: str = "--coordinator") -> tuple[str, int]:
    """``--coordinator ADDR:PORT`` (or a newcomer's ``--address``), the address resolved once."""
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        whose = ("the coordinator's address and its one port (cluster.hosts.<coordinator>.address and "
                 ".port)" if flag == "--coordinator" else "this machine's address and its one inbound port")
        raise ConfigError(flag, text, f"must be ADDR:PORT, {whose}")
    return resolve_address(flag, host.strip("[]")), int(port)


def coordinator_name(tls: RunTls, address: str, port: int) -> str:
    """The host that answers the control service at ``address:port``, authenticated by the run's CA."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    sock = dial(address, port, DESTINATION, HANDSHAKE_TIMEOUT_S)
    tls_sock, peer = tls.connect(sock, expect=None, deadline=deadline)
    tls_sock.close()
    if peer.role != "host":
        raise Refused("identity_refused", f"{peer} answered at {address}:{port}, not a host of the run")
    return peer.name


def received_config(store: ControlStore, name: str, address: str, port: int,
                    overrides: list[str]) -> RunConfig:
    """The coordinator's config with this machine's local keys; refused unless it names ``name`` at
    ``address:port`` as its coordinator and is an elastic run this process can join."""
    for text in overrides:
        key, _ = parse_override(text)
        if key not in LOCAL_KEYS:
            raise ConfigError("--set", text, f"a joiner takes the run's config; it may set only "
                                             f"{', '.join(LOCAL_KEYS)}")
    cfg = config_from_tree(json.loads(store.get(f"{KEYS}/config")), overrides)
    host = cfg.cluster.hosts.get(cfg.cluster.coordinator)
    if (cfg.cluster.coordinator != name or host is None
            or (resolve_address("cluster.coordinator", host.address), host.port) != (address, port)):
        raise ConfigError("--coordinator", f"{address}:{port}",
                          f"{name} answered there, but the run's config names {cfg.cluster.coordinator} "
                          "as its coordinator: give the coordinator's address")
    if not cfg.elastic.enabled:
        raise ConfigError("--join", True, "the run is not elastic (elastic.enabled = false): it takes "
                                          "no joiners")
    return cfg


def claim_slot(store, mesh: MeshShape, host: str,
               address: tuple[str, int] | None = None) -> tuple[WorkerId, int]:
    """The first free slot, claimed in this host's name (with a newcomer's inbound port); its
    generation before the claim."""
    claimed = claim_first_free(store, mesh, claim_value(host, os.getpid(), address),
                               lambda wid: parse_holder(store.get(holder_key(str(wid))).decode())[1])
    if claimed is None:
        raise ConfigError("--join", True, "no free slot: every worker of the run is still in it")
    return claimed


def port_socket(run_dir: Path, host: str) -> str:
    """This host's port agent, as its launcher left it in the run folder."""
    try:
        port = json.loads((run_dir / PORT_FILE).read_text())
    except (OSError, ValueError):
        port = {}
    if port.get("host") != host or not Path(port.get("socket", "")).exists():
        raise ConfigError("--out", str(run_dir), f"no running launcher of host {host} for this run there: "
                                                 f"start `meshlearn train --host {host}` on this machine "
                                                 "first (its port receives the joiner's links)")
    return port["socket"]


def prepare_cluster_join(host: str, key: str | None, coordinator: str | None, run_dir: Path,
                         overrides: list[str], own: str | None = None) -> tuple[RunConfig, HostPort | None]:
    """Find the run behind ``coordinator``, take a free slot in ``host``'s name, and set this
    process's environment as a host launcher sets it for its workers; returns the run's config
    and, for a newcomer (``own``: its ``--address``; its key's certificate says ``joiner``), the
    port it opened, which the caller holds open for the life of its worker."""
    address, port = parse_coordinator(coordinator)
    newcomer = own is not None  # a machine outside the placement gives its own port
    credentials = host_credentials(host, key, "joiner" if newcomer else "host")
    tls = RunTls(credentials)
    try:
        name = coordinator_name(tls, address, port)
        line = ControlLine(tls, address, port, name)
        line.reach(REACH_S)
    except Refused as err:
        raise ConfigError("--key", key, f"the coordinator at {address}:{port} refused it "
                                        f"({err.detail})") from None
    except OSError as err:
        raise ConfigError("--coordinator", coordinator, f"no control service answered there "
                                                        f"({type(err).__name__}: {err})") from None
    store = ControlStore(line, REACH_S)
    # the revocation list the coordinator publishes, in force before this process's links listen
    # (its contexts read the file beside the key); a joiner's list may be older than the run's
    follow_revocations(line, Counters(), lambda text: print(text, file=sys.stderr, flush=True)).look()
    cfg = received_config(store, name, address, port, overrides)
    if newcomer:
        placement = newcomer_placement(cfg, host, parse_coordinator(own, "--address"))
        run_dir.mkdir(parents=True, exist_ok=True)  # no launcher made it: the newcomer's own folder
        own_port = HostPort(placement, credentials)
        socket_path = str(own_port.socket_path)
        os.environ[OWN_PORT_ENV] = f"{placement.address}:{placement.port}"
    else:
        placement, own_port = place(cfg, host), None  # a host of the run, whose address this machine has
        socket_path = port_socket(run_dir, host)
    if cfg.data.tokenizer == "bpe":
        install_tokenizer(run_dir / TOKENIZER, *received_tokenizer(store), resume=False)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    workers = _workers_store(store)
    wid, generation = claim_slot(workers, mesh, host,
                                 (placement.address, placement.port) if newcomer else None)
    os.environ.update({
        "RANK": str(mesh.rank(wid)), "WORLD_SIZE": str(mesh.world_size), "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": address, "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "MESHLEARN_STORE_OWNER": f"the coordinator {name}'s control service at {address}:{port}",
        "GLOO_SOCKET_IFNAME": placement.interface, BIND_ADDRESS_ENV: placement.address,
        HOST_ENV: host, PORT_SOCKET_ENV: socket_path, KEY_ENV: str(credentials.key),
        REFUSALS_ENV: str(run_dir / REFUSALS_DIR), JOIN_ENV: "1", GENERATION_ENV: str(generation + 1),
        WRITER_ENV: "", STARTED_ENV: str(mesh.world_size)})
    print(f"meshlearn: joined the run of {name} at {address}:{port} from host {host}: took slot {wid} "
          f"(generation {generation + 1})", flush=True)
    return cfg, own_port


def _workers_store(store: ControlStore):
    """The workers' namespace, as ``distributed.health.store_client`` makes it."""
    import torch.distributed as dist

    return dist.PrefixStore("meshlearn/0/", store)
