"""A cluster host's one inbound port, for as long as its launcher runs.

The launcher opens a ``net.port.PortAgent`` on ``cluster.hosts.NAME.address:port`` — the only TCP
port a cluster run listens on for its control plane — with its Unix socket in a fresh private
folder (mode 0700; a short path under the system's temporary folder, because a run folder's path
can outgrow AF_UNIX's 107 bytes). Every local process that receives connections (the coordinator's
control service, the workers' links) registers a destination there; the workers learn where from
their environment (``worker_env``). What the agent refuses is counted in the host's ``Counters``,
which also collect the control service's refusals; what the host's workers refuse (their links'
hellos, their DP contributions) each worker keeps in its own record (``refusals.py``). The host's
``security.json`` adds them all up, by reason and by the participant each refusal is attributed to.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from meshlearn.atomic import atomic_write_json
from meshlearn.cluster.links import KEY_ENV, PORT_SOCKET_ENV, REFUSALS_ENV
from meshlearn.cluster.placement import Placement
from meshlearn.cluster.refusals import REFUSALS_DIR, merged, process_records
from meshlearn.errors import ConfigError
from meshlearn.net.counters import Counters, newest_per_reason
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

    def worker_env(self, run_dir: Path) -> dict[str, str]:
        """What a worker of this host needs to receive connections, to authenticate, and to record
        what it refuses (in ``run_dir``)."""
        return {PORT_SOCKET_ENV: str(self.socket_path), KEY_ENV: str(self.credentials.key),
                REFUSALS_ENV: str(Path(run_dir) / REFUSALS_DIR)}

    def record(self, run_dir: Path | None = None) -> dict:
        """This host's refusals (its port's, its control service's, and its processes' records in
        ``run_dir``), for its security.json and the coordinator's summary."""
        processes = process_records(run_dir)
        refused, by_sender = merged(self.counters, processes)
        recent = self.counters.recent() + [line for r in processes.values() for line in r.get("recent", [])]
        return {"host": self.placement.host, "port": f"{self.placement.address}:{self.placement.port}",
                "refused": refused, "refused_total": sum(refused.values()), "by_sender": by_sender,
                "processes": {name: r["refused"] for name, r in processes.items()},
                "routed": self.agent.routed, "recent": newest_per_reason(str(line) for line in recent)}

    def write_record(self, run_dir: Path) -> dict:
        record = self.record(run_dir)
        atomic_write_json(Path(run_dir) / SECURITY_FILE, record)
        return record

    def close(self) -> None:
        self.agent.close()
        shutil.rmtree(self._folder, ignore_errors=True)
