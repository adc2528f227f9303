"""NAdamW: NAdam (Dozat 2016) with decoupled weight decay — the look-ahead optimizer of asynchronous
pipelines ("Nesterov Method for Asynchronous Pipeline Parallel Optimization", arXiv 2505.01099).

Why NAdam is the paper's Nesterov rule. In an asynchronous (PipeDream-style, no flush) pipeline,
stage ``s`` applies a gradient that is τ_s = P−1−s updates stale. The paper's rule is Nesterov's
accelerated gradient with the stale gradient discounted:

    w_{t+1} = w_t + d_t − η(1−γ)·∇f(w_{t−τ} + d_{t−τ}),   d_t = γ(w_t − w_{t−1}).

NAdam stores the *look-ahead iterate itself*: each step already applies next step's momentum
(the μ_{t+1}·m_t term below), so the weights a forward pass reads — and, with weight stashing, the
weights its backward pass is run at — are the look-ahead point w + d. The gradient of a stashed
version is then exactly the paper's ∇f(w_{t−τ} + d_{t−τ}), and the (1−μ_t)·g_t term is its
(1−γ) discount. With γ = β1 → 1 the look-ahead direction lines up with the gap between the stale
and the current weights, which is how the delay is corrected in weight space. Two details of the
realization matter (the method note, "NAdam realization"):

* μ_t = β1(1 − ½·0.96^{tψ}) with ψ = 0.004 starts near β1/2 and reaches ≈ 0.97 (β1 = 0.99) after
  about 20k steps: a built-in momentum warm-up. It depends on the parameter's own step count t, so
  that counter lives in the optimizer state and must never be reset (not at a checkpoint resume, not
  at a data-parallel merge of moments).
* The Adam denominator is a preconditioner the theory does not cover; weight decay is decoupled
  (θ ← θ(1 − ηλ)), as in AdamW.

One step, for each parameter with a gradient (t counts from 1)::

    θ   ← θ(1 − ηλ)
    m_t = β1·m_{t−1} + (1−β1)·g_t          v_t = β2·v_{t−1} + (1−β2)·g_t²
    θ   ← θ − η·[(1−μ_t)·g_t/(1−Π_{i≤t} μ_i) + μ_{t+1}·m_t/(1−Π_{i≤t+1} μ_i)] / (√(v_t/(1−β2^t)) + ε)

This is the arithmetic of ``torch.optim.NAdam(..., momentum_decay=0.004,
decoupled_weight_decay=True, foreach=False)`` in the same order: moments and parameters match it bit
for bit (the test runs 6 steps with a changing lr; 400 were checked once). One deliberate
difference: the step count and the product Π μ_i are Python numbers (an int and a float64), where
torch keeps float32 tensors and its ``load_state_dict`` casts the product to the parameter's dtype
and device — bf16 parameters would round it, and a resumed run would drift from an uninterrupted
one. The two products can differ in their last float32 bits, so a coefficient may in rare cases
round differently from torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

MOMENTUM_DECAY = 0.004
"""ψ of the official AsyncPP code (and torch's default): μ_t rises from ≈ β1/2 to ≈ 0.98·β1 in 20k steps."""


def momentum_at(beta1: float, step: int, momentum_decay: float = MOMENTUM_DECAY) -> float:
    """μ_t = β1(1 − ½·0.96^{tψ}): NAdam's momentum coefficient at step ``step`` (from 1)."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))


def nadamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    mu_product: float,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    momentum_decay: float = MOMENTUM_DECAY,
) -> float:
    """One NAdamW step in place. ``step`` counts from 1; ``mu_product`` is Π_{i<t} μ_i (1.0 before
    the first step). Returns Π_{i≤t} μ_i, to be stored for the next step."""
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    mu = momentum_at(beta1, step, momentum_decay)
    mu_next = momentum_at(beta1, step + 1, momentum_decay)
    mu_product *= mu
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = exp_avg_sq.div(1 - beta2**step).sqrt().add_(eps)
    # The discounted gradient (1−μ_t)·g_t, then the look-ahead μ_{t+1}·m_t (next step's momentum).
    param.addcdiv_(grad, denom, value=-lr * (1 - mu) / (1 - mu_product))
    param.addcdiv_(exp_avg, denom, value=-lr * mu_next / (1 - mu_product * mu_next))
    return mu_product


class NAdamW(torch.optim.Optimizer):
    """NAdam with decoupled weight decay: the Nesterov look-ahead for asynchronous pipelines.

    Example::

        opt = NAdamW(decay_groups(stage, 0.01), lr=3e-4)       # β = (0.99, 0.999), ψ = 0.004
        loss.backward(); opt.step(); opt.zero_grad()

    Each microbatch's (stale) gradient is one ``step()``. A scheduler sets ``param_group["lr"]``
    between steps; ``betas`` are read from the group at every step too, so a per-stage β1 (the
    No-WS variant, :func:`~meshlearn.optim.no_ws.no_ws_stage_hparams`) can be set per group.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim`` optimizer.
        lr: η; the official AsyncPP runs use 3e-4 (1e-4 at 1B) with warm-up and cosine decay.
        betas: (β1, β2). β1 = 0.99 is the delay correction: far below it (0.9) the look-ahead
            no longer spans the pipeline's staleness; β2 = 0.999 as in the reference.
        eps: added to the denominator √v̂.
        weight_decay: λ, decoupled (θ ← θ(1 − ηλ)); 0.01 in the reference. Give norm gains and
            biases a group with 0.
        momentum_decay: ψ in μ_t = β1(1 − ½·0.96^{tψ}); larger ψ shortens the momentum warm-up.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.99, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        momentum_decay: float = MOMENTUM_DECAY,
    ) -> None:
        for name, value, ok, allowed in [
            ("lr", lr, lr >= 0, ">= 0"),
            ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two floats in [0, 1)"),
            ("eps", eps, eps >= 0, ">= 0"),
            ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
            ("momentum_decay", momentum_decay, momentum_decay >= 0, ">= 0"),
        ]:
            if not ok:
                raise ValueError(f"NAdamW: {name} must be {allowed}, got {value!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "momentum_decay": momentum_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step for every parameter with a gradient; ``closure`` (optional) re-evaluates and
        returns the loss. A parameter without a gradient keeps its state and its step count."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("NAdamW supports dense real parameters and gradients only")
                state = self.state[p]
                if not state:
                    state["step"] = 0  # this parameter's t: μ_t depends on it, so it is never reset
                    state["mu_product"] = 1.0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["mu_product"] = nadamw_update(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                    state["mu_product"], lr=float(group["lr"]), betas=group["betas"],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    momentum_decay=group["momentum_decay"],
                )
        return loss
