"""The wire form of a boundary message, as the verifier reads and rewrites it.

A compressing codec (subspace, lowrank) puts k coefficients per token on the wire; ``view = auto``
verifies those directly, so the verifier never needs the full-width tensor. Other codecs are decoded
with the verifier's own (trusted) codec instance.
"""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Codec, Encoded, Kind, MessageContext


def reads_coefficients(payload: Encoded, view: str) -> bool:
    """Compressing codecs put k-dim coefficients on the wire; ``auto`` verifies those directly."""
    return view == "auto" and "coeffs" in payload.tensors


def wire_values(payload: Encoded, kind: Kind, codec: Codec, view: str,
                ctx: MessageContext | None = None) -> torch.Tensor:
    """The message as the verifier reads it: (b, n, c) values — coefficients or decoded (``ctx``:
    the message's context, ``Message.context()``, for codecs that need one)."""
    if reads_coefficients(payload, view):
        return payload.tensors["coeffs"].float()
    return codec.decode(payload, kind, ctx).float()


def wire_payload(values: torch.Tensor, template: Encoded, kind: Kind, codec: Codec,
                 view: str, ctx: MessageContext | None = None) -> Encoded:
    """A replacement message built from verifier-side values, in the template's wire format."""
    if reads_coefficients(template, view):
        coeffs = template.tensors["coeffs"]
        tensors = template.tensors | {"coeffs": values.to(coeffs.dtype).reshape(coeffs.shape)}
        return Encoded(tensors, template.shape, template.dtype, dict(template.meta))
    return codec.encode(values.reshape(template.shape).to(template.dtype), kind,
                        template.tensors.get("ids"), ctx)
