"""Exact parameter accounting of a compressed model, measured rather than nominal.

Two ratios, because either one alone misleads: the fraction kept *within the compressed matrices*
(both factors counted) is what a pipeline controls, and the fraction kept of the *whole model*
(embedding, head and norms included, uncompressed) is what a user stores. Parameters are those of
``module.parameters()``; fixed buffers (a subspace model's basis and token table, rotary tables) are
regenerated from seeds and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class ParameterAccount:
    ranks: dict[str, int]
    """Compressed matrix name → kept rank (the list of compressed matrices)."""
    dense_params: int
    """Parameters of the compressed matrices before compression (Σ mn)."""
    factor_params: int
    """Their parameters after compression (Σ r(m + n))."""
    total_before: int
    total_after: int
    skipped: dict[str, str] = field(default_factory=dict)
    """Block matrices left dense, with the reason."""

    @property
    def kept_in_compressed(self) -> float:
        return self.factor_params / self.dense_params if self.dense_params else 1.0

    @property
    def kept_total(self) -> float:
        return self.total_after / self.total_before

    def to_dict(self) -> dict:
        return {"compressed": sorted(self.ranks), "ranks": self.ranks, "skipped": self.skipped,
                "dense_params": self.dense_params, "factor_params": self.factor_params,
                "kept_in_compressed": self.kept_in_compressed,
                "removed_in_compressed": 1 - self.kept_in_compressed,
                "total_before": self.total_before, "total_after": self.total_after,
                "kept_total": self.kept_total, "removed_total": 1 - self.kept_total}
