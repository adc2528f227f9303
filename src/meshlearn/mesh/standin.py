"""The stand-in for a pipeline message its receiver refused without a header to read.

A receiver that refuses a message must still fill its slot, or it waits for it forever. The
receiver's guard (``compress.wire_checks.WireGuard.admit``) fills it with a quarantined stand-in
built from the refused message's header. Bytes that never became a message (a frame beyond the
run's bound, bytes that do not decode, ``distributed.transport.Forged``) have no header: their
slot comes from the link's arrival count instead, and ``stand_in`` builds the same stand-in there.
The verifier (``distributed/verifier.py``) and a worker's driver (``distributed/driver.py``) both
call it, so a refusal means the same in every runtime and in the simulator: zeros in the
receiver's own wire format, marked ``skip``, with a ``Rejection`` record naming the link's sender.
"""

from __future__ import annotations

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.wire_checks import WireGuard
from meshlearn.mesh.messages import Message, carried_kind
from meshlearn.mesh.schedule import send_order
from meshlearn.mesh.topology import WorkerId

Link = tuple[WorkerId, WorkerId]


def slot_microbatch(schedule: str, link: Link, stages: int, microbatches: int, n: int) -> int:
    """The microbatch of the ``n``-th message of a step on ``link``: every schedule sends a link's
    messages step by step, in its sending action's order (``send_order``)."""
    src, dst = link
    action = "F" if carried_kind(src, dst) == "act" else "B"
    return send_order(schedule, src.stage, stages, action, microbatches)[n % microbatches]


def stand_in(guard: WireGuard, link: Link, step: int, microbatch: int, microbatch_size: int,
             ctx: MessageContext | None, reason: str) -> Message:
    """The quarantined stand-in for the message of ``link``'s slot (``step``, ``microbatch``) that
    was refused for ``reason``, its record appended to ``guard.rejections``. ``ctx``: the
    receiver's own context of that message (the codec's; None: codecs that need none)."""
    src, dst = link
    kind = carried_kind(src, dst)
    payload = guard.refuse(kind, step, microbatch, src, dst, guard.shape(microbatch_size), ctx, reason)
    return Message(kind, step, microbatch, src, dst, payload, skip=True, link=link)
