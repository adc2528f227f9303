"""A user-space delay line between two TUN devices (this kernel has no netem; see
/work/shared/wan-emulation.md). Run as a separate process, one per link:

    python tun_relay.py TUN_A TUN_B DELAY_MS

It creates both TUN devices (IFF_TUN | IFF_NO_PI), prints ``ready`` once they exist (the caller
then moves each into its namespace, addresses it and puts ``tc tbf`` on it for the rate — the
file descriptors stay valid across the move), and forwards every packet read from one device to
the other after holding it DELAY_MS (a heap ordered by release time; ``select`` with the next
deadline as timeout; a fixed delay keeps packets in order). It sends nothing anywhere else, and
its devices vanish when it is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(name_a: str, name_b: str, delay_s: float) -> None:
    a, b = open_tun(name_a), open_tun(name_b)
    other = {a: b, b: a}
    print("ready", flush=True)
    held: list[tuple[float, int, int, bytes]] = []
    seq = itertools.count()
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            try:
                packet = os.read(fd, 65536)
            except OSError:  # the device is still down while being configured
                continue
            heapq.heappush(held, (now + delay_s, next(seq), other[fd], packet))
        while held and held[0][0] <= time.monotonic():
            _, _, fd, packet = heapq.heappop(held)
            with contextlib.suppress(OSError):  # the far device is not up yet: the sender retransmits
                os.write(fd, packet)


if __name__ == "__main__":
    relay(sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1000.0)
