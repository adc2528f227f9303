"""The layer a compressed matrix becomes: two bias-free linears, x → B x → A (B x)."""

from __future__ import annotations

import torch
from torch import nn

from meshlearn.compressibility.factorize import Factors


class LowRankLinear(nn.Module):
    """y = A (B x) with A ∈ R^{m×r}, B ∈ R^{r×n}: r(m + n) parameters instead of mn.

    Stored as two ``nn.Linear`` (``b`` then ``a``), so parameter counts and ``state_dict`` keys
    (``….q.b.weight``, ``….q.a.weight``) say plainly what was kept."""

    def __init__(self, factors: Factors):
        super().__init__()
        (m, r), n = factors.a.shape, factors.b.shape[1]
        self.b = nn.Linear(n, r, bias=False)
        self.a = nn.Linear(r, m, bias=False)
        with torch.no_grad():
            self.b.weight.copy_(factors.b)
            self.a.weight.copy_(factors.a)

    @property
    def rank(self) -> int:
        return self.b.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(x))  # (..., n) → (..., r) → (..., m)
