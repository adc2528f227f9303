"""The random-mask codec: a pseudo-random subset of each token's channels crosses the boundary.

Method note ``mesh_adaptation.md`` (arXiv 2609.14339). At a boundary the receiver gets h̃ = h ⊙ m
with m ∈ {0, 1}^{B×T×d}; only the kept values travel, in ``codec.wire_dtype``, and no indices: both
ends derive m from a key they already share,

    key = key32(codec.seed, step, microbatch, boundary, replica),
    u[b, t, c] = PRF(key, row b, position t, channel c)        (compress/prf.py, counter-based)

so m depends on which message it is, never on the values (top-k or value-dependent masks are
biased, and the method has no error feedback to remove the bias). The microbatch is in the key, so
no mask is reused across microbatches; the replica is too, so data-parallel replicas average
independent masking noise.

Forms (``codec.mask``):

- ``fixed`` (default): per token exactly K = round(keep · d) channels, those with the K smallest u,
  sent in channel order. Every message costs B·T·K·(wire dtype size) bytes: an exact byte budget.
- ``bernoulli``: each channel kept independently when u < keep · 2³²; the count varies per
  message (within a few σ of keep · d per token), so the wire guard derives each message's layout
  from its own context (``per_message_layout``).

The mask is part of the autograd graph. The gradient goes back through the same boundary with the
same context, so the receiver sends only the kept entries of ∂L/∂h̃ and the sender scatters them:
∂L/∂h = m ⊙ ∂L/∂h̃, exactly the backward of h ↦ h ⊙ m (``mask`` gives m for an unsplit oracle).

No rescaling by default (1/keep destabilized bf16 training at keep = 0.05 in the paper); with
``codec.rescale`` both directions are multiplied by d/K (fixed) or 1/keep (Bernoulli), which makes
E[h̃] = h. Evaluation passes (``MessageContext.training`` False) send every value: masking is off.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, get_args

import torch

from meshlearn.compress.codecs import Encoded, Kind, MessageContext, place
from meshlearn.compress.prf import grid32, key32

MaskForm = Literal["fixed", "bernoulli"]
MASK_FORMS: tuple[str, ...] = get_args(MaskForm)
CACHE_ENTRIES = 64
"""Masks a codec keeps. A stage derives each mask twice (its forward's activation, then its
backward's gradient over the same boundary); between the two lie at most ``in_flight`` other
microbatches, each with two masks (the boundary above and the one below), so 64 covers an
in-flight depth of 32. Fixed-form entries are int16 channel lists (B·T·K·2 bytes)."""


def kept_channels(keep: float, d_model: int) -> int:
    """The fixed form's K = round(keep · d) (half-way cases round to even, as Python's round)."""
    return round(keep * d_model)


class MaskCodec:
    """Send a pseudo-random ``keep`` fraction of each token's channels; see the module docstring.

    Usage (both ends build the same codec and pass the same context)::

        codec = MaskCodec(d_model=576, keep=0.05)
        ctx = MessageContext(step=t, microbatch=m, boundary=s, replica=r)
        message = codec.encode(h, "act", ctx=ctx)  # (B, T, 29) bf16 values, nothing else
        h_masked = codec.decode(message, "act", ctx=ctx)  # h ⊙ m, zeros elsewhere
    """

    name = "mask"

    def __init__(self, d_model: int, keep: float, form: MaskForm = "fixed", seed: int = 0,
                 wire_dtype: torch.dtype = torch.bfloat16, rescale: bool = False):
        if form not in MASK_FORMS:
            raise ValueError(f"mask codec: form {form!r} is unknown; allowed: {list(MASK_FORMS)}")
        if not 0 < keep <= 1:
            raise ValueError(f"mask codec: keep = {keep} must be in (0, 1]")
        self.d_model = d_model
        self.keep = keep
        self.form = form
        self.seed = seed
        self.wire_dtype = wire_dtype
        self.kept = kept_channels(keep, d_model)
        if form == "fixed" and self.kept < 1:
            raise ValueError(f"mask codec: keep = {keep} keeps round({keep} * {d_model}) = 0 channels")
        self.threshold = round(keep * 2**32)  # Bernoulli: kept when u < threshold
        self.scale = (d_model / self.kept if form == "fixed" else 1.0 / keep) if rescale else 1.0
        # The wire guard reads this: a Bernoulli message's size depends on its own mask.
        self.per_message_layout = form == "bernoulli"
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    # --- the mask ----------------------------------------------------------------------------

    def key(self, ctx: MessageContext) -> int:
        """The 32-bit key of one message's mask (the direction is not in it: an activation and
        its gradient share their mask)."""
        return key32(self.seed, ctx.step, ctx.microbatch, ctx.boundary, ctx.replica)

    def channels(self, shape: tuple[int, ...], ctx: MessageContext,
                 device: torch.device | None = None) -> torch.Tensor:
        """Fixed form: the kept channels of every token, int64 (B, T, K), ascending per token."""
        def derive() -> torch.Tensor:
            u = grid32(self.key(ctx), self._shape(shape), device)
            kept = u.topk(self.kept, dim=-1, largest=False, sorted=False).indices.sort(dim=-1).values
            return kept.to(torch.int16) if self.d_model <= 2**15 else kept

        return self._cached("channels", shape, ctx, device, derive).long()

    def mask(self, shape: tuple[int, ...], ctx: MessageContext,
             device: torch.device | None = None) -> torch.Tensor:
        """m as a bool tensor of ``shape`` (B, T, d): True where a value crosses the boundary
        (the Bernoulli form returns its cached tensor: read it, do not modify it)."""
        if self.form == "bernoulli":
            return self._cached("mask", shape, ctx, device, lambda: grid32(
                self.key(ctx), self._shape(shape), device) < self.threshold)
        out = torch.zeros(shape, dtype=torch.bool, device=device)
        return out.scatter_(-1, self.channels(shape, ctx, device), True)

    def _cached(self, what: str, shape: tuple[int, ...], ctx: MessageContext,
                device: torch.device | None, derive) -> torch.Tensor:
        """A mask is a pure function of (key, shape): derived once, reused by the later
        encode/decode of the same message (least recently used entries go first)."""
        entry = (what, self.key(ctx), tuple(shape), str(torch.device("cpu") if device is None else device))
        if entry in self._cache:
            self._cache.move_to_end(entry)
            return self._cache[entry]
        value = self._cache[entry] = derive()
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return value

    def _shape(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        if len(shape) != 3 or shape[-1] != self.d_model:
            raise ValueError(f"mask codec: expected a (rows, positions, {self.d_model}) boundary "
                             f"tensor, got shape {tuple(shape)}")
        return tuple(shape)

    # --- the codec ---------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        x = x.detach()
        if not self._masking(ctx):
            return Encoded({"values": x.to(self.wire_dtype)}, tuple(x.shape), x.dtype)
        if self.form == "fixed":
            values = x.gather(-1, self.channels(tuple(x.shape), ctx, x.device))  # (B, T, K)
        else:
            values = x[self.mask(tuple(x.shape), ctx, x.device)]  # (kept,), row-major order
        return Encoded({"values": values.to(self.wire_dtype)}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        values = place(message.tensors["values"], ctx).to(message.dtype)
        if not self._masking(ctx):
            return values
        shape = tuple(message.shape)
        out = torch.zeros(shape, dtype=message.dtype, device=values.device)
        if self.form == "fixed":
            out.scatter_(-1, self.channels(shape, ctx, values.device), values)
        else:
            out[self.mask(shape, ctx, values.device)] = values
        return out * self.scale if self.scale != 1.0 else out

    def _masking(self, ctx: MessageContext | None) -> bool:
        if ctx is None:
            raise ValueError("mask codec: every message needs its MessageContext (step, microbatch, "
                             "boundary): both ends derive the mask from it")
        return ctx.training
