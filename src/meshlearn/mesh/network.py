"""Links between workers: a profile per directed pair, transfers on one link served in order.

With ``links.access = "uplink"`` every link out of one participant sends through that
participant's ``Uplink`` instead of a queue of its own: one access link (a NIC) shared by its
pipeline sends in both directions and its DP traffic, messages leaving it one at a time in send
order, each then crossing its own link with that link's latency.

The same arithmetic is used by the simulator (to advance the virtual clock) and by in-process
shaping in real runs (to pace a sender), so the two can be compared.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from meshlearn.mesh.topology import MeshShape, WorkerId

UPLINK = "uplink"  # ``links.access`` for a shared access link; also its key in a saved network state
Access = Literal["off", "uplink"]  # the values ``links.access`` allows (the second is UPLINK)
ACCESS = get_args(Access)


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
class Uplink:
    """One participant's access link (``links.access = "uplink"``): the single queue every link
    out of it sends through, so its PP and DP messages wait for each other as on one NIC (the
    sender is its key in ``Network.uplinks``)."""

    free_at: float = 0.0
    bytes_sent: int = 0
    busy_s: float = 0.0

    def state(self) -> dict:
        return {"free_at": self.free_at, "bytes_sent": self.bytes_sent, "busy_s": self.busy_s}

    def load_state(self, state: dict) -> None:
        self.free_at, self.bytes_sent, self.busy_s = state["free_at"], state["bytes_sent"], state["busy_s"]


@dataclass
class Link:
    """One directed link's queue: it sends one message at a time, first come first served (with
    an ``uplink``, the sender's one queue, shared with its other links)."""

    src: WorkerId
    dst: WorkerId
    axis: str
    profile: LinkProfile
    rng: random.Random
    free_at: float = 0.0
    last_arrival: float = 0.0
    bytes_sent: int = 0
    busy_s: float = 0.0
    uplink: Uplink | None = None

    @property
    def queue_free_at(self) -> float:
        """When a message handed to this link now could start leaving (its queue is free)."""
        return self.free_at if self.uplink is None else self.uplink.free_at

    def transmit(self, now: float, nbytes: int) -> float:
        """Queue ``nbytes`` at time ``now``; return the time the message is fully delivered."""
        profile = self.profile
        start = max(now, self.queue_free_at)
        serialization = profile.serialization_s(nbytes)
        # Resends and jitter are added only where there are any: adding 0.0 changes no time.
        if profile.loss_rate > 0:
            resend = 0.0
            while self.rng.random() < profile.loss_rate:
                resend += serialization + 2 * profile.latency_s  # detected after a round trip
            self.free_at = start + serialization + resend
            self._occupied(serialization + resend, nbytes)
        else:
            self.free_at = start + serialization
            self._occupied(serialization, nbytes)
        delivered = self.free_at + profile.latency_s
        if profile.jitter_ms:
            delivered = delivered + self.rng.uniform(0.0, profile.jitter_ms / 1000.0)
        arrival = max(delivered, self.last_arrival)
        self.last_arrival = arrival  # a stream (TCP) never delivers out of order
        return arrival

    def _occupied(self, seconds: float, nbytes: int) -> None:
        """Account ``seconds`` of sending ending at ``free_at``, on the uplink too when shared."""
        self.busy_s += seconds
        self.bytes_sent += nbytes
        if self.uplink is not None:
            self.uplink.free_at = self.free_at
            self.uplink.busy_s += seconds
            self.uplink.bytes_sent += nbytes

    def occupy(self, start: float, seconds: float, nbytes: int) -> None:
        """Account a transfer whose timing a collective's cost model already decided."""
        self.free_at = max(self.queue_free_at, start + seconds)
        self._occupied(seconds, nbytes)

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
    axes: dict[str, LinkProfile] = field(default_factory=dict)  # per-axis profiles ("pp", "dp")
    links: dict[tuple[WorkerId, WorkerId], Link] = field(default_factory=dict)
    access: Access = "off"  # ``links.access``: UPLINK gives every sender one shared queue
    uplinks: dict[WorkerId, Uplink] = field(default_factory=dict)

    def link(self, src: WorkerId, dst: WorkerId) -> Link:
        key = (src, dst)
        link = self.links.get(key)
        if link is None:
            rng = random.Random(f"{self.seed}:{src}->{dst}")
            link = self.links[key] = Link(src, dst, _axis(src, dst), self.profile(src, dst), rng,
                                          uplink=self.uplink(src))
        return link

    def profile(self, src: WorkerId, dst: WorkerId) -> LinkProfile:
        """The profile of the link ``src`` → ``dst``: its override, else its axis's, else the default."""
        return self.overrides.get((src, dst), self.axes.get(_axis(src, dst), self.default))

    def exchange_latency_s(self, members: list[WorkerId]) -> float:
        """One scalar exchange among ``members``, each sending to every other: the slowest pair's
        latency (the global clip's norms)."""
        return max((self.profile(a, b).latency_s for a in members for b in members if a != b), default=0.0)

    def uplink(self, src: WorkerId) -> Uplink | None:
        """``src``'s access link (None: each of its links has a queue of its own)."""
        if self.access != UPLINK:
            return None
        up = self.uplinks.get(src)
        if up is None:
            up = self.uplinks[src] = Uplink()
        return up

    def bytes_on_axis(self, axis: str) -> int:
        return sum(link.bytes_sent for link in self.links.values() if link.axis == axis)

    def state(self) -> dict:
        return ({f"{s}->{d}": link.state() for (s, d), link in self.links.items()}
                | {f"{s}->{UPLINK}": up.state() for s, up in self.uplinks.items()})

    def load_state(self, state: dict) -> None:
        for key, link_state in state.items():
            src, dst = key.split("->")
            if dst == UPLINK:
                up = self.uplink(WorkerId.parse(src))
                if up is not None:  # None: resumed with links.access = off, each link its own queue
                    up.load_state(link_state)
            else:
                self.link(WorkerId.parse(src), WorkerId.parse(dst)).load_state(link_state)

    def idle(self) -> None:
        """Every queue empty now (a real run resumed in a new process: the saved queue times are
        on the old process's clock); bytes and busy time are kept."""
        for link in self.links.values():
            link.free_at = link.last_arrival = 0.0
        for up in self.uplinks.values():
            up.free_at = 0.0


