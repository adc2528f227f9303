"""A cluster host's one inbound port, for as long as its launcher runs.

The launcher opens a ``net.port.PortAgent`` on ``cluster.hosts.NAME.address:port`` — the only TCP
port a cluster run listens on for its control plane — with its Unix socket in a fresh private
folder (mode 0700; a short path under the system's temporary folder, because a run folder's path
can outgrow AF_UNIX's 107 bytes). Every local process that receives connections (the coordinator's
control service, the workers' links) registers a destination there; the workers learn where from
their environment (``worker_env``). What the agent refuses is counted in the host's ``Counters``,
which also collect the control service's refusals, and written to the host's ``security.json``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from meshlearn.atomic import atomic_write_json
from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV
from meshlearn.cluster.placement import Placement
from meshlearn.errors import ConfigError
from meshlearn.net.counters import Counters
from meshlearn.net.keys import Credentials
from meshlearn.net.port import PortAgent

SECURITY_FILE = "security.json"


class HostPort:
    """This host's port agent and the refusals counted on this machine."""

    def __init__(self, placement: Placement, credentials: Credentials):
        self.placement, self.credentials = placement, credentials
        self.counters = Counters()
        self._folder = Path(tempfile.mkdtemp(prefix="meshlearn-port-"))
        try:
            self.agent = PortAgent(placement.address, placement.port, self._folder / "agent.sock",
                                   self.counters)
        except OSError as err:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise ConfigError(f"cluster.hosts.{placement.host}.port", placement.port,
                              f"cannot listen on {placement.address}:{placement.port} "
                              f"({err.strerror or err}): choose a free port") from None
        self.agent.start()

    @property
    def socket_path(self) -> Path:
        return self.agent.socket_path

    def worker_env(self) -> dict[str, str]:
        """What a worker of this host needs to receive connections and to authenticate."""
        return {PORT_SOCKET_ENV: str(self.socket_path), KEY_ENV: str(self.credentials.key)}

    def record(self) -> dict:
        """This host's refusals, for its security.json and the coordinator's summary."""
        return {"host": self.placement.host, "port": f"{self.placement.address}:{self.placement.port}",
                "refused": self.counters.as_dict(), "refused_total": self.counters.total(),
                "routed": self.agent.routed, "recent": self.counters.recent()}

    def write_record(self, run_dir: Path) -> dict:
        record = self.record()
        atomic_write_json(Path(run_dir) / SECURITY_FILE, record)
        return record

    def close(self) -> None:
        self.agent.close()
        shutil.rmtree(self._folder, ignore_errors=True)
