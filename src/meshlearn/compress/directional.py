"""One codec per direction: activations through the forward's codec, gradients through their own.

``codec.backward.name`` (registry.py) names the gradients' codec; the default ``same`` uses
``codec.name`` for both directions, as every codec did before. Why: the two directions err
differently. A lossy forward changes the function the downstream stages see (its gradient is
another objective's), while a gradient coded by an *unbiased* sparsifier (a random mask with the
1/keep rescale, ``codec.backward.name = mask``) is the dense gradient plus zero-mean noise, which
averaging over steps and replicas removes (docs/adaptation.md, "Why masking is so far from dense
here"). Splitting the codec lets a byte budget be spent where the bias is.

Both ends of a boundary build the same pair, so a message is always decoded by the codec that
encoded it: the wire guard reads each direction's layout through ``encode`` of its own kind.
"""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Codec, Encoded, Kind, MessageContext


class DirectionalCodec:
    """Activations through ``forward``, their gradients through ``backward``.

    ``name`` is the forward codec's: evaluation messages are activations, so what evaluation does
    (a masked pass under a mask forward, ``mesh/evaluation.py``) follows the forward codec.
    ``per_message_layout`` is set when either codec's message size depends on its own context (the
    Bernoulli mask), so the wire guard derives every message's layout from its context.
    """

    def __init__(self, forward: Codec, backward: Codec):
        self.forward = forward
        self.backward = backward
        self.name = forward.name
        self.per_message_layout = any(getattr(c, "per_message_layout", False) for c in (forward, backward))

    def codec(self, kind: Kind) -> Codec:
        """The codec of one direction."""
        return self.forward if kind == "act" else self.backward

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        return self.codec(kind).encode(x, kind, ids, ctx)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        return self.codec(kind).decode(message, kind, ctx)
