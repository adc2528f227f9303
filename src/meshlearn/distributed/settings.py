"""Settings of real multi-process runs, and the deadlines derived from them and the link profile.

Kept free of torch.distributed so the config tree can import it. Every wait on another process
in ``meshlearn.distributed`` uses one of these deadlines; none is a guessed constant: each is the time the
link model says the traffic needs, plus a compute slack the user sets (and can tune from the error
message that names it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from meshlearn.mesh.network import LinkProfile, ring_allreduce_s

Backend = Literal["sim", "dist"]
"""The top-level ``backend``: the simulator or real processes."""


@dataclass(frozen=True)
class DistConfig:
    """The distributed runtime (``backend = "dist"``). Config keys under ``dist.``."""

    comm: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: gloo (CPU tensors), nccl (one GPU per process), or auto (nccl when
    CUDA is available, else gloo)."""
    shaping: Literal["sender", "none"] = "sender"
    """``sender``: every sender paces its messages to its link's profile (token bucket for the
    bandwidth, delivery held back by the latency), so one machine emulates the WAN of ``link.*``.
    ``none``: send at the speed of the real network (a real WAN, or namespaces shaped by tc)."""
    links: Literal["auto", "collective", "tcp"] = "auto"
    """What carries the point-to-point links (pipeline, message-based DP, anchor circuit):
    ``collective``: send/recv on two-rank process groups (gloo or NCCL); ``tcp``: framed TCP
    streams of our own (distributed/streams.py), where the receiver refuses a frame beyond the
    run's message bound before allocating it, and the link stays up — under gloo, a peer sending
    more bytes than the receive it meets kills the receiving process; ``auto``: tcp when the mesh
    is untrusted (verify.name = "sentinel": every link to and from the verifier), else collective
    (NCCL keeps GPU tensors off the host). Elastic runs under ``elastic.membership = "torchft"``
    link their rows over gloo pair groups (collective) whatever this says: tcp is refused there;
    under ``"control"`` rows always link over framed streams. With untrusted links
    (``trusted_links``) ``auto`` is tcp and ``collective`` is refused."""
    trusted_links: Literal["auto", "true", "false"] = "auto"
    """Whether the run may use process groups (gloo/NCCL), where a peer's malformed or oversized
    send aborts the receiving process, and every group opens a listening port of its own.
    ``true``: the DP all-reduce, the per-step gather, barriers and the validation broadcast are
    process-group collectives (the default on one machine). ``false``: no process group in any
    process of the run; those collectives run over framed TCP streams (distributed/collectives.py)
    that refuse a frame of any size but the one expected before allocating it, and the
    point-to-point links are tcp (``dist.links = collective`` is refused). ``auto``: false in a
    ``[cluster]`` run and with a verifier (verify.name = "sentinel"), true otherwise, and true
    wherever ``dist.links = collective`` says the links are trusted or the run is elastic
    (torchft owns the DP axis there; ``false`` is refused with elastic membership ``torchft``;
    membership ``control`` uses no process group, and in a ``[cluster]`` run its control service
    accepts process groups' keys only with ``true``). Written as a string: ``trusted_links = "false"``."""
    timeout_s: float = 60.0
    """Compute slack in every deadline, in seconds: the longest a worker may compute before it
    sends what a peer waits for. The links' transfer time is added automatically. If a run stops
    with "no activation ... within", raise it (large models, slow devices)."""
    heartbeat_s: float = 1.0
    """Seconds between the liveness beats every process writes to the rendezvous store."""
    dead_after_s: float = 10.0
    """A worker whose beats stop for this long (plus a round trip of the link) is declared dead,
    and every process stops with its name. Lower it to fail faster; raise it if healthy workers
    are declared dead (an overloaded host, a store far away)."""
    init_timeout_s: float = 300.0
    """Seconds for all processes to join at start-up (imports, corpus and model building)."""
    threads: int = 0
    """torch threads per worker process; 0 = this machine's cores shared by its local workers."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in ``checkpoints/`` (older ones are deleted); at least 1."""


