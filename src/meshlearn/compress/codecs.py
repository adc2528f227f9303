"""Boundary codecs: what crosses a pipeline boundary, and exactly how many bytes it costs.

A codec turns a tensor (activations going forward, or their gradients going back) into an
``Encoded`` message: a dict of plain tensors that is exactly what a driver puts on the wire. Wire
bytes are counted from those tensors, never estimated, so a compression claim is a measured ratio.
Message headers (step, microbatch, shape) are a few dozen bytes per message and are not counted.

Both ends are told which message they code (``MessageContext``: step, microbatch, boundary,
replica, training or evaluation, the receiving worker's device). A codec whose wire format depends
on the message (the mask codec regenerates its mask from those fields on both sides, so no indices
travel) reads it; the others ignore it except for where their output lives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

Kind = Literal["act", "grad"]


@dataclass(frozen=True)
class MessageContext:
    """Which message a codec codes, known to its sender and its receiver without being sent.

    ``step`` (0-based) and ``microbatch`` (0..M-1 within the step) name the microbatch,
    ``boundary`` is the pipeline boundary s (between stages s and s+1; an activation and its
    gradient cross the same one) and ``replica`` the pipeline it runs in. ``training`` is False for
    evaluation passes (codecs that drop information for training, such as the mask codec, send
    everything then). ``device`` is where the decoded tensor must live: the receiving worker's
    (None: wherever the payload is).
    """

    step: int
    microbatch: int
    boundary: int
    replica: int = 0
    training: bool = True
    device: torch.device | None = None

    @classmethod
    def evaluation(cls, boundary: int, device: torch.device | None = None) -> MessageContext:
        """An evaluation pass at ``boundary`` (step and microbatch do not matter there)."""
        return cls(step=-1, microbatch=0, boundary=boundary, training=False, device=device)


def place(x: torch.Tensor, ctx: MessageContext | None) -> torch.Tensor:
    """``x`` on the context's device (a no-op without one, or when it is there already)."""
    return x if ctx is None or ctx.device is None else x.to(ctx.device)


@dataclass
class Encoded:
    """A codec's output: the tensors that travel, plus the shape and dtype to rebuild."""

    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def wire_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class SizedEncoded(Encoded):
    """A cost-only message's payload (``meshlearn plan``, ``dp/cost.py``), sent many times: its wire
    size is counted once."""

    @functools.cached_property
    def wire_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Codec(Protocol):
    """Encode on the sender, decode on the receiver; both directions of a boundary use one codec
    (``DirectionalCodec``, ``codec.backward``: one per direction, behind this same interface).

    ``kind`` says which direction: ``act`` (forward activations) or ``grad`` (their gradients).
    ``ids`` are the microbatch's token ids (B, T); a codec that needs them downstream (the subspace
    codec re-adds the fixed token table) puts them in the message and pays for their bytes.
    ``ctx`` names the message (``MessageContext``); both ends pass the same one. A codec that needs
    it raises without it; decoded tensors land on ``ctx.device``.
    """

    name: str

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded: ...

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor: ...


class IdentityCodec:
    """Sends the fp32 tensor unchanged: the exact baseline every other codec is measured against."""

    name = "identity"

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        return Encoded({"values": x.detach().clone()}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        return place(message.tensors["values"].clone(), ctx)


class CastCodec:
    """Casts to a 16-bit float on the wire (2× fewer bytes than fp32, lossy in the low bits)."""

    def __init__(self, wire_dtype: torch.dtype):
        self.wire_dtype = wire_dtype
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[wire_dtype]

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        return Encoded({"values": x.detach().to(self.wire_dtype)}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        return place(message.tensors["values"].to(message.dtype), ctx)


class Int8RowCodec:
    """Symmetric int8 quantization with one fp32 scale per row (per token vector).

    A row is the last dimension, so each token's d values share a scale: d + 4 bytes per token
    instead of 4·d. Rounding error per value is at most half a step, |max| / 254.
    """

    name = "int8"

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
        q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
        return Encoded({"q": q, "scale": scale.squeeze(1)}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        q, scale = message.tensors["q"], message.tensors["scale"]
        rows = q.float() * scale.unsqueeze(1)
        return place(rows.reshape(message.shape).to(message.dtype), ctx)
