"""The curvature tracker's config section (``curvature.*``) and its checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CurvatureConfig:
    """Online estimates of λ_max of the loss Hessian and of the Adam-preconditioned Hessian
    (a diagnostic; see docs/warmup.md). Config keys under ``curvature.``."""

    every: int = 0
    """Steps between estimates, each at a drain point it asks for; 0 = off (the paper's N_c: 50)."""
    iters: int = 20
    """Most Lanczos iterations (Hessian-vector products) per estimate and parameter set; an
    estimate stops earlier once converged (``tol``). Memory: iters + 1 parameter-sized vectors.
    Raise it if ``lambda_max_converged`` is often false (high lr: |λ_min| ≫ λ_max)."""
    tol: float = 1e-2
    """Convergence test: the Ritz residual ‖Av − θv‖ ≤ tol·|θ| (then an eigenvalue lies within
    tol·|θ| of θ). Estimates that miss it are logged with ``*_converged = false``."""
    batch_size: int = 8
    """Sequences of the fixed probe batch (drawn once from the training split)."""
    preconditioned: bool = True
    """Also estimate λ_max(P^{-1/2} H P^{-1/2}) with Adam's P, and the stability ratio."""
    per_stage: bool = True
    """In a pipeline, also each stage's diagonal Hessian block (lower bounds on the full λ_max)."""


def validate_curvature(cfg: Any, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``curvature.*`` run by ``config.validate``."""
    c = cfg.curvature
    require(c.every >= 0, "curvature.every", c.every, "must be >= 0 (0 = off)")
    require(c.iters >= 1, "curvature.iters", c.iters, "must be >= 1")
    require(0 < c.tol < 1, "curvature.tol", c.tol, "must be in (0, 1)")
    require(c.batch_size >= 1, "curvature.batch_size", c.batch_size, "must be >= 1")
