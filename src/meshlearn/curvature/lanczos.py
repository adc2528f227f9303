"""The top (algebraically largest) eigenvalue of a symmetric operator by Lanczos with full
reorthogonalisation, from Hessian-vector products.

Why Lanczos and not power iteration: power iteration converges to the eigenvalue of largest
*magnitude*. At high learning rates the loss Hessian has negative eigenvalues far larger in
magnitude than its top positive one, so the iteration finds the negative end, and a shifted rerun
on A + ‖A‖·I contracts at (‖A‖ + λ₂)/(‖A‖ + λ₁), within 10⁻³ of 1 when the top gap is of order 1
and ‖A‖ ~ 10³ (measured, docs/warmup.md). Lanczos builds the Krylov space of the same products and
reads *both* ends of the spectrum off the small tridiagonal matrix T: its top Ritz value converges
at the Chebyshev rate, roughly exp(−2k·√(gap/spread)) after k products instead of (1 − gap/spread)^k,
whatever the signs.

Facts the callers rely on:

- The top Ritz value θ is a Rayleigh quotient, so θ ≤ λ_max always (Courant–Fischer): an
  unconverged estimate is a lower bound, never an overshoot.
- The Ritz residual ‖Ay − θy‖ of the Ritz vector y is β_k·|s_k| (the last off-diagonal of T times
  the last component of T's eigenvector), free of extra products; with full reorthogonalisation it
  is accurate (tested against an explicit product). A symmetric A has an eigenvalue within that
  residual of θ, so ``residual = ‖Ay − θy‖/|θ| ≤ tol`` (``converged``) puts θ within tol·|θ| of an
  eigenvalue — the top one unless the Krylov space has not yet seen a larger one (a start vector
  nearly orthogonal to it; not detectable from the residual).
- A warm start from the previous estimate's Ritz vector puts most of the weight on the top
  eigenvector already, so the residual test stops after few products when the Hessian moved
  little (Theorem 1 of the paper).

Memory: the basis holds ``iters`` + 1 parameter-sized vectors (in the parameters' dtype), which is
why the iteration count stays small (the tracker's default cap is 20).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from meshlearn.curvature.power import Eigen, Vector


def _flatten(parts: Sequence[Tensor]) -> Tensor:
    return torch.cat([x.reshape(-1) for x in parts])


def _unflatten(flat: Tensor, like: Sequence[Tensor]) -> Vector:
    out, start = [], 0
    for x in like:
        out.append(flat[start:start + x.numel()].view_as(x))
        start += x.numel()
    return out


def _dot(a: Tensor, b: Tensor) -> float:
    return float(torch.dot(a.double(), b.double()))


def lanczos(hvp: Callable[[Vector], Vector], v0: Sequence[Tensor], iters: int,
            precond: Sequence[Tensor] | None = None, tol: float = 1e-2) -> Eigen:
    """At most ``iters`` Lanczos steps on A = H (or P^{-1/2} H P^{-1/2} with ``precond`` = P, per
    tensor) from ``v0``, stopping as soon as the top Ritz pair's relative residual is ≤ ``tol``
    (> 0). Returns the top Ritz value and unit Ritz vector (``Eigen``,
    with ``converged``, ``residual``, ``iterations``; ``bottom`` is the smallest Ritz value, for
    the negative end, and ``scale`` the largest |Ritz value|, a lower bound on ‖A‖)."""
    if iters < 1 or tol <= 0:
        raise ValueError(f"lanczos needs iters >= 1 and tol > 0, got iters={iters}, tol={tol}")
    like = list(v0)
    q = _flatten(like)
    n0 = float(q.double().norm())
    if n0 == 0:
        raise ValueError("lanczos needs a non-zero start vector")
    scale = None if precond is None else _flatten([p.rsqrt() for p in precond]).to(q.dtype)

    def apply(x: Tensor) -> Tensor:
        if scale is not None:
            x = scale * x
        w = _flatten(hvp(_unflatten(x, like))).to(q.dtype)
        return w if scale is None else scale * w

    basis = torch.empty(iters + 1, q.numel(), dtype=q.dtype)
    basis[0] = q / n0
    alphas: list[float] = []
    betas: list[float] = []
    history: list[float] = []
    for j in range(iters):  # iters >= 1: theta, vectors and the residuals are always set
        w = apply(basis[j])
        alpha = _dot(basis[j], w)
        w -= alpha * basis[j]
        if j:
            w -= betas[-1] * basis[j - 1]
        for _ in range(2):  # full reorthogonalisation, twice ("twice is enough") in finite precision
            w -= basis[:j + 1].T @ (basis[:j + 1] @ w)
        beta = float(w.double().norm())
        alphas.append(alpha)
        t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64)
            t += torch.diag(off, 1) + torch.diag(off, -1)
        theta, vectors = torch.linalg.eigh(t)  # ascending
        residual_abs = beta * abs(float(vectors[-1, -1]))
        bottom_abs = beta * abs(float(vectors[-1, 0]))
        top = float(theta[-1])
        history.append(top)
        spread = float(theta.abs().max())
        if beta <= 1e-12 * max(spread, 1e-300):  # an invariant subspace: the Ritz values are exact
            break
        if residual_abs <= tol * abs(top):
            break
        betas.append(beta)
        basis[j + 1] = w / beta
    k = len(alphas)
    ritz = basis[:k].T @ vectors[:, -1].to(basis.dtype)
    ritz /= float(ritz.double().norm())
    top, bottom = float(theta[-1]), float(theta[0])
    residual = residual_abs / max(abs(top), 1e-300)
    return Eigen(value=top, vector=[x.clone() for x in _unflatten(ritz, like)], history=history,
                 hvps=k, residual=residual, scale=float(theta.abs().max()),
                 converged=residual <= tol, iterations=k,
                 bottom=bottom, bottom_residual=bottom_abs / max(abs(bottom), 1e-300))
