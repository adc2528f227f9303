"""Extraction attacks on a protocol model: assemble a working model from stages collected in
different morph epochs (method note "Stitching attack", "Direct bridge attack", and the open
risk "passive covariance alignment").

Row-vector convention, as in the note: the traffic X crossing a boundary is (tokens, d); between
epochs a and b the boundary's basis changed by the product of the morphs in between, T̂, so that
X_b ≈ X_a·T̂ on the same inputs (exactly, when no training happened in between). An attacker
holding stage s from epoch a and stage s + 1 from epoch b inserts an estimate of T̂ between them.

- ``stitch``: no bridge (T̂ = I): the pieces as collected.
- ``bridge``: identical inputs at both times (``probe`` traffic), T̂ fitted by least squares
  (X_a⁺X_b) or, for orthogonal morphs, orthogonal Procrustes.
- ``covariance``: only passive traffic on different inputs at the two times: for orthogonal T̂,
  C_b = T̂ᵀ·C_a·T̂, so matching the eigenvectors of the two covariances (sorted by eigenvalue)
  recovers T̂ up to a sign per eigenvector, fixed from the first and third moments along each.

Pure functions of tensors; ``meshlearn/attack_run.py`` applies them to a run folder.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

ATTACKS = ("stitch", "bridge", "covariance")


def procrustes(x_a: Tensor, x_b: Tensor) -> Tensor:
    """The orthogonal T minimizing ‖X_a·T − X_b‖ (fp64): U·Vᵀ from the SVD of X_aᵀX_b."""
    u, _, vh = torch.linalg.svd(x_a.double().T @ x_b.double())
    return u @ vh


def least_squares(x_a: Tensor, x_b: Tensor) -> Tensor:
    """The T minimizing ‖X_a·T − X_b‖ with no constraint (X_a⁺X_b, fp64)."""
    return torch.linalg.lstsq(x_a.double(), x_b.double()).solution


def _moments(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, eigenvalues (descending) and eigenvectors (columns) of the covariance of x (fp64)."""
    x = x.double()
    mean = x.mean(0)
    centred = x - mean
    values, vectors = torch.linalg.eigh(centred.T @ centred / len(x))
    return mean, values.flip(0), vectors.flip(1)


def _sign_signature(x: Tensor, mean: Tensor, vectors: Tensor) -> Tensor:
    """Per eigenvector v: the standardized mean and skewness of x·v, both odd in v, so they flip
    with its sign and tell the two epochs' signs apart (zero where the distribution is symmetric)."""
    p = (x.double() - mean) @ vectors
    sd = p.std(0).clamp_min(1e-12)
    return torch.stack([(mean @ vectors) / sd, (p / sd).pow(3).mean(0)])


def covariance_alignment(x_a: Tensor, x_b: Tensor) -> Tensor:
    """T̂ = Σ_i f_i·u_i·v_iᵀ from passive samples of the two epochs (any inputs): u_i, v_i the i-th
    eigenvectors of the two covariances, f_i = ±1 making the sign signatures agree. Recovers an
    orthogonal T̂ where eigenvalues are distinct and well estimated; near-equal eigenvalues mix."""
    mean_a, _, u = _moments(x_a)
    mean_b, _, v = _moments(x_b)
    sig_a, sig_b = _sign_signature(x_a, mean_a, u), _sign_signature(x_b, mean_b, v)
    flips = torch.where((sig_a * sig_b).sum(0) < 0, -1.0, 1.0).double()
    return (u * flips) @ v.T


def relative_error(x_a: Tensor, x_b: Tensor, t: Tensor) -> float:
    """‖X_a·T − X_b‖ / ‖X_b‖: how well T maps one epoch's traffic onto the other's."""
    return float((x_a.double() @ t - x_b.double()).norm() / x_b.double().norm())


class Bridged(nn.Module):
    """Stages run in order, with a bridge (a (d, d) matrix, or None) after each but the last."""

    def __init__(self, stages: list[nn.Module], bridges: list[Tensor | None]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.bridges = bridges

    def forward(self, x: Tensor) -> Tensor:
        for s, stage in enumerate(self.stages):
            x = stage(x)
            if s < len(self.bridges) and self.bridges[s] is not None:
                x = x @ self.bridges[s].to(x.dtype)
        return x


def mixed_assignments(stages: int, alternating_only: bool = False) -> list[tuple[int, ...]]:
    """Which of two snapshots (0 or 1) each stage comes from, every mix but the two whole ones
    (those are the real models); or only 0, 1, 0, ... (every boundary crosses epochs)."""
    if alternating_only:
        return [tuple(s % 2 for s in range(stages))]
    return [a for a in itertools.product((0, 1), repeat=stages) if 0 < sum(a) < stages]
