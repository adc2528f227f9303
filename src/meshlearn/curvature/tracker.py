"""Warm-started curvature estimates over a run: one power-iteration state per named parameter set.

Each estimate starts from the previous one's eigenvector (Theorem 1 of the paper: the top
eigenvector moves by at most ‖ΔH‖/γ between steps, so a few products suffice; fewer than 5 per step
in the paper). Vectors are kept per parameter *name*, so a parameter set that grows (a block
unlocked by architecture warm-up) keeps its old components and starts the new ones at random. For
the preconditioned estimate the previous vector is carried into the new preconditioner first:
v ← P_k^{1/2} P_{k−1}^{−1/2} v_{k−1}. State: one parameter-sized vector per estimate, plus the
previous P for preconditioned ones.

Power iteration finds the eigenvalue of largest magnitude. When that is negative (a saddle
direction, or early Adam steps with tiny second moments), or when the iteration did not settle
(relative residual above ``RESIDUAL_RERUN``: eigenvalues of both signs with similar magnitudes make
it oscillate), the estimate reruns on A − σI with σ = λ_neg (or −‖A‖), whose dominant eigenvalue is
λ_max − σ, so the value reported is the top (algebraically largest) eigenvalue — the one the
stability thresholds are about; ``Eigen.hvps`` counts both runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from meshlearn.curvature.power import Eigen, HessianOperator, power_iteration

RESIDUAL_RERUN = 0.1


class CurvatureTracker:
    def __init__(self, iters: int, seed: int):
        self.iters = iters
        self.generator = torch.Generator().manual_seed(seed)
        self.vectors: dict[str, dict[str, Tensor]] = {}  # estimate → parameter name → component
        self.precond: dict[str, dict[str, Tensor]] = {}  # estimate → parameter name → previous P

    def start(self, key: str, names: Sequence[str], params: Sequence[Tensor],
              precond: Sequence[Tensor] | None) -> list[Tensor]:
        """The warm start of estimate ``key`` (random components where there is no previous one)."""
        old = self.vectors.get(key, {})
        prev_p = self.precond.get(key, {})
        v = []
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            if name in old and old[name].shape == p.shape:
                x = old[name]
                if precond is not None and name in prev_p:
                    x = x * (precond[i] / prev_p[name]).sqrt()
            else:
                x = torch.randn(p.shape, generator=self.generator, dtype=torch.float64)
                if old:  # match the scale of a unit vector spread over the whole set
                    x = x * (1.0 / max(1, sum(q.numel() for q in params)) ** 0.5)
            v.append(x.to(p.dtype))
        return v

    def estimate(self, key: str, operator: HessianOperator, indices: Sequence[int], names: Sequence[str],
                 precond: Sequence[Tensor] | None = None) -> Eigen:
        """Warm-started λ_max of H (or of P^{-1/2} H P^{-1/2}) restricted to ``indices`` of the
        operator's parameters (all of them: the full value; one stage's: a diagonal block)."""
        params = [operator.params[i] for i in indices]
        v0 = self.start(key, names, params, precond)
        eig = power_iteration(lambda v: operator(v, indices), v0, self.iters, precond)
        self.vectors[key] = {n: x.detach().clone() for n, x in zip(names, eig.vector, strict=True)}
        if eig.value < 0 or eig.residual > RESIDUAL_RERUN:
            top = f"{key}+"
            start = self.start(top, names, params, precond)
            shift = eig.value if eig.value < 0 and eig.residual <= RESIDUAL_RERUN else -eig.scale
            pos = power_iteration(lambda v: operator(v, indices), start, self.iters, precond,
                                  shift=shift)
            self.vectors[top] = {n: x.detach().clone() for n, x in zip(names, pos.vector, strict=True)}
            if precond is not None:
                self.precond[top] = {n: p.detach().clone() for n, p in zip(names, precond, strict=True)}
            eig = Eigen(pos.value, pos.vector, pos.history, eig.hvps + pos.hvps, pos.residual, eig.scale)
        if precond is not None:
            self.precond[key] = {n: p.detach().clone() for n, p in zip(names, precond, strict=True)}
        return eig

    def state_dict(self) -> dict:
        return {"vectors": self.vectors, "precond": self.precond, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.vectors, self.precond = state["vectors"], state["precond"]
        self.generator.set_state(state["generator"])
