"""Which weights the compressibility pipeline looks at: the hidden matrices of every block.

The seven projections of a block (q, k, v, o, gate, up, down) are the matrices Muon and NuMuon
train and the ones SVD compression factorizes. The token embedding and the LM head are never
included: they are row lookups and per-token logit directions, not maps between activation
spaces, and silently counting them would inflate compression ratios (see the method note).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshlearn.models.llama import Decoder

ATTENTION_KINDS = ("q", "k", "v", "o")
MLP_KINDS = ("gate", "up", "down")
BLOCK_KINDS = ATTENTION_KINDS + MLP_KINDS
"""Layer types in reading order; reports and plots group matrices by these."""


@dataclass(frozen=True)
class BlockMatrix:
    """One hidden matrix of the decoder, addressed by its module name (``layers.0.attn.q``)."""

    name: str
    kind: str
    layer: int
    parent: nn.Module
    """The module holding it (``Attention`` or ``SwiGLU``), so a pipeline can swap it out."""

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.kind)

    @property
    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight; for a ``SubspaceLinear`` the effective U·Z."""
        return self.module.weight.detach()

    @property
    def factorizable(self) -> bool:
        """Only plain ``nn.Linear`` layers are factorized; subspace writers are already U·Z."""
        return type(self.module) is nn.Linear


def block_matrices(model: Decoder) -> list[BlockMatrix]:
    """Every block matrix of ``model`` in layer order, then q, k, v, o, gate, up, down."""
    found = []
    for layer_id, block in model.layers.items():
        for parent, branch, kinds in ((block.attn, "attn", ATTENTION_KINDS),
                                      (block.mlp, "mlp", MLP_KINDS)):
            for kind in kinds:
                found.append(BlockMatrix(f"layers.{layer_id}.{branch}.{kind}", kind, int(layer_id), parent))
    return found
