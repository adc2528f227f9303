"""Messages between workers: what the drivers carry, and what verifiers and attacks will inspect."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from meshlearn.compress.codecs import Encoded, MessageContext
from meshlearn.mesh.topology import WorkerId

ANCHOR_KINDS = ("anchor_weights", "anchor_listen", "anchor_act", "anchor_grad", "anchor_share")


@dataclass
class Message:
    """A forward activation (``act``) or a backward gradient (``grad``) of one microbatch, or a
    data-parallel strategy's part of a round (``dp``, between replicas of one stage), or a control
    message sent at a drain point (``morph``: a protocol model's boundary transform), or one of the
    anchor circuit's under ``backend = dist`` (``ANCHOR_KINDS``: distributed/anchor.py).

    ``step`` and ``microbatch`` (0..M-1 within the step) name the microbatch; under the async
    schedule messages of several steps are in flight at once, so receivers key them by both. A
    ``dp`` message carries its round key there instead: (the update that started it, its phase)."""

    kind: Literal["act", "grad", "dp", "morph", "anchor_weights", "anchor_listen", "anchor_act",
                  "anchor_grad", "anchor_share"]
    step: int
    microbatch: int
    src: WorkerId
    dst: WorkerId
    payload: Encoded
    skip: bool = False  # the microbatch was quarantined upstream: not scored, zero loss weight
    version: int = 0  # the sender's weight version that produced it (its forward's, for a gradient)
    link: tuple[WorkerId, WorkerId] | None = None
    """The (sender, receiver) link it crossed, set by the driver that carried it — never read off
    the header, which the sender controls; None until it is sent. Not on the wire."""
    arrival: tuple[int, int] | None = None
    """(step, n): where it arrived, set by the dist transport — the n-th message of the receive
    posted for training step ``step``, which says which microbatch it must be (``mesh/standin.py:
    slot_microbatch``). None: any other receive, or no transport. Not on the wire."""

    @property
    def wire_bytes(self) -> int:
        return self.payload.wire_bytes

    def context(self, device: torch.device | None = None) -> MessageContext:
        """What a codec is told about this boundary message (``act`` or ``grad``), read off its
        header: both directions of boundary s (stages s and s+1) share one context per microbatch."""
        return MessageContext(self.step, self.microbatch, min(self.src.stage, self.dst.stage),
                              self.src.replica, device=device)


def carried_kind(src: WorkerId, dst: WorkerId) -> Literal["act", "grad", "dp"]:
    """What the link ``src`` → ``dst`` carries: activations down a row's pipeline, gradients up
    it, a DP strategy's parts between the replicas of one stage. Receivers take a message's kind
    from its link, never from its header (the sender's claim). A pipeline link joins neighbouring
    stages, of one replica or (an elastic run's re-paired row, elastic/rows.py) of two."""
    if abs(src.stage - dst.stage) == 1:
        return "act" if src.stage < dst.stage else "grad"
    if src.stage == dst.stage and src.replica != dst.replica:
        return "dp"
    raise ValueError(f"no link runs from {src} to {dst}")


class MessageMonitor(Protocol):
    """Sees every message on arrival, before the receiving worker does (e.g. SENTINEL's verifiers).

    ``inspect`` returns the message to deliver: the same one, one with a replaced payload, or one
    marked ``skip``. A driver calls it in arrival order and never drops what it returns.
    """

    def inspect(self, message: Message) -> Message: ...


def charged_step(message: Message, steps_done: int) -> int:
    """The step a message's transfer counts in: its own, or for a ``dp`` message (which carries its
    round's key, not a step) the step its sender is in (``steps_done``)."""
    return steps_done if message.kind == "dp" else message.step
