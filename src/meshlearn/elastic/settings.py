"""Settings of elastic membership (``elastic.*``) and the torchft timeouts derived from the links.

Kept free of torch.distributed and torchft so the config tree can import it.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from meshlearn.distributed.settings import DistConfig, derive_deadlines
from meshlearn.mesh.network import LinkProfile

MEMBERSHIPS = ("torchft", "control")


@dataclass(frozen=True)
class ElasticConfig:
    """Stage replicas leave and rows join mid-run: one torchft quorum per pipeline stage.
    Config keys under ``elastic.``; needs ``backend = "dist"`` and the ``[elastic]`` extra."""

    enabled: bool = False
    """Run the stages' data-parallel axis on torchft quorums instead of a fixed process group: a
    dead stage replica's row partners spectate until a joiner completes the row, the other rows go on.
    Off: the fixed-membership driver."""
    membership: str = "torchft"
    """Who keeps each stage's quorum: ``torchft`` (a lighthouse per stage, a quorum asked for at
    every step, its own ports) or ``control`` (a record on the run's store, formed anew only when
    a member's heartbeat lapses, a joiner asks or a step fails; DP sums over framed streams from
    the run's connector; docs/elastic.md, "Membership on the control service")."""
    min_replicas: int = 1
    """A step commits only if every stage has at least this many live replicas in its quorum."""
    host: str = "127.0.0.1"
    """The one address every component listens on (lighthouses, managers, quorum stores, gloo).
    An IPv4 address of this machine; the run refuses to start if anything listens elsewhere."""
    heartbeat_timeout_s: float = 0.0
    """Silence after which a lighthouse drops a replica from its stage's quorum; 0 = derived:
    ``dist.dead_after_s`` + a round trip of the link. Lower it to fail over faster."""
    join_timeout_s: float = 0.0
    """How long a quorum waits for live replicas that have not asked yet; 0 = derived: one
    heartbeat timeout. Raise it if healthy replicas are often left out of a step's quorum."""
    quorum_timeout_s: float = 0.0
    """The longest one quorum may take to form; 0 = derived: the DP collective's deadline
    (docs/distributed.md) plus a heartbeat timeout."""


@dataclass(frozen=True)
class ElasticTimeouts:
    """Seconds, as torchft takes them (the lighthouse takes milliseconds: ``*_ms``)."""

    heartbeat_s: float
    join_s: float
    quorum_s: float
    collective_s: float  # a gradient all-reduce over the quorum, and the cross-stage commit vote

    @property
    def heartbeat_ms(self) -> int:
        return max(1, round(1000 * self.heartbeat_s))

    @property
    def join_ms(self) -> int:
        return max(1, round(1000 * self.join_s))


def derive_timeouts(elastic: ElasticConfig, dist: DistConfig, link: LinkProfile,
                    grad_bytes: int = 0, replicas: int = 1) -> ElasticTimeouts:
    """Every 0 of ``elastic.*`` filled in from the link model, as docs/elastic.md tabulates."""
    deadlines = derive_deadlines(dist, link, 0, 0, grad_bytes, replicas)
    heartbeat = elastic.heartbeat_timeout_s or deadlines.dead_after_s
    join = elastic.join_timeout_s or heartbeat
    quorum = elastic.quorum_timeout_s or deadlines.collective_s + heartbeat
    return ElasticTimeouts(heartbeat_s=heartbeat, join_s=join, quorum_s=quorum,
                           collective_s=deadlines.collective_s)


def validate_elastic(cfg, require) -> None:
    """Checks of ``elastic.*`` run by ``config.validate``."""
    el = cfg.elastic
    for key, value in [("elastic.heartbeat_timeout_s", el.heartbeat_timeout_s),
                       ("elastic.join_timeout_s", el.join_timeout_s),
                       ("elastic.quorum_timeout_s", el.quorum_timeout_s)]:
        require(value >= 0 and math.isfinite(value), key, value,
                "must be a finite number of seconds >= 0 (0 = derived from the link)")
    try:
        address = ipaddress.ip_address(el.host)
    except ValueError:
        address = None
    require(address is not None and address.version == 4 and not address.is_unspecified,
            "elastic.host", el.host, "must be one IPv4 address of this machine, e.g. 127.0.0.1 "
                                     "(never 0.0.0.0: nothing may listen on every interface)")
    require(el.membership in MEMBERSHIPS, "elastic.membership", el.membership,
            f"allowed: {list(MEMBERSHIPS)}")
