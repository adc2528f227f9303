"""A stranger on the run's network (run in its own namespace): what it can send to every listening
port of a cluster run, in rounds until it is killed — random bytes, a TCPStore client writing the
run's ``abort``, the same behind a valid routing preamble, an HTTP kill request, and 100 idle
connections (half of them parked behind a preamble, in the TLS handshake). It prints what it did.

    python stranger.py 10.0.0.1:29500 10.0.0.2:29500
"""

from __future__ import annotations

import contextlib
import random
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from meshlearn.net.port import preamble

TCPSTORE_HELLO = b"\x00\xce\xf7\x85<"  # what torch's TCPStore client sends first
IDLE = 100


def _send(target: tuple[str, int], data: bytes) -> None:
    with contextlib.suppress(OSError), socket.create_connection(target, timeout=2) as sock:
        sock.sendall(data)
        sock.settimeout(1)
        with contextlib.suppress(OSError):
            sock.recv(4096)


def _tcpstore_abort(target: tuple[str, int]) -> None:
    try:
        store = dist.TCPStore(target[0], target[1], is_master=False, timeout=timedelta(seconds=1))
        store.set("meshlearn/0//abort", "worker r0s1 failed: the stranger says so")
        print("stranger: a TCPStore write got through", flush=True)
    except Exception as err:  # noqa: BLE001 — refused, as it should be
        print(f"stranger: TCPStore refused ({type(err).__name__})", flush=True)


def round_of(targets: list[tuple[str, int]], rng: random.Random) -> None:
    for target in targets:
        for _ in range(5):
            _send(target, b"\xff" + rng.randbytes(rng.randint(0, 4096)))  # never a preamble's start
        _send(target, preamble("control") + TCPSTORE_HELLO + rng.randbytes(300))
        _send(target, b"POST /replica/r0s0/kill HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        _tcpstore_abort(target)
        idle = []
        for i in range(IDLE):
            with contextlib.suppress(OSError):
                sock = socket.create_connection(target, timeout=2)
                if i % 2:
                    sock.sendall(preamble("control"))  # parked in the TLS handshake
                idle.append(sock)
        time.sleep(1.0)
        for sock in idle:
            sock.close()


def main(argv: list[str]) -> None:
    targets = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in argv]
    rng = random.Random(0)
    rounds = 0
    while True:
        round_of(targets, rng)
        rounds += 1
        print(f"stranger: round {rounds} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
