"""The public entry point: ``top_eigenvalue(loss_fn, params, iters=...)``, λ_max of the Hessian of a
scalar loss (or of the Adam-preconditioned Hessian), usable without the mesh.

``method="lanczos"`` (default) returns the algebraically largest eigenvalue — the one the stability
thresholds 2/η and (2 + 2β₁)/((1 − β₁)η) are about — whatever the signs elsewhere in the spectrum,
and converges faster than power iteration for the same number of products; it keeps ``iters`` + 1
parameter-sized vectors. ``method="power"`` is the paper's power iteration: one vector of state,
but it finds the eigenvalue of largest *magnitude*, which is λ_min whenever |λ_min| > λ_max (the
case at high learning rates, docs/warmup.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from meshlearn.curvature.lanczos import lanczos
from meshlearn.curvature.power import Eigen, HessianOperator, power_iteration, random_vector

METHODS = {"lanczos": lanczos, "power": power_iteration}


def top_eigenvalue(loss_fn: Callable[[], Tensor], params: Sequence[Tensor], iters: int = 20,
                   v0: Sequence[Tensor] | None = None, precond: Sequence[Tensor] | None = None,
                   generator: torch.Generator | None = None, tol: float = 1e-2,
                   method: str = "lanczos") -> Eigen:
    """λ_max of the Hessian of ``loss_fn()`` (a scalar) with respect to ``params``, by at most
    ``iters`` Hessian-vector products, stopping once the relative residual ‖Hv − θv‖/|θ| ≤ ``tol``
    (``result.converged`` says whether it got there). ``v0``: the start (a previous
    ``Eigen.vector`` for a warm start; default random from ``generator``). ``precond``: Adam's
    P = √v̂ + ε per parameter, for λ_max(P^{-1/2} H P^{-1/2}) (see
    :func:`~meshlearn.curvature.adam_preconditioner`). Use ``float(result)`` or ``result.value``."""
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {sorted(METHODS)}")
    params = list(params)
    operator = HessianOperator(loss_fn, params)
    start = random_vector(params, generator) if v0 is None else list(v0)
    return METHODS[method](operator, start, iters, precond, tol)
