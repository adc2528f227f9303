"""The top eigenvalue of the loss Hessian (or of the Adam-preconditioned Hessian) by power iteration
with Hessian-vector products, warm-started from the previous estimate's eigenvector.

Hv = ∇_θ(∇_θL · v) by double backward: one forward and a backward with ``create_graph`` build ∇L
once (:class:`HessianOperator`), then every product is one more backward pass through that graph
(roughly 2–3 backward passes of cost per product in all). Attention runs on the math kernel while
the graph is built (fused kernels lack double backward); the loss must be deterministic (fixed
batch, no dropout), or the iteration chases noise.

Power iteration returns the eigenvalue of largest *magnitude* (the Rayleigh quotient vᵀHv of its
vector): for a training loss that is the top positive eigenvalue unless a negative one is larger in
magnitude (early in training, near a saddle); the sign of the value says which.

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
    """A power-iteration result: ``value`` (the last Rayleigh quotient), its unit ``vector``, the
    Rayleigh quotient after every iteration and the Hessian-vector products spent."""

    value: float
    vector: Vector
    history: list[float] = field(default_factory=list)
    hvps: int = 0
    residual: float = 0.0
    """‖Av − λv‖/|λ| at the last iteration: small once converged; large when eigenvalues of
    opposite sign and similar magnitude make the iteration oscillate."""
    scale: float = 0.0
    """The largest ‖Av‖ seen (unit v): an estimate of ‖A‖ = max |eigenvalue|."""

    def __float__(self) -> float:
        return self.value


def power_iteration(hvp: Callable[[Vector], Vector], v0: Sequence[Tensor], iters: int,
                    precond: Sequence[Tensor] | None = None, tol: float = 0.0,
                    shift: float = 0.0) -> Eigen:
    """``iters`` steps of w = Av, λ = vᵀw, v = w/‖w‖ from ``v0``, with A = H (or P^{-1/2} H P^{-1/2}
    with ``precond`` = P, per tensor) minus ``shift``·I; the values reported are A's plus the
    shift. A shift at (or below) the most negative eigenvalue makes the top *positive* eigenvalue
    the dominant one. ``tol`` > 0 stops early once λ changes by at most tol·|λ| between two
    iterations."""
    scale = None if precond is None else [p.rsqrt() for p in precond]
    n0 = norm(v0)
    if n0 == 0:
        raise ValueError("power iteration needs a non-zero start vector")
    v = [x / n0 for x in v0]
    history: list[float] = []
    residual, top = 0.0, 0.0
    for _ in range(iters):
        w = hvp(v if scale is None else [s * x for s, x in zip(scale, v, strict=True)])
        if scale is not None:
            w = [s * x for s, x in zip(scale, w, strict=True)]
        if shift:
            w = [y - shift * x for y, x in zip(w, v, strict=True)]
        history.append(dot(v, w) + shift)
        n = norm(w)
        if n == 0:
            break
        lam = history[-1] - shift
        residual = norm([y - lam * x for y, x in zip(w, v, strict=True)]) / max(abs(lam), 1e-30)
        top = max(top, n)
        v = [x / n for x in w]
        if tol and len(history) > 1 and abs(history[-1] - history[-2]) <= tol * abs(history[-1]):
            break
    return Eigen(history[-1] if history else 0.0, v, history, len(history), residual, top)


def random_vector(like: Sequence[Tensor], generator: torch.Generator | None = None) -> Vector:
    return [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in like]


def top_eigenvalue(loss_fn: Callable[[], Tensor], params: Sequence[Tensor], iters: int = 20,
                   v0: Sequence[Tensor] | None = None, precond: Sequence[Tensor] | None = None,
                   generator: torch.Generator | None = None, tol: float = 0.0) -> Eigen:
    """λ_max of the Hessian of ``loss_fn()`` (a scalar) with respect to ``params``, by ``iters``
    power iterations. ``v0``: the start (a previous ``Eigen.vector`` for a warm start; default
    random from ``generator``). ``precond``: Adam's P = √v̂ + ε per parameter, for
    λ_max(P^{-1/2} H P^{-1/2}) (see :func:`adam_preconditioner`). Use ``float(result)`` or
    ``result.value``; ``result.vector`` is the eigenvector estimate."""
    params = list(params)
    operator = HessianOperator(loss_fn, params)
    start = random_vector(params, generator) if v0 is None else list(v0)
    return power_iteration(operator, start, iters, precond, tol)


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