@dataclass(frozen=True)
class LinksConfig:
    """Heterogeneous links. Config keys under ``links.``; every profile not set here is ``link.*``.

    Example: DP links at 50 Mbit/s / 80 ms, and one slow participant::

        [links]
        dp_bandwidth_mbit = 50
        dp_latency_ms = 80
        overrides = "r1s2->*: bandwidth_mbit=20; *->r1s2: bandwidth_mbit=20"
    """

    dp_bandwidth_mbit: float = 0.0
    """Bandwidth of every DP link (between replicas of one stage); 0 = link.bandwidth_mbit."""
    dp_latency_ms: float = -1.0
    """One-way latency of every DP link; -1 = link.latency_ms."""
    pp_bandwidth_mbit: float = 0.0
    """Bandwidth of every PP link (stage s → s±1 of one replica); 0 = link.bandwidth_mbit."""
    pp_latency_ms: float = -1.0
    """One-way latency of every PP link; -1 = link.latency_ms."""
    access: Access = "off"
    """``off``: every directed link sends from a queue of its own. ``uplink``: each participant
    has one access link that every link out of it shares (its pipeline sends both ways and its DP
    traffic): its messages leave one at a time in send order, each at its link's bandwidth (with
    one bandwidth for all links, ``link.bandwidth_mbit`` is the participant's uplink), then cross
    their link with its latency. Receiving is not queued (no downlink: every pattern here sends
    about what it receives, so an uplink binds first)."""
    overrides: str = ""
    """Per-link profiles, ``;``-separated ``SRC->DST: key=value, ...`` with SRC/DST a worker
    (r1s2) or ``*``, keys any of link.* (bandwidth_mbit, latency_ms, jitter_ms, loss_rate). Later
    entries win; an override starts from the link's axis profile."""


def _axis(src: WorkerId, dst: WorkerId) -> str:
    return "dp" if src.stage == dst.stage else "pp"  # (pp across replicas: a re-paired row)


def parse_overrides(text: str) -> list[tuple[str, str, dict[str, float]]]:
    """``links.overrides`` → [(src, dst, {field: value})]; raises ValueError naming the entry."""
    out = []
    fields = {f for f in LinkProfile.__dataclass_fields__}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        try:
            ends, settings = entry.split(":", 1)
            src, dst = (x.strip() for x in ends.split("->"))
            for who in (src, dst):
                if who != "*":
                    WorkerId.parse(who)
            values = {}
            for item in (i.strip() for i in settings.split(",") if i.strip()):
                key, value = (x.strip() for x in item.split("="))
                if key not in fields:
                    raise ValueError(f"unknown key {key!r}; allowed: {sorted(fields)}")
                values[key] = float(value)
        except ValueError as err:
            raise ValueError(f"links.overrides entry {entry!r}: {err} (form: 'r0s1->r1s1: "
                             "bandwidth_mbit=50, latency_ms=80')") from None
        out.append((src, dst, values))
    return out


def build_network(link: LinkProfile, links: LinksConfig, mesh, seed: int) -> Network:
    """The run's links: the default profile, per-axis profiles, then the per-link overrides."""
    def axis(bw: float, lat: float) -> LinkProfile:
        return replace(link, bandwidth_mbit=bw if bw > 0 else link.bandwidth_mbit,
                       latency_ms=lat if lat >= 0 else link.latency_ms)

    axes = {"pp": axis(links.pp_bandwidth_mbit, links.pp_latency_ms),
            "dp": axis(links.dp_bandwidth_mbit, links.dp_latency_ms)}
    overrides: dict[tuple[WorkerId, WorkerId], LinkProfile] = {}
    rules = parse_overrides(links.overrides)
    if rules:
        for a in mesh.workers():
            for b in mesh.workers():
                if a == b:
                    continue
                # every pair, not only the mesh's links: a re-paired elastic row and the global
                # clip's norms (every process to every other) cross the others too
                profile = axes[_axis(a, b)]
                hit = False
                for src, dst, values in rules:
                    if src in ("*", str(a)) and dst in ("*", str(b)):
                        profile, hit = replace(profile, **values), True
                if hit:
                    overrides[(a, b)] = profile
    return Network(link, seed=seed, overrides=overrides, axes=axes, access=links.access)


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


def build_run_network(cfg) -> Network:
    """The links of run ``cfg`` (a RunConfig): ``link.*``, the per-axis profiles and per-link
    overrides of ``links.*``."""
    return build_network(cfg.link, cfg.links, MeshShape(cfg.mesh.replicas, cfg.mesh.stages), cfg.seed)
