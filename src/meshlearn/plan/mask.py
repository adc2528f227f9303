"""The mask codec's wire size on meta tensors, for the planner.

The mask codec (``codec.name = "mask"``, compress/mask.py) sends, per token and boundary, only the
kept entries of the activation and of its gradient, in the wire dtype, no indices. Its own
``encode`` needs a message context and computes the mask (a PRF over every entry), which a
cost-only run on the meta device cannot do, so ``MaskCostCodec`` puts a meta tensor of the codec's
own size on the wire — the fixed form's K = ``kept_channels(keep, d)``, the codec's rule, not a
second formula — and the simulator charges it like any codec's message. (The Bernoulli form's count
varies per message; its mean is the same K.)
"""

from __future__ import annotations

import functools

import torch

from meshlearn.compress.codecs import Encoded, Kind
from meshlearn.compress.mask import MaskCodec


@functools.lru_cache(maxsize=64)
def mask_wire_values(keep: float, d_model: int) -> int:
    """Values one token sends across a boundary, in each direction, at keep rate ``keep``: the
    codec's own K, after its own checks (a keep outside (0, 1], or one that keeps no channel of
    ``d_model``, is refused as the codec refuses it). Remembered: asked at every message."""
    return MaskCodec(d_model, keep).kept


class MaskCostCodec:
    """Cost-only stand-in for the random-mask codec: the kept values' bytes, no values (it has no
    ``decode``: a cost-only worker never decodes)."""

    def __init__(self, keep: float, wire_dtype: torch.dtype):
        self.keep, self.wire_dtype = keep, wire_dtype
        self.name = f"mask keep={keep:g}"

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: object = None) -> Encoded:
        *tokens, d = x.shape
        values = torch.empty(*tokens, mask_wire_values(self.keep, d), dtype=self.wire_dtype, device="meta")
        return Encoded({"values": values}, tuple(x.shape), x.dtype)
