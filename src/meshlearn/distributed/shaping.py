"""In-process link shaping: a sender holds each message until its link model says it has arrived.

The arithmetic is the simulator's own ``Link`` (``mesh/network.py``): messages queue on the link
and leave it at the bandwidth, one after another (a token bucket whose burst is one message), and
each is delivered one latency (plus jitter, plus resends on loss) after its last byte left. The
sender thread sleeps until that delivery time and then hands the message to the real transport,
so on loopback the receiver sees it when a WAN would have delivered it, and the simulator and the
real run can be compared message for message. Jitter and loss draws use the same seeded stream
per link as the simulator.

Times inside ``Link`` are seconds since this process's ``epoch`` (a monotonic clock reading).

With ``links.access = "uplink"`` the links a driver builds from one network share their sender's
``Uplink``, so the Pacers of a worker's destinations are one queue (its access link): a message to
the next stage waits for the bytes already handed to its DP peers and to the previous stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from meshlearn.mesh.network import Link, ring_allreduce_bytes_per_member, ring_allreduce_s


class Pacer:
    """When the messages of one directed link may be handed to the transport."""

    def __init__(self, link: Link, epoch: float, enabled: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.link = link
        self.epoch = epoch
        self.enabled = enabled
        self.clock = clock  # injectable, so the arithmetic is testable without wall-clock tolerances

    def release_at(self, nbytes: int) -> float:
        """Queue ``nbytes`` now; the monotonic time at which the message counts as delivered.

        Bytes and busy time are accounted even when shaping is off, so reports compare.
        """
        now = self.clock()
        arrival = self.link.transmit(now - self.epoch, nbytes)
        return self.epoch + arrival if self.enabled else now


def allreduce_release_at(link: Link, epoch: float, started: float, nbytes: int, members: int,
                         enabled: bool) -> float:
    """A ring all-reduce whose last member joined at monotonic ``started`` counts as done at the
    returned time.

    The collective itself runs at loopback speed; its completion is held back to the ring model
    (2(D-1) rounds of a 1/D chunk plus a latency each) — the same model and byte accounting the
    simulator uses, so the data-parallel axis is shaped but not independently validated here (the
    network-namespace test, where tc shapes the real sockets, is what checks it).
    """
    seconds = ring_allreduce_s(nbytes, members, link.profile)
    sent = ring_allreduce_bytes_per_member(nbytes, members)
    if link.uplink is not None:  # the ring's sends queue behind what this worker has queued
        started = max(started, epoch + link.queue_free_at)
    link.occupy(started - epoch, link.profile.serialization_s(sent), sent)
    return started + seconds if enabled else time.monotonic()


def hold_until(when: float) -> None:
    """Sleep until monotonic time ``when`` (no-op if it has passed)."""
    delay = when - time.monotonic()
    if delay > 0:
        time.sleep(delay)
