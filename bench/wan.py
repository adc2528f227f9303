"""N emulated machines on this one: a network namespace each, a point-to-point link between every
pair, every link capped by ``tc tbf`` and a chosen pair delayed by a user-space TUN relay (this
kernel has no netem; ../shared/wan-emulation.md).

Each machine's one address sits on its loopback device (``/32``) and is reached from every other
machine through their pair's own link (a host route with that address as source), so a machine
with two peers still has one address, as a real one does. A pair without delay is a veth pair
(no user-space hop, no CPU); a delayed pair goes through ``tests/distributed/tun_relay.py``, one
process per pair. All traffic stays inside the namespaces; everything is removed when the context
ends, even on failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RELAY = Path(__file__).resolve().parent.parent / "tests" / "distributed" / "tun_relay.py"


def unavailable() -> str | None:
    """Why machines cannot be emulated here (None: they can): the bench's one-line refusal."""
    needs = [(os.geteuid() == 0, "network namespaces need root"),
             (all(shutil.which(tool) for tool in ("ip", "tc")), "iproute2 (ip, tc) is missing"),
             (os.path.exists("/dev/net/tun"), "/dev/net/tun is missing (the delay relay needs TUN)"),
             (RELAY.is_file(), f"the TUN relay {RELAY} is missing")]
    return next((why for ok, why in needs if not ok), None)


@dataclass(frozen=True)
class Machine:
    """One emulated machine: its namespace and its one address."""

    namespace: str
    address: str

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` started inside this machine's namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], **kwargs)


# An echo server (argv: address, port) that prints "ready" once it listens, and a client (argv:
# address, port, count) that prints the shortest of ``count`` one-byte round trips in ms.
_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c = s.accept()[0]
while (b := c.recv(1)):
    c.sendall(b)
"""
_PING = """import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
best = float("inf")
for _ in range(int(sys.argv[3])):
    t = time.monotonic(); c.sendall(b"x"); c.recv(1); best = min(best, time.monotonic() - t)
print(f"{best * 1000:.3f}")
"""


def rtt_ms(client: Machine, server: Machine, count: int = 5, port: int = 7707) -> float:
    """The shortest of ``count`` TCP round trips from ``client`` to ``server``'s address, in ms:
    what the link really delays (the relay holds each packet at least its delay)."""
    echo = server.popen([sys.executable, "-c", _ECHO, server.address, str(port)], stdout=subprocess.PIPE,
                        text=True)
    try:
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the echo server on {server.address} did not start")
        ping = client.popen([sys.executable, "-c", _PING, server.address, str(port), str(count)],
                            stdout=subprocess.PIPE, text=True)
        out, _ = ping.communicate(timeout=30)
        return float(out)
    finally:
        echo.kill()
        echo.wait(timeout=10)


def pair_devices(tag: str, i: int, j: int) -> tuple[str, str]:
    """The link's device in machine i and in machine j (at most 15 characters each)."""
    return f"{tag}l{i}{j}", f"{tag}l{j}{i}"


def _sh(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


@contextlib.contextmanager
def machines(count: int, rate: str, delays_ms: dict[tuple[int, int], float],
             subnet: str = "10.236.0") -> Iterator[list[Machine]]:
    """``count`` machines at ``subnet``.1, .2, ...; every pair linked at ``rate`` (a tc rate,
    e.g. "200mbit") each way, the pairs in ``delays_ms`` ((i, j) with i < j) delayed that much
    one way through a relay."""
    tag = f"mb{os.getpid() % 10000}"
    made = [Machine(f"{tag}n{i}", f"{subnet}.{i + 1}") for i in range(count)]
    relays: list[subprocess.Popen] = []
    added: list[str] = []
    try:
        for m in made:
            _sh("ip", "netns", "add", m.namespace)
            added.append(m.namespace)
            _sh("ip", "-n", m.namespace, "link", "set", "lo", "up")
            _sh("ip", "-n", m.namespace, "addr", "add", f"{m.address}/32", "dev", "lo")
        for i, j in itertools.combinations(range(count), 2):
            devices = pair_devices(tag, i, j)
            if delays_ms.get((i, j), 0) > 0:
                relay = subprocess.Popen([sys.executable, str(RELAY), *devices, str(delays_ms[(i, j)])],
                                         stdout=subprocess.PIPE, text=True)
                relays.append(relay)
                if relay.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the TUN relay for machines {i}-{j} did not start")
                for side, dev in zip((i, j), devices, strict=True):
                    _sh("ip", "link", "set", dev, "netns", made[side].namespace)
            else:
                _sh("ip", "link", "add", devices[0], "netns", made[i].namespace, "type", "veth",
                    "peer", "name", devices[1], "netns", made[j].namespace)
            for here, there, dev in ((made[i], made[j], devices[0]), (made[j], made[i], devices[1])):
                _sh("ip", "-n", here.namespace, "link", "set", dev, "mtu", "9000", "up")
                _sh("ip", "netns", "exec", here.namespace, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "50ms")
                _sh("ip", "-n", here.namespace, "route", "add", f"{there.address}/32", "dev", dev,
                    "src", here.address)
        yield made
    finally:
        for relay in relays:
            relay.kill()  # its TUN devices vanish with it
            relay.wait(timeout=10)
        for namespace in added:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=15)  # veths go too
