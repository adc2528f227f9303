"""torchft, bound to one address: every listening socket of an elastic run is on ``elastic.host``.

torchft (the pinned ``torchft-nightly`` below) listens on every interface by default, in three
places: the lighthouse (``--bind [::]:29510``), each replica's manager server (``[::]:0``, not
configurable), and the rendezvous store a process group hosts for its quorum (a ``TCPStore`` on
``socket.gethostname()``, whose server binds ``[::]``). Its HTTP checkpoint server does too; we do not
use it (state travels over the process group: ``PGTransport``). Here each of them gets a socket on
``host`` only, and ``check_bound`` proves it from /proc after start-up; the run refuses to go on
otherwise. Gloo's own pair sockets bind to the device address, chosen here by interface.

The manager server's address is fixed inside ``Manager.__init__``; the one seam is the name
``torchft.manager.ManagerServer``, which ``create_manager`` replaces for the duration of that call
only. That is why the version is pinned exactly and checked at import.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from collections.abc import Callable
from datetime import timedelta
from importlib import metadata

from meshlearn.distributed.bound_store import BoundStore
from meshlearn.elastic.listeners import off_address

TORCHFT_DIST = "torchft-nightly"
TORCHFT_VERSION = "2026.10.26"  # pyproject.toml's [elastic] extra pins the same


class ElasticSetupError(RuntimeError):
    """torchft is missing, the wrong version, or something listens where it must not."""


def require_torchft():
    """Import torchft after checking it is the pinned version (the bind seams depend on it)."""
    try:
        version = metadata.version(TORCHFT_DIST)
    except metadata.PackageNotFoundError:
        raise ElasticSetupError(f"elastic.enabled needs {TORCHFT_DIST}=={TORCHFT_VERSION}: "
                                f"pip install -e '.[elastic]'") from None
    if version != TORCHFT_VERSION:
        raise ElasticSetupError(f"elastic.enabled needs {TORCHFT_DIST}=={TORCHFT_VERSION}, found "
                                f"{version}: its listening addresses are patched for that version only")
    os.environ["TORCHFT_USE_OTEL"] = "false"  # never export logs (torchft/otel.py reads this at import)
    import torchft
    import torchft.manager

    return torchft


def interface_of(host: str) -> str:
    """The network interface that carries IPv4 address ``host`` (for GLOO_SOCKET_IFNAME)."""
    wanted = socket.gethostbyname(host)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == wanted:
                return name
    finally:
        probe.close()
    raise ElasticSetupError(f"elastic.host = {host!r}: no network interface of this machine has "
                            f"the address {wanted}")


def bound_process_group(host: str, timeout: timedelta):
    """torchft's reconfigurable gloo group, its quorum rendezvous store on ``host`` only."""
    torchft = require_torchft()

    class BoundProcessGroupGloo(torchft.ProcessGroupGloo):
        """``get_reconfigure_handle`` as torchft's, with a store that listens on ``host``."""

        def get_reconfigure_handle(self) -> str:
            if getattr(self, "_bound_store", None) is None:
                self._bound_store = BoundStore(host, timeout.total_seconds())
            return json.dumps({"id": self._handle_id(), "store": self._bound_store.address,
                               "global_rank": self._global_rank})

    return BoundProcessGroupGloo(timeout=timeout)


def create_manager(host: str, **kwargs):
    """``torchft.Manager(**kwargs)`` whose manager server listens on and advertises ``host``."""
    torchft = require_torchft()
    module = torchft.manager
    original: Callable = module.ManagerServer

    def bound_server(*args, **server_kwargs):
        server_kwargs["bind"] = f"{host}:0"
        server_kwargs["hostname"] = host
        return original(*args, **server_kwargs)

    module.ManagerServer = bound_server
    try:
        return torchft.Manager(**kwargs)
    finally:
        module.ManagerServer = original


def start_lighthouse(host: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int,
                     quorum_tick_ms: int = 10):
    """A lighthouse on ``host`` (OS-chosen port); returns (server, its address for managers)."""
    from torchft._torchft import LighthouseServer

    require_torchft()
    server = LighthouseServer(bind=f"{host}:0", min_replicas=min_replicas,
                              join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://{host}:{port}"


OWN_PORT_ENV = "MESHLEARN_OWN_PORT"
"""ADDR:PORT of the one port a cluster newcomer's process opens itself (``entry/cluster_join.py``:
it has no launcher to hold it), the only listener allowed off ``host`` in that process."""


def check_bound(pid: int, host: str, who: str) -> None:
    """Refuse to go on if process ``pid`` listens anywhere but ``host`` (and its own port, for a
    cluster newcomer: ``OWN_PORT_ENV``)."""
    own = os.environ.get(OWN_PORT_ENV, "")
    stray = [(a, p) for a, p in off_address(pid, host) if f"{a}:{p}" != own]
    if stray:
        where = ", ".join(f"{a}:{p}" for a, p in stray)
        raise ElasticSetupError(f"{who} listens on {where}, not only on elastic.host = {host}: "
                                f"refusing to run (a torchft change?)")
