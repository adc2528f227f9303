"""Hessian-vector products, the estimate record, and power iteration (the paper's estimator).

Hv = ∇_θ(∇_θL · v) by double backward: one forward and a backward with ``create_graph`` build ∇L
once (:class:`HessianOperator`), then every product is one more backward pass through that graph
(roughly 2–3 backward passes of cost per product in all). Attention runs on the math kernel while
the graph is built (fused kernels lack double backward); the loss must be deterministic (fixed
batch, no dropout), or the iteration chases noise.

Power iteration returns the eigenvalue of largest *magnitude* (the Rayleigh quotient vᵀHv of its
vector): the top positive eigenvalue only while no negative one is larger in magnitude, which at
high learning rates is not the case. The tracker and :func:`~meshlearn.curvature.top_eigenvalue`
therefore use Lanczos (``curvature/lanczos.py``); power iteration stays for ``method="power"``
and as the reference for the paper's procedure.

The preconditioned variant iterates on G = P^{-1/2} H P^{-1/2} with P = diag(√v̂ + ε), Adam's
denominator with the bias correction exactly as the update uses it; Adam is stable while
λ_max(G) < (2 + 2β₁)/((1 − β₁)·η) (38/η at β₁ = 0.9), plain gradient descent while λ_max(H) < 2/η.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

Vector = list[Tensor]


def dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)))


def norm(a: Sequence[Tensor]) -> float:
    return math.sqrt(dot(a, a))


class HessianOperator:
    """v ↦ Hv of ``loss_fn()`` with respect to ``params``; a product may also be restricted to a
    subset of the parameters (a diagonal block of H, e.g. one pipeline stage's)."""

    def __init__(self, loss_fn: Callable[[], Tensor], params: Sequence[Tensor]):
        self.params = list(params)
        with sdpa_kernel(SDPBackend.MATH):
            loss = loss_fn()
        grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
        self.loss = float(loss.detach())
        self.grads = list(grads)
        self.products = 0

    def __call__(self, v: Sequence[Tensor], subset: Sequence[int] | None = None) -> Vector:
        """H v, or H_SS v_S for the parameter indices ``subset`` (``v`` then has one tensor per index)."""
        index = list(range(len(self.params))) if subset is None else list(subset)
        terms = [(self.grads[i] * x).sum() for i, x in zip(index, v, strict=True)
                 if self.grads[i] is not None and self.grads[i].requires_grad]
        self.products += 1
        if not terms:
            return [torch.zeros_like(x) for x in v]
        out = torch.autograd.grad(sum(terms), [self.params[i] for i in index], retain_graph=True,
                                  allow_unused=True)
        return [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(out, v, strict=True)]


@dataclass
class Eigen:
    """An eigenvalue estimate: ``value``, its unit ``vector`` (the next warm start), the estimate
    after every iteration and the Hessian-vector products spent."""

    value: float
    vector: Vector
    history: list[float] = field(default_factory=list)
    hvps: int = 0
    residual: float = float("inf")
    """‖Av − θv‖/|θ| for the returned θ and v: A has an eigenvalue within residual·|θ| of θ."""
    scale: float = 0.0
    """An estimate of ‖A‖ = max |eigenvalue| (a lower bound on it)."""
    converged: bool = False
    """``residual`` ≤ the tolerance the estimate was asked for. An unconverged value must not be
    read as λ_max (a Lanczos one is still a lower bound on it)."""
    iterations: int = 0
    bottom: float | None = None
    """Lanczos only: the smallest Ritz value (the negative end of the spectrum; an upper bound on
    λ_min), with its own relative residual ``bottom_residual``."""
    bottom_residual: float | None = None

    def __float__(self) -> float:
        return self.value


def power_iteration(hvp: Callable[[Vector], Vector], v0: Sequence[Tensor], iters: int,
                    precond: Sequence[Tensor] | None = None, tol: float = 1e-2) -> Eigen:
    """At most ``iters`` steps of w = Av, λ = vᵀw, v = w/‖w‖ from ``v0``, with A = H (or
    P^{-1/2} H P^{-1/2} with ``precond`` = P, per tensor), stopping once the relative residual
    ‖Av − λv‖/|λ| of the current vector is ≤ ``tol``. Converges to the eigenvalue of largest
    magnitude, whatever its sign."""
    scale = None if precond is None else [p.rsqrt() for p in precond]
    n0 = norm(v0)
    if n0 == 0:
        raise ValueError("power iteration needs a non-zero start vector")
    v = [x / n0 for x in v0]
    history: list[float] = []
    residual, top, best = float("inf"), 0.0, v
    for _ in range(iters):
        w = hvp(v if scale is None else [s * x for s, x in zip(scale, v, strict=True)])
        if scale is not None:
            w = [s * x for s, x in zip(scale, w, strict=True)]
        lam = dot(v, w)
        history.append(lam)
        residual = norm([y - lam * x for y, x in zip(w, v, strict=True)]) / max(abs(lam), 1e-300)
        best = v  # the vector λ and the residual belong to
        n = norm(w)
        top = max(top, n)
        if n == 0 or residual <= tol:
            break
        v = [x / n for x in w]
    return Eigen(history[-1] if history else 0.0, best, history, len(history), residual, top,
                 residual <= tol, len(history))


def random_vector(like: Sequence[Tensor], generator: torch.Generator | None = None) -> Vector:
    return [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in like]


def adam_preconditioner(optimizer: torch.optim.Optimizer,
                        params: Sequence[Tensor]) -> list[Tensor | None]:
    """P = √(v/(1 − β₂ᵗ)) + ε for each of ``params``, from its Adam-style state (``exp_avg_sq``
    and ``step``: AdamW, NAdamW, the AdamW part of Muon/NuMuon) — the denominator of the next
    update; None for a parameter without such state (before its first step, or a Muon matrix)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: list[Tensor | None] = []
    for p in params:
        state = optimizer.state.get(p, {})
        group = group_of.get(id(p))
        if group is None or "exp_avg_sq" not in state or "betas" not in group:
            out.append(None)
            continue
        step = float(state["step"])
        beta2, eps = group["betas"][1], group["eps"]
        out.append((state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps).detach())
    return out


def gd_threshold(lr: float) -> float:
    """Gradient descent is stable while λ_max(H) < 2/η."""
    return 2.0 / lr


def adam_threshold(lr: float, beta1: float) -> float:
    """Adam is stable while λ_max(P^{-1/2} H P^{-1/2}) < (2 + 2β₁)/((1 − β₁)·η): 38/η at β₁ = 0.9."""
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)


def stability_ratio(lam_precond: float, lr: float, beta1: float) -> float:
    """S = η·λ_max(G)·(1 − β₁)/(2 + 2β₁): training is stable while S < 1."""
    return lam_precond / adam_threshold(lr, beta1)
