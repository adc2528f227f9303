"""The random-mask codec's wire size, for the planner, until the codec itself is registered.

Mesh adaptation (docs: /work/shared/methods/mesh_adaptation.md) sends, per token and boundary,
only the kept entries of the activation (forward) and of its gradient (backward): round(keep·d)
values in the wire dtype, and no indices (the receiver regenerates the mask from a shared key).
``mask_wire_values`` is that rule in one place; ``MaskCostCodec`` puts a meta tensor of that size
on the wire so the simulator charges it like any codec's message. When ``codec.name = "mask"``
exists, the planner should build that codec on meta tensors instead (as it does for every
registered codec) and this module goes.
"""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Encoded, Kind


def mask_wire_values(keep: float, d_model: int) -> int:
    """Values one token sends across a boundary, in each direction, at keep rate ``keep``."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"mask keep = {keep!r}: must be in (0, 1] (M95 is keep 0.05)")
    return max(1, round(keep * d_model))


class MaskCostCodec:
    """Cost-only stand-in for the random-mask codec: the kept values' bytes, no values (it has no
    ``decode``: a cost-only worker never decodes)."""

    def __init__(self, keep: float, wire_dtype: torch.dtype):
        mask_wire_values(keep, 1)  # validates keep
        self.keep, self.wire_dtype = keep, wire_dtype
        self.name = f"mask keep={keep:g}"

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None) -> Encoded:
        *tokens, d = x.shape
        values = torch.empty(*tokens, mask_wire_values(self.keep, d), dtype=self.wire_dtype, device="meta")
        return Encoded({"values": values}, tuple(x.shape), x.dtype)
