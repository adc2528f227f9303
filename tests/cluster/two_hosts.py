"""The two emulated machines the multi-machine cluster tests share: alice (the coordinator: r0s0,
r1s1) and bob (r0s1, r1s0), so that both the pipeline links and the DP links cross machines, joined
by a TUN link shaped to 100 Mbit/s with a 5 ms one-way delay (``netns.wan_link``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from netns import Wan, wan_link

from meshlearn.cluster.settings import ClusterConfig, HostConfig
from meshlearn.config import RunConfig

DELAY_MS = 5
HOSTS = ("alice", "bob")
PLACED = {"alice": ("r0s0", "r1s1"), "bob": ("r0s1", "r1s0")}


@contextmanager
def two_machines(subnet: str) -> Iterator[Wan]:
    """alice and bob's namespaces (each test module its own ``subnet``: its addresses)."""
    with wan_link(DELAY_MS, "100mbit", subnet=subnet) as link:
        yield link


def placed(cfg: RunConfig, wan: Wan, port: int) -> RunConfig:
    """``cfg`` with the ``[cluster]`` placement of ``PLACED`` on ``wan``'s addresses, alice coordinating."""
    hosts = {name: HostConfig(address, port, PLACED[name]) for name, address in zip(HOSTS, wan.addresses,
                                                                                      strict=True)}
    return dataclasses.replace(cfg, cluster=ClusterConfig("alice", hosts))
