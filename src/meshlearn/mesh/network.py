"""Links between workers: a profile per directed pair, transfers on one link served in order.

The same arithmetic is used by the simulator (to advance the virtual clock) and by in-process
shaping in real runs (to pace a sender), so the two can be compared.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from meshlearn.mesh.topology import WorkerId


@dataclass(frozen=True)
class LinkProfile:
    """A directed link. Config keys under ``link.``."""

    bandwidth_mbit: float = 200.0
    """Megabits per second; ``inf`` for an unlimited link. Must be > 0."""
    latency_ms: float = 50.0
    """One-way delay in milliseconds added to every message after serialization."""
    jitter_ms: float = 0.0
    """Extra one-way delay, uniform in [0, jitter_ms], per message (order on a link is preserved)."""
    loss_rate: float = 0.0
    """Probability that one transmission of a message is lost and resent after a round trip."""

    def serialization_s(self, nbytes: int) -> float:
        if math.isinf(self.bandwidth_mbit):
            return 0.0
        return nbytes * 8.0 / (self.bandwidth_mbit * 1e6)

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000.0


@dataclass
class Link:
    """One directed link's queue: it sends one message at a time, first come first served."""

    src: WorkerId
    dst: WorkerId
    axis: str
    profile: LinkProfile
    rng: random.Random
    free_at: float = 0.0
    last_arrival: float = 0.0
    bytes_sent: int = 0
    busy_s: float = 0.0

    def transmit(self, now: float, nbytes: int) -> float:
        """Queue ``nbytes`` at time ``now``; return the time the message is fully delivered."""
        start = max(now, self.free_at)
        serialization = self.profile.serialization_s(nbytes)
        resend = 0.0
        while self.profile.loss_rate > 0 and self.rng.random() < self.profile.loss_rate:
            resend += serialization + 2 * self.profile.latency_s  # detected after a round trip
        self.free_at = start + serialization + resend
        self.busy_s += serialization + resend
        self.bytes_sent += nbytes
        jitter = self.rng.uniform(0.0, self.profile.jitter_ms / 1000.0) if self.profile.jitter_ms else 0.0
        arrival = max(self.free_at + self.profile.latency_s + jitter, self.last_arrival)
        self.last_arrival = arrival  # a stream (TCP) never delivers out of order
        return arrival

    def occupy(self, start: float, seconds: float, nbytes: int) -> None:
        """Account a transfer whose timing a collective's cost model already decided."""
        self.free_at = max(self.free_at, start + seconds)
        self.busy_s += seconds
        self.bytes_sent += nbytes

    def state(self) -> dict:
        return {"free_at": self.free_at, "last_arrival": self.last_arrival,
                "bytes_sent": self.bytes_sent, "busy_s": self.busy_s, "rng": self.rng.getstate()}

    def load_state(self, state: dict) -> None:
        self.free_at, self.last_arrival = state["free_at"], state["last_arrival"]
        self.bytes_sent, self.busy_s = state["bytes_sent"], state["busy_s"]
        self.rng.setstate(state["rng"])


@dataclass
class Network:
    """Every directed link of the mesh, created on first use with the default profile."""

    default: LinkProfile
    seed: int = 0
    overrides: dict[tuple[WorkerId, WorkerId], LinkProfile] = field(default_factory=dict)
    links: dict[tuple[WorkerId, WorkerId], Link] = field(default_factory=dict)

    def link(self, src: WorkerId, dst: WorkerId) -> Link:
        key = (src, dst)
        if key not in self.links:
            axis = "pp" if src.replica == dst.replica else "dp"
            profile = self.overrides.get(key, self.default)
            rng = random.Random(f"{self.seed}:{src}->{dst}")
            self.links[key] = Link(src, dst, axis, profile, rng)
        return self.links[key]

    def bytes_on_axis(self, axis: str) -> int:
        return sum(link.bytes_sent for link in self.links.values() if link.axis == axis)

    def state(self) -> dict:
        return {f"{s}->{d}": link.state() for (s, d), link in self.links.items()}

    def load_state(self, state: dict) -> None:
        for key, link_state in state.items():
            src, dst = key.split("->")
            self.link(WorkerId.parse(src), WorkerId.parse(dst)).load_state(link_state)


def ring_allreduce_s(nbytes: int, members: int, profile: LinkProfile) -> float:
    """Time of a ring all-reduce of ``nbytes`` among ``members`` peers (reduce-scatter + all-gather).

    2(D-1) rounds, each moving a 1/D chunk over every ring link in parallel and paying one latency.
    """
    if members <= 1:
        return 0.0
    chunk = math.ceil(nbytes / members)
    rounds = 2 * (members - 1)
    return rounds * (profile.serialization_s(chunk) + profile.latency_s)


def ring_allreduce_bytes_per_member(nbytes: int, members: int) -> int:
    """Bytes each peer sends in a ring all-reduce: 2(D-1) chunks of nbytes/D."""
    if members <= 1:
        return 0
    return 2 * (members - 1) * math.ceil(nbytes / members)