@dataclass(frozen=True)
class Deadlines:
    """Seconds each kind of wait may last before the run stops with an error naming the peer."""

    message_s: float  # from the moment a worker needs a pipeline message until it arrives
    collective_s: float  # a data-parallel all-reduce, or the per-step gather of losses and norms
    dead_after_s: float  # silence of a worker's heartbeat that declares it dead
    init_s: float  # joining the process group, building groups


def derive_deadlines(dist: DistConfig, link: LinkProfile, message_bytes: int, messages_per_step: int,
                     grad_bytes: int, replicas: int, allgather: bool = False) -> Deadlines:
    """Deadlines from the link profile: the traffic's modelled time, doubled, plus the compute slack.

    ``message_bytes`` is the size of one boundary message in fp32 (codecs only shrink it). A
    message may queue behind a whole step of traffic on its link, so the wait allows for all of it.
    ``allgather``: the DP sum sends the whole gradients to each other replica (framed collectives,
    untrusted links), (D − 1)× one link's worth when the sender's uplink carries them all, where a
    ring sends 2(D − 1)/D of them.
    """
    per_message = link.serialization_s(message_bytes) / (1.0 - link.loss_rate)
    per_message += link.latency_s + link.jitter_ms / 1000.0
    transfer = messages_per_step * per_message
    dp_sum = ring_allreduce_s(grad_bytes, replicas, link)
    if allgather and replicas > 1:
        dp_sum = max(dp_sum, (replicas - 1) * link.serialization_s(grad_bytes) + link.latency_s)
    allreduce = dp_sum / (1.0 - link.loss_rate)
    round_trip = 2.0 * (link.latency_s + link.jitter_ms / 1000.0)
    return Deadlines(
        message_s=dist.timeout_s + 2.0 * transfer,
        collective_s=dist.timeout_s + 2.0 * (transfer + allreduce),
        dead_after_s=dist.dead_after_s + round_trip,
        init_s=dist.init_timeout_s,
    )


def links_of(cfg) -> str:
    """What carries this run's point-to-point links: ``dist.links`` with ``auto`` resolved."""
    if cfg.dist.links != "auto":
        return cfg.dist.links
    verified = cfg.verify.name == "sentinel" and not cfg.elastic.enabled
    return "tcp" if verified or not links_trusted(cfg) else "collective"


def links_trusted(cfg) -> bool:
    """``dist.trusted_links`` with ``auto`` resolved: whether this run may use process groups."""
    if cfg.dist.trusted_links != "auto":
        return cfg.dist.trusted_links == "true"
    if cfg.elastic.enabled or cfg.dist.links == "collective":
        return True
    return not (cfg.cluster.enabled or cfg.verify.name == "sentinel")


def validate_dist(cfg, require) -> None:
    """Checks of ``dist.*`` run by ``config.validate`` beyond their choices (``Literal`` fields the
    loader checks); ``cfg`` is the RunConfig, ``require(ok, key, value, allowed)`` raises the
    ConfigError."""
    dist = cfg.dist
    untrusted = dist.trusted_links == "false"
    require(not untrusted or dist.links != "collective", "dist.links", dist.links,
            "must be 'auto' or 'tcp' with dist.trusted_links = 'false' (collective links are process groups)")
    for key, value in [("dist.timeout_s", dist.timeout_s), ("dist.heartbeat_s", dist.heartbeat_s),
                       ("dist.dead_after_s", dist.dead_after_s),
                       ("dist.init_timeout_s", dist.init_timeout_s)]:
        require(value > 0 and math.isfinite(value), key, value, "must be a finite number of seconds > 0")
    require(dist.dead_after_s >= 2 * dist.heartbeat_s, "dist.dead_after_s", dist.dead_after_s,
            f"must be at least two heartbeats (2 × dist.heartbeat_s = {2 * dist.heartbeat_s})")
    require(dist.threads >= 0, "dist.threads", dist.threads, "must be >= 0 (0 = automatic)")
    require(dist.keep_checkpoints >= 1, "dist.keep_checkpoints", dist.keep_checkpoints, "must be >= 1")
