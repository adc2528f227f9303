"""Warm-started curvature estimates over a run: one Lanczos state per named parameter set.

Each estimate starts from the previous one's top Ritz vector (Theorem 1 of the paper: the top
eigenvector moves by at most ‖ΔH‖/γ between steps), so when the Hessian moved little the residual
test stops after a few products; ``iters`` caps the products of one estimate. Vectors are kept per
parameter *name*, so a parameter set that grows (a block unlocked by architecture warm-up) keeps its
old components and starts the new ones at random. For the preconditioned estimate the previous
vector is carried into the new preconditioner first: v ← P_k^{1/2} P_{k−1}^{−1/2} v_{k−1}. State:
one parameter-sized vector per estimate, plus the previous P for preconditioned ones.

Lanczos returns the top (algebraically largest) eigenvalue whatever the signs, so there is no
shifted rerun: the value is the top Ritz value, flagged ``converged`` when its relative residual
‖Av − θv‖/|θ| is ≤ ``tol``. An unconverged value is a lower bound on λ_max, never an overshoot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from meshlearn.curvature.lanczos import lanczos
from meshlearn.curvature.power import Eigen, HessianOperator

WARM_MIX = 0.3
"""Weight of the random unit vector mixed into each warm start (``CurvatureTracker.start``)."""


class CurvatureTracker:
    def __init__(self, iters: int, seed: int, tol: float = 1e-2):
        self.iters, self.tol = iters, tol
        self.generator = torch.Generator().manual_seed(seed)
        self.vectors: dict[str, dict[str, Tensor]] = {}  # estimate → parameter name → component
        self.precond: dict[str, dict[str, Tensor]] = {}  # estimate → parameter name → previous P

    def start(self, key: str, names: Sequence[str], params: Sequence[Tensor],
              precond: Sequence[Tensor] | None) -> list[Tensor]:
        """The warm start of estimate ``key``: the previous Ritz vector plus ``WARM_MIX`` of a fresh
        random unit vector (random components where there is no previous one). Started on the
        previous vector alone, Lanczos can converge on that eigenvector while a larger eigenvalue
        has overtaken it (its Krylov space barely sees other directions): measured, a converged
        preconditioned estimate 13% below a cold start (docs/warmup.md). The random share keeps
        every direction in the Krylov space at the price of a few more products."""
        old = self.vectors.get(key, {})
        prev_p = self.precond.get(key, {})
        numel = max(1, sum(q.numel() for q in params))
        warm, fresh = [], []
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            noise = torch.randn(p.shape, generator=self.generator, dtype=torch.float64) / numel ** 0.5
            if name in old and old[name].shape == p.shape:
                x = old[name].to(torch.float64)
                if precond is not None and name in prev_p:
                    x = x * (precond[i] / prev_p[name]).sqrt().to(torch.float64)
            else:
                x = noise if not old else torch.zeros_like(noise)
            warm.append(x)
            fresh.append(noise)
        if not old:
            return [x.to(p.dtype) for x, p in zip(warm, params, strict=True)]
        norm = sum(float((x * x).sum()) for x in warm) ** 0.5 or 1.0
        return [(x / norm + WARM_MIX * r).to(p.dtype) for x, r, p in zip(warm, fresh, params, strict=True)]

    def estimate(self, key: str, operator: HessianOperator, indices: Sequence[int], names: Sequence[str],
                 precond: Sequence[Tensor] | None = None, v0: Sequence[Tensor] | None = None) -> Eigen:
        """Warm-started λ_max of H (or of P^{-1/2} H P^{-1/2}) restricted to ``indices`` of the
        operator's parameters (all of them: the full value; one stage's: a diagonal block);
        ``v0`` overrides the warm start."""
        indices = list(indices)
        params = [operator.params[i] for i in indices]
        if v0 is None:
            v0 = self.start(key, names, params, precond)
        eig = lanczos(lambda v: operator(v, indices), v0, self.iters, precond, self.tol)
        self.vectors[key] = {n: x.detach().clone() for n, x in zip(names, eig.vector, strict=True)}
        if precond is not None:
            self.precond[key] = {n: p.detach().clone() for n, p in zip(names, precond, strict=True)}
        return eig

    def reconcile(self, key: str, operator: HessianOperator, indices: Sequence[int], names: Sequence[str],
                  full: Eigen, blocks: dict[str, Eigen | None],
                  precond: Sequence[Tensor] | None = None) -> tuple[Eigen, bool]:
        """The full estimate ``key``, checked against converged estimates of its diagonal blocks
        (``blocks``: tracker key → estimate). A block's λ_max cannot exceed the full one, so a block
        above the full value by more than ``tol`` means the warm start locked onto a lower
        eigenvector (it happens after a new direction overtakes the old top: measured on 4 stages
        after an unlock). Then the full estimate reruns from that block's Ritz vector, zero
        elsewhere, whose Rayleigh quotient is the block's value, so the rerun's Ritz value is at
        least that. Returns (estimate, whether it reran); the rerun's ``hvps`` include the first run's."""
        done = [k for k, e in blocks.items() if e is not None and e.converged]
        best = max(done, key=lambda k: blocks[k].value, default=None)
        if best is None or blocks[best].value <= full.value + self.tol * abs(full.value):
            return full, False
        part = self.vectors[best]
        params = [operator.params[i] for i in indices]
        v0 = [part[n].to(p.dtype) if n in part else torch.zeros_like(p)
              for n, p in zip(names, params, strict=True)]
        eig = self.estimate(key, operator, indices, names, precond, v0=v0)
        eig.hvps += full.hvps
        return eig, True

    def state_dict(self) -> dict:
        return {"vectors": self.vectors, "precond": self.precond, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.vectors, self.precond = state["vectors"], state["precond"]
        self.generator.set_state(state["generator"])
