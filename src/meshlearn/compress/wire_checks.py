"""Receiver-side checks of what a peer put on the wire: a forged message is rejected, never decoded.

Every codec's ``decode`` trusts its input. The subspace codec indexes its token table with the ids it
is sent, top-k scatters into the positions it is sent, int8 reshapes to the header's shape, and a
worker refuses (raises on) a message whose step is not its own. A lying peer controls all of these,
so one forged message could crash the receiver. The checks here run before anything decodes:

- ``check_payload`` (pure): the payload against the layout an honest sender using the receiver's own
  codec would produce (``payload_layout``: field names, per-field shapes and dtypes, codec meta such
  as the subspace version), the byte budget, finite floats and index ranges. None or a one-line
  reason.
- ``check_header`` (pure): step, direction and microbatch against what the receiver expects.
- ``WireGuard``: one receiver's gate. A rejected message becomes a quarantined one (honest zeros in
  the receiver's own wire format, marked ``skip``, exactly as SENTINEL quarantines a flagged
  message), and a ``Rejection`` record is kept for the run's logs.

Every worker has a guard (``Worker.guard``); drivers pass each arriving message through
``Worker.admit`` before any monitor (a verifier, which decodes peer data too) or the worker sees it.

Honest payloads of every codec here have a size fixed by the shape, so the default byte budget is
exactly the honest size: anything larger is an oversized message (checked first, as a real receiver
would check a length prefix before reading the body).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshlearn.compress.codecs import Codec, Encoded, Kind, MessageContext

if TYPE_CHECKING:  # mesh imports compress: only type hints come back the other way
    from meshlearn.mesh.messages import Message
    from meshlearn.mesh.topology import WorkerId

KINDS: tuple[Kind, ...] = ("act", "grad")
INDEX_FIELDS = ("ids", "index")
"""Integer fields a decoder indexes with: token ids (subspace; bound: the vocabulary) and per-token
positions (top-k; bound: the last dimension of the shape)."""


@dataclass(frozen=True)
class Layout:
    """What an honest payload of one codec, direction and shape looks like on the wire."""

    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]]
    meta: dict[str, int | float | str]

    @property
    def wire_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.fields.values())


def payload_layout(codec: Codec, kind: Kind, shape: tuple[int, ...],
                   dtype: torch.dtype = torch.float32, ctx: MessageContext | None = None) -> Layout:
    """The layout of an honest payload, read off an encoding of zeros by the receiver's own codec,
    for the message ``ctx`` names (a codec that needs a context gets a training message at step 0,
    microbatch 0, boundary 0 without one: its layout, like every fixed-size codec's, is the same
    for every message).

    Deriving it from the codec (rather than a table per codec) keeps every codec, present or future,
    covered by the same checks.
    """
    ids = torch.zeros(shape[:-1], dtype=torch.long) if kind == "act" else None
    ctx = MessageContext(0, 0, 0) if ctx is None else dataclasses.replace(ctx, device=None)
    template = codec.encode(torch.zeros(shape, dtype=dtype), kind, ids, ctx)
    fields = {name: (tuple(t.shape), t.dtype) for name, t in template.tensors.items()}
    return Layout(kind, tuple(template.shape), template.dtype, fields, dict(template.meta))


def index_bound(name: str, layout: Layout, vocab_size: int) -> int:
    """The exclusive upper bound of an index field's values."""
    return vocab_size if name == "ids" else layout.shape[-1]


