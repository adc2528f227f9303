"""Which TCP addresses a process listens on, read from /proc (Linux).

Used to prove, at run time and in tests, that no component of an elastic run listens on every
interface (``0.0.0.0`` or ``[::]``): torchft's defaults do, and a run on loopback must stay on it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp{,6}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _decode(hex_addr: str, v6: bool) -> tuple[str, int]:
    """``0100007F:1F90`` → ("127.0.0.1", 8080); the kernel prints each 32-bit word little-endian."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)
    text = str(ip.ipv4_mapped) if v6 and ip.ipv4_mapped else str(ip)
    return text, int(port, 16)


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on (TCP, IPv4 and IPv6)."""
    inodes = _socket_inodes(pid)
    found = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.append(_decode(fields[1], v6))
    return sorted(found)


def is_wildcard(address: str) -> bool:
    return ipaddress.ip_address(address).is_unspecified


def off_address(pid: int, host: str) -> list[tuple[str, int]]:
    """Listening sockets of ``pid`` that are not on ``host`` (a wildcard is never on it)."""
    allowed = {socket.gethostbyname(host)} if not _is_ip(host) else {host}
    return [(a, p) for a, p in listening(pid) if is_wildcard(a) or a not in allowed]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
