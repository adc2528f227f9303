"""The simulator's events, typed: what happens to whom at a point of virtual time.

``SimDriver`` keeps one queue of ``(time, sequence, event)``; the sequence breaks ties in the order
events were pushed, so an event itself is never compared. Each type names its payload instead of a
string kind and a tuple whose shape the reader had to know.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId


@dataclass(frozen=True)
class ComputeDone:
    """``worker``'s compute (a forward, a backward or an update) ended; it sends ``outgoing``."""

    worker: WorkerId
    outgoing: tuple[Message, ...] = ()


@dataclass(frozen=True)
class UpdateComputed:
    """``worker``'s optimizer step ended: its update goes on (a strategy's "post" rounds) or ends."""

    worker: WorkerId


@dataclass(frozen=True)
class RoundDeadline:
    """A DP round ``worker`` waits for is due at ``until``: past it, the round is dropped."""

    worker: WorkerId
    until: float


@dataclass(frozen=True)
class Arrival:
    """``message`` leaves its link: the receiver's guard and any monitors see it next."""

    message: Message


@dataclass(frozen=True)
class Delivery:
    """``message`` leaves the network (and any verifier) for its receiver."""

    message: Message


SimEvent = ComputeDone | UpdateComputed | RoundDeadline | Arrival | Delivery
