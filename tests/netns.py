"""Two network namespaces joined by a real slow link, for tests that run processes as if on two
machines: ``tc tbf`` for the rate and a user-space TUN relay (tests/distributed/tun_relay.py) for
the one-way delay (this kernel has no netem; ../shared/wan-emulation.md).

Needs root, ``ip``/``tc`` and /dev/net/tun (``missing`` says which is absent: tests skip with it).
All traffic stays in the namespaces; they and the relay are removed when the context ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RELAY = Path(__file__).parent / "distributed" / "tun_relay.py"


def missing() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


@dataclass
class Wan:
    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]

    def run(self, side: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``side`` (0 or 1)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[side], *argv], **popen)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def wan_link(delay_ms: float, rate: str, subnet: str = "10.231.7") -> Iterator[Wan]:
    """nsA —tunA(tbf)— relay (delay) —tunB(tbf)— nsB, named after this process to stay unique."""
    tag = f"ml{os.getpid() % 100000}"
    spaces, devices = (f"{tag}a", f"{tag}b"), (f"{tag}ta", f"{tag}tb")
    addresses = (f"{subnet}.1", f"{subnet}.2")
    relay = None
    try:
        for ns in spaces:
            _ip("netns", "add", ns)
        relay = subprocess.Popen([sys.executable, str(RELAY), *devices, str(delay_ms)],
                                 stdout=subprocess.PIPE, text=True)
        assert relay.stdout.readline().strip() == "ready"
        for ns, dev, addr, peer in zip(spaces, devices, addresses, addresses[::-1], strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "peer", peer, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", "9000", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", "256kb", "latency", "50ms"], check=True, timeout=10)
        yield Wan(spaces, devices, addresses)
    finally:
        if relay is not None:
            relay.kill()  # its TUN devices vanish with it
            relay.wait(timeout=10)
        for ns in spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def stranger(wan: Wan, subnet: str = "10.232.9") -> Iterator[str]:
    """A third namespace that reaches both of ``wan``'s addresses, over a veth pair to each side
    (``subnet``.0/30 to side 0, .4/30 to side 1), as a machine on the same network that no one
    invited. Yields its name (run processes in it with ``ip netns exec``)."""
    tag = wan.namespaces[0][:-1]
    space = f"{tag}x"
    try:
        _ip("netns", "add", space)
        _ip("-n", space, "link", "set", "lo", "up")
        for side, (ns, address) in enumerate(zip(wan.namespaces, wan.addresses, strict=True)):
            ours, theirs = f"{tag}x{side}", f"{tag}y{side}"
            near, far = f"{subnet}.{4 * side + 2}", f"{subnet}.{4 * side + 1}"
            _ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
            _ip("link", "set", ours, "netns", space)
            _ip("link", "set", theirs, "netns", ns)
            _ip("-n", space, "addr", "add", f"{near}/30", "dev", ours)
            _ip("-n", ns, "addr", "add", f"{far}/30", "dev", theirs)
            _ip("-n", space, "link", "set", ours, "up")
            _ip("-n", ns, "link", "set", theirs, "up")
            _ip("-n", space, "route", "add", f"{address}/32", "via", far)
        yield space
    finally:
        subprocess.run(["ip", "netns", "del", space], capture_output=True, timeout=10)  # its veths go too