def check_payload(payload: Encoded, layout: Layout, vocab_size: int, max_bytes: int) -> str | None:
    """None if ``payload`` is what an honest sender could have sent, else the first reason it is not.

    ``layout`` carries the expected direction, shape and dtype (``payload_layout``), ``vocab_size``
    bounds token ids, ``max_bytes`` is the byte budget. Pure: no state, no decoding.
    """
    if not isinstance(payload, Encoded) or not isinstance(payload.tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in payload.tensors.values()):
        return "malformed: not an Encoded payload of tensors"
    if payload.wire_bytes > max_bytes:
        return f"oversized: {payload.wire_bytes} bytes, budget {max_bytes}"
    if tuple(payload.shape) != layout.shape:
        return f"shape: header {tuple(payload.shape)}, expected {layout.shape}"
    if payload.dtype != layout.dtype:
        return f"dtype: header {payload.dtype}, expected {layout.dtype}"
    names, expected = set(payload.tensors), set(layout.fields)
    if names != expected:
        return (f"fields: {sorted(names)}, expected {sorted(expected)} "
                f"(unexpected {sorted(names - expected)}, missing {sorted(expected - names)})")
    for name, t in payload.tensors.items():
        shape, dtype = layout.fields[name]
        if tuple(t.shape) != shape:
            return f"shape: {name} is {tuple(t.shape)}, expected {shape}"
        if t.dtype != dtype:
            return f"dtype: {name} is {t.dtype}, expected {dtype}"
    for key, value in layout.meta.items():
        if payload.meta.get(key) != value:
            return f"meta: {key} = {payload.meta.get(key)!r}, expected {value!r}"
    for name, t in payload.tensors.items():
        if t.is_floating_point():
            bad = t.numel() - int(torch.isfinite(t).sum())
            if bad:
                return f"nonfinite: {name} has {bad} non-finite values"
    for name in INDEX_FIELDS:
        t = payload.tensors.get(name)
        if t is not None and t.numel():
            low, high, bound = int(t.min()), int(t.max()), index_bound(name, layout, vocab_size)
            if low < 0 or high >= bound:
                return f"index: {name} in [{low}, {high}], allowed [0, {bound})"
    return None


def check_header(message: Message, step: int, microbatches: Collection[int],
                 sender: WorkerId | None = None, carries: Kind | None = None) -> str | None:
    """None if the message belongs to the receiver's current step and one of its microbatches, and
    (given the link it came on: ``sender``, the worker it comes from, and ``carries``, the kind it
    carries) names that worker as its source and is of that kind."""
    if message.kind not in KINDS:
        return f"kind: {message.kind!r}, expected one of {list(KINDS)}"
    if sender is not None and message.src != sender:
        return f"route: claims to come from {message.src}, sent by {sender}"
    if carries is not None and message.kind != carries:
        return f"route: a {message.kind!r} on a link that carries {carries!r}"
    if message.step != step:
        return f"stale step: message for step {message.step}, receiver at step {step}"
    if message.microbatch not in microbatches:
        return f"microbatch: {message.microbatch} is not one of this step's {sorted(microbatches)}"
    return None


@dataclass(frozen=True)
class Rejection:
    """One message a receiver refused; ``step`` is the receiver's (0-based, like ``Message.step``)."""

    step: int
    kind: Kind
    microbatch: int
    src: WorkerId
    dst: WorkerId
    reason: str

    def record(self) -> dict:
        """JSON-ready, with the 1-based step of metrics.jsonl."""
        return {"kind": "wire_reject", "step": self.step + 1, "microbatch": self.microbatch,
                "message": self.kind, "src": str(self.src), "dst": str(self.dst), "reason": self.reason}


