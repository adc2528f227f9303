"""The invertible transforms a morph inserts at a boundary (I = T·T⁻¹), drawn in fp64.

Pure functions of a ``torch.Generator``: the same generator state gives the same transform on
every replica of a stage, which is what lets all DP replicas of a stage morph together.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Transform:
    """T (d, d) and its inverse, both fp64."""

    matrix: Tensor
    inverse: Tensor
    orthogonal: bool

    def condition(self) -> float:
        """κ(T) = σ_max / σ_min."""
        s = torch.linalg.svdvals(self.matrix)
        return float(s[0] / s[-1])


def haar_orthogonal(d: int, generator: torch.Generator) -> Transform:
    """A Haar-distributed orthogonal matrix: QR of a Gaussian matrix, columns multiplied by
    sign(diag R) (Mezzadri's fix; without it QR's sign convention biases the distribution)."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    return Transform(q, q.T.contiguous(), orthogonal=True)


def low_condition(d: int, epsilon: float, generator: torch.Generator) -> Transform:
    """T = U·diag(s·e^{u_i})·Vᵀ with U, V Haar and u_i ~ U[−ε, ε], so κ(T) ≤ e^{2ε}. The scale
    s = e^{−mean u} makes |det T| = 1 (our choice for the note's "cycled" s): the product of many
    morphs keeps its volume, so weight norms do not drift in one direction."""
    u = haar_orthogonal(d, generator).matrix
    v = haar_orthogonal(d, generator).matrix
    logs = (torch.rand(d, generator=generator, dtype=torch.float64) * 2 - 1) * epsilon
    logs = logs - logs.mean()
    matrix = (u * logs.exp()) @ v.T
    inverse = (v * (-logs).exp()) @ u.T
    return Transform(matrix, inverse, orthogonal=False)


def whitening(cov: Tensor, generator: torch.Generator, shrinkage: float = 0.1) -> Transform:
    """T = C^{−1/2}·Q: whitens traffic of covariance C (X·T has covariance I), then a Haar rotation.
    The defence against passive covariance alignment (docs/unextractable.md): an orthogonal morph
    keeps the spectrum of the boundary covariance, whose eigenvectors then identify the basis change
    between two epochs; after a whitening morph every direction has variance 1, so there is nothing
    to match (to second order). ``shrinkage`` δ whitens with (1 − δ)·C + δ·(tr C / d)·I instead, which
    bounds κ(T) = √κ(C) for a stream with a few huge directions (it leaves those partly visible)."""
    cov = cov.double()
    d = cov.shape[0]
    cov = (1 - shrinkage) * cov + shrinkage * torch.trace(cov) / d * torch.eye(d, dtype=cov.dtype)
    values, vectors = torch.linalg.eigh((cov + cov.T) / 2)
    q = haar_orthogonal(d, generator).matrix
    inv_sqrt = (vectors * values.rsqrt()) @ vectors.T
    sqrt = (vectors * values.sqrt()) @ vectors.T
    return Transform(inv_sqrt @ q, q.T @ sqrt, orthogonal=False)


def draw(kind: str, d: int, epsilon: float, generator: torch.Generator) -> Transform:
    """``kind``: ``orthogonal`` or ``lowcond`` (protocol.morph)."""
    if kind == "orthogonal":
        return haar_orthogonal(d, generator)
    if kind == "lowcond":
        return low_condition(d, epsilon, generator)
    raise ValueError(f"protocol.morph = {kind!r} draws no transform; allowed: orthogonal, lowcond")


def seeded_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (e.g. run seed, purpose, stage, epoch), independent of
    the global RNG, so morphs never shift the training's random stream and a resumed run draws the
    same transforms. (In the simulator this stands in for the note's per-boundary group secret.)"""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
