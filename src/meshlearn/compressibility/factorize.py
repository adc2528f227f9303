"""Low-rank factorizations W ≈ A·B of one weight matrix: truncated SVD, ASVD and SVD-LLM.

Notation (method note): W ∈ R^{m×n} in nn.Linear layout (out × in), y = W x, calibration inputs
X ∈ R^{n×N}. Every method takes an SVD of some W·T (T = I, a diagonal scale S, or a Cholesky
factor L), keeps the top r triplets, splits Σ_r evenly between the factors and folds T⁻¹ into the
right factor:

    A = U_r Σ_r^{1/2}   (m × r),     B = Σ_r^{1/2} V_rᵀ T⁻¹   (r × n),

so the stored cost is r(m + n) whatever T is. All arithmetic runs in fp64; the factors come back in
W's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Factors:
    a: torch.Tensor
    """(m, r) left factor."""
    b: torch.Tensor
    """(r, n) right factor."""

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    @property
    def params(self) -> int:
        """r(m + n): both factors are stored."""
        return self.a.numel() + self.b.numel()

    def dense(self) -> torch.Tensor:
        return self.a @ self.b


def rank_for_keep(keep: float, m: int, n: int) -> int:
    """r = ⌊keep · mn / (m + n)⌋ (at least 1): the rank whose factors store ``keep`` of the mn dense
    parameters. The product is rounded to 9 decimals first, so float noise (0.75 · 16 =
    11.999999…) cannot drop a rank."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be a fraction in (0, 1], got {keep}")
    return max(1, math.floor(round(keep * m * n / (m + n), 9)))


def _split(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    root = s[:r].sqrt()
    return u[:, :r] * root, root[:, None] * vh[:r]


def _check_rank(weight: torch.Tensor, r: int) -> None:
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not 1 <= r <= min(weight.shape):
        raise ValueError(f"rank must be in [1, {min(weight.shape)}] for shape {tuple(weight.shape)}, got {r}")


def truncated_svd(weight: torch.Tensor, r: int) -> Factors:
    """Plain truncated SVD: the best rank-r approximation in Frobenius norm, blind to the inputs."""
    _check_rank(weight, r)
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    a, b = _split(u, s, vh, r)
    return Factors(a.to(weight.dtype), b.to(weight.dtype))


def asvd_scale(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """ASVD's diagonal S: s_j = (mean_t |X_jt|)^α. Channels that never fired are floored at 1e-6 of
    the largest mean, so S⁻¹ stays finite (their columns are then cut first, which costs nothing on
    inputs like the calibration data)."""
    means = abs_mean.double()
    floor = max(means.max().item(), 1e-30) * 1e-6
    return means.clamp(min=floor).pow(alpha)


def asvd(weight: torch.Tensor, abs_mean: torch.Tensor, r: int, alpha: float = 0.5) -> Factors:
    """ASVD (arXiv 2312.05821): truncate the SVD of W·S, then fold S⁻¹ into B. Columns fed by large
    activations weigh more, so the truncation protects them; α = 0 is plain truncated SVD."""
    _check_rank(weight, r)
    scale = asvd_scale(abs_mean, alpha)
    u, s, vh = torch.linalg.svd(weight.double() * scale[None, :], full_matrices=False)
    a, b = _split(u, s, vh, r)
    return Factors(a.to(weight.dtype), (b / scale[None, :]).to(weight.dtype))


def whitening(gram: torch.Tensor, ridge: float) -> torch.Tensor:
    """Lower-triangular L with L Lᵀ = X Xᵀ + λ I, λ = ridge · mean(diag(X Xᵀ)), in fp64.

    The ridge keeps the Cholesky factorization defined when channels are dead or the calibration set
    is smaller than n; raise it (1e-4) if this raises on a real model."""
    gram = gram.double()
    n = gram.shape[0]
    lam = ridge * gram.diagonal().mean().item()
    chol, info = torch.linalg.cholesky_ex(gram + lam * torch.eye(n, dtype=torch.float64))
    if info.item() != 0:
        raise ValueError(f"X Xᵀ + {lam:.3g} I is not positive definite (n = {n}); "
                         "use a larger SVD-LLM ridge or more calibration sequences")
    return chol


def svd_llm(weight: torch.Tensor, gram: torch.Tensor, r: int, ridge: float = 1e-6) -> Factors:
    """SVD-LLM (arXiv 2403.07378): truncate the SVD of W·L, where L Lᵀ = X Xᵀ (+ ridge), and fold L⁻¹
    into B. With ridge 0 the output error on the calibration data is exactly the truncated tail:
    ‖(W − A B) X‖_F² = Σ_{i>r} σ_i(W L)² (with a ridge λ it is that minus λ ‖W − A B‖_F²)."""
    _check_rank(weight, r)
    chol = whitening(gram, ridge)
    u, s, vh = torch.linalg.svd(weight.double() @ chol, full_matrices=False)
    a, b = _split(u, s, vh, r)
    b = torch.linalg.solve_triangular(chol, b, upper=False, left=False)  # B ← B L⁻¹
    return Factors(a.to(weight.dtype), b.to(weight.dtype))
