"""Online curvature: λ_max of the loss Hessian and of the Adam-preconditioned Hessian by
warm-started power iteration with Hessian-vector products (see docs/warmup.md)."""

from meshlearn.curvature.power import (
    Eigen,
    HessianOperator,
    adam_preconditioner,
    adam_threshold,
    gd_threshold,
    power_iteration,
    stability_ratio,
    top_eigenvalue,
)
from meshlearn.curvature.settings import CurvatureConfig, validate_curvature
from meshlearn.curvature.tracker import CurvatureTracker

__all__ = [
    "CurvatureConfig",
    "CurvatureTracker",
    "Eigen",
    "HessianOperator",
    "adam_preconditioner",
    "adam_threshold",
    "gd_threshold",
    "power_iteration",
    "stability_ratio",
    "top_eigenvalue",
    "validate_curvature",
]
