"""A TCPStore server bound to one address (torch's binds every interface by default): the
rendezvous of a dist run, of an elastic run's launcher, and of a cluster's coordinator."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host`` and ``port`` (0: OS-chosen), kept open by the caller."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


class BoundStore:
    """A TCPStore server that listens on ``host`` only (its default binds every interface), on
    ``port`` (0: OS-chosen)."""

    def __init__(self, host: str, timeout_s: float, world_size: int | None = None, port: int = 0):
        self._sock = listen_socket(host, port)  # TCPStore serves on this fd; it must outlive the store
        self.host = host
        self.store = dist.TCPStore(host, self._sock.getsockname()[1], world_size=world_size, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                                   master_listen_fd=self._sock.fileno())
        self.port = self.store.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
