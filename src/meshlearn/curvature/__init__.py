"""Online curvature: λ_max of the loss Hessian and of the Adam-preconditioned Hessian by
warm-started Lanczos with Hessian-vector products (power iteration as an option; see
docs/warmup.md)."""

from meshlearn.curvature.estimate import METHODS, top_eigenvalue
from meshlearn.curvature.lanczos import lanczos
from meshlearn.curvature.power import (
    Eigen,
    HessianOperator,
    adam_preconditioner,
    adam_threshold,
    gd_threshold,
    power_iteration,
    stability_ratio,
)
from meshlearn.curvature.settings import CurvatureConfig, validate_curvature
from meshlearn.curvature.tracker import CurvatureTracker

__all__ = [
    "METHODS",
    "CurvatureConfig",
    "CurvatureTracker",
    "Eigen",
    "HessianOperator",
    "adam_preconditioner",
    "adam_threshold",
    "gd_threshold",
    "lanczos",
    "power_iteration",
    "stability_ratio",
    "top_eigenvalue",
    "validate_curvature",
]