class WireGuard:
    """One receiver's gate: every arriving message is checked before anything decodes it.

    ``codec`` is the receiver's own (trusted) codec; ``seq_len``, ``d_model`` and ``vocab_size`` come
    from the model config. ``byte_slack`` scales the budget over the honest size (1.0: exact, right for
    every codec here: their sizes depend on the shape only, or, for a codec with
    ``per_message_layout`` (the Bernoulli mask), on the message's own context, which the receiver
    knows). Usage::

        guard = WireGuard(worker.codec, cfg.model.seq_len, cfg.model.d_model, cfg.model.vocab_size)
        message = guard.admit(message, work.step, work.microbatch_size, microbatches, context)
        ...
        records = [r.record() for r in guard.pop_rejections()]  # one per refused message
    """

    def __init__(self, codec: Codec, seq_len: int, d_model: int, vocab_size: int,
                 byte_slack: float = 1.0):
        self.codec = codec
        self.seq_len = seq_len
        self.d_model = d_model
        self.vocab_size = vocab_size
        self.byte_slack = byte_slack
        self.layouts: dict[tuple, Layout] = {}
        self.rejections: list[Rejection] = []

    def shape(self, microbatch_size: int) -> tuple[int, ...]:
        """Activations and their gradients share one (b, n, d) shape at every boundary."""
        return (microbatch_size, self.seq_len, self.d_model)

    def layout(self, kind: Kind, shape: tuple[int, ...], ctx: MessageContext | None = None) -> Layout:
        if getattr(self.codec, "per_message_layout", False):
            return payload_layout(self.codec, kind, shape, ctx=ctx)  # its own mask decides its size
        # A codec with a version tag (the subspace codec after a basis update) changes its meta:
        # the cached layout follows it.
        key = (kind, shape, getattr(self.codec, "version", None))
        if key not in self.layouts:
            self.layouts[key] = payload_layout(self.codec, kind, shape, ctx=ctx)
        return self.layouts[key]

    def check(self, message: Message, step: int, microbatch_size: int,
              microbatches: Collection[int], ctx: MessageContext | None = None,
              sender: WorkerId | None = None, carries: Kind | None = None) -> str | None:
        reason = check_header(message, step, microbatches, sender, carries)
        if reason is not None:
            return reason
        layout = self.layout(message.kind, self.shape(microbatch_size), ctx)
        return check_payload(message.payload, layout, self.vocab_size,
                             math.ceil(layout.wire_bytes * self.byte_slack))

    def admit(self, message: Message, step: int, microbatch_size: int,
              microbatches: Collection[int],
              context: Callable[[Kind, int, int], MessageContext] | None = None,
              sender: WorkerId | None = None, carries: Kind | None = None,
              microbatch: int | None = None) -> Message:
        """The message itself if it passes; else a quarantined stand-in for its (kind, microbatch).

        ``context(kind, step, microbatch)`` is the receiver's own context of such a message (its
        codec's; None: codecs that need none). The payload is checked against the layout of the
        receiver's step, so a message from another step is refused before its layout matters.
        ``sender`` and ``carries``: the link the message came on (the worker it comes from, the
        kind it carries); a header naming another sender or kind is refused (receivers route by the
        link, never by the header), the record names the sender and the stand-in is of the link's
        kind (the one its receiver waits for). ``microbatch``: the one the receiver knows the message
        is for (where it arrived; pass ``microbatches = (microbatch,)`` too), which its stand-in
        takes whatever the header says (None: the header's).

        The stand-in carries the receiver's step and honest zeros: a zero activation whose
        microbatch the last stage then weighs 0 (``skip``), or a zero gradient — what an honest
        pipeline sends back for a zero-weight microbatch. Without a stand-in the receiver would wait
        for the slot forever.
        """
        kind: Kind = carries or (message.kind if message.kind in KINDS else "act")
        m = message.microbatch if microbatch is None else microbatch
        ctx = context(kind, step, m) if context is not None else None
        reason = self.check(message, step, microbatch_size, microbatches, ctx, sender, carries)
        if reason is None:
            return message
        src = message.src if sender is None else sender
        payload = self.refuse(kind, step, m, src, message.dst, self.shape(microbatch_size), ctx, reason)
        return dataclasses.replace(message, kind=kind, step=step, microbatch=m, src=src, payload=payload,
                                   skip=True)

    def refuse(self, kind: Kind, step: int, microbatch: int, src: WorkerId, dst: WorkerId,
               shape: tuple[int, ...], ctx: MessageContext | None, reason: str) -> Encoded:
        """Record the refusal of ``src``'s ``kind`` message for (``step``, ``microbatch``) and
        return the stand-in's payload (``neutral``). The one place a refusal is recorded: ``admit``
        and ``mesh.standin.stand_in`` (a message refused before it had a header) both come here."""
        self.rejections.append(Rejection(step, kind, microbatch, src, dst, reason))
        return self.neutral(kind, shape, ctx)

    def neutral(self, kind: Kind, shape: tuple[int, ...], ctx: MessageContext | None = None) -> Encoded:
        """Zeros in the receiver's own wire format (token id 0 where the codec sends ids) for the
        message ``ctx`` names (as in ``payload_layout`` without one)."""
        ids = torch.zeros(shape[:-1], dtype=torch.long) if kind == "act" else None
        ctx = MessageContext(0, 0, 0) if ctx is None else dataclasses.replace(ctx, device=None)
        return self.codec.encode(torch.zeros(shape), kind, ids, ctx)

    def pop_rejections(self) -> list[Rejection]:
        rejections, self.rejections = self.rejections, []
        return rejections
