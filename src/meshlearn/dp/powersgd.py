"""PowerSGD (Vogels et al. 2019): gradients averaged as rank-r factors, with error feedback.

Per matrix gradient G (n × m, a tensor viewed as (shape[0], rest)), r = min(dp.rank, n, m):

    M = G + e;  P = M·Q  (Q warm-started: the previous update's averaged Q)
    P ← mean over replicas (round phase 0), orthonormalized (QR)
    Q = Mᵀ·P;  Q ← mean over replicas (phase 1)
    Ĝ = P·Qᵀ;  e ← M − Ĝ;  the optimizer steps on Ĝ

Vectors (norm gains) travel uncompressed in phase 0. Both phases are waited for (the update needs
Ĝ). At r = min(n, m) the factors span the mean gradient's columns and Ĝ is the all-reduce's mean.

Under a robust rule (``dp.robust``) the error is what compression left out of this replica's own
M, e ← M − P·Q_iᵀ with its own Q_i = Mᵀ·P, not M − P·Qᵀ with the robust aggregate Q: the latter
also keeps what the rule left out of this replica's factors, which it sends again, larger, next
update, so a replica the rule trims once stays an outlier and the stage's Ĝ drifts (measured in
docs/dp_robust.md).
Under the mean both errors sum to the same Σ M − D·P·Qᵀ over the replicas, and the mean factors
depend on that sum only, so the mean keeps its original expression (bit for bit as before).
The arithmetic is ``dp.lowrank.LowRankCompressor``'s (one compressor over the stage's parameters,
seeded per stage); this strategy applies its estimate as the gradients.
Wire: phase 0 sends Σ n·r + Σ vector sizes fp32 values to each peer, phase 1 Σ m·r.

Under a change of basis of a weight's output side (W ← L·W, a protocol model's morph; torch's
(out, in) layout) the error e moves as a gradient (``basis_state``). The warm-start Q lives on the
input side and needs nothing: with G' = L^{−T}·G, P' = L^{−T}·P spans the image of P, so
Ĝ' = P'P'ᵀ·M' = L^{−T}·Ĝ for orthogonal L (the QR may flip P's column signs, which Q then
carries; Ĝ does not see them).
"""

from __future__ import annotations

import torch

from meshlearn.basis import BasisTensor
from meshlearn.dp.base import DPStrategy
from meshlearn.dp.lowrank import LowRankCompressor
from meshlearn.mesh.messages import Message


class PowerSGD(DPStrategy):
    name = "powersgd"
    drifts = False  # every replica steps on the same Ĝ

    def __init__(self, me, replicas, module: torch.nn.Module, *, rank: int, seed: int):
        super().__init__(me, replicas)
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.compressor = self._compressor([p.shape for p in self.params], rank, seed * 1009 + me.stage)
        self._done: set[int] = set()

    @staticmethod
    def _compressor(shapes: list[torch.Size], rank: int, seed: int) -> LowRankCompressor:
        return LowRankCompressor(shapes, rank, seed)  # the same seeded Q on every replica

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def wire_values(self) -> tuple[int, int]:
        """fp32 values per peer message of phase 0 and of phase 1 (the byte formula / 4)."""
        return self.compressor.wire_values()

    @torch.no_grad()
    def pre_step(self, u: int) -> list[Message]:
        factors = self.compressor.phase0((u, 0), [self._grad(i) for i in range(len(self.params))])
        self.rounds += 1
        if self.replicas == 1:
            return self._apply(u, self.compressor.phase1((u, 0), factors))
        return self.share((u, 0), factors, u)

    def on_complete(self, key) -> list[Message]:
        mean = self.exchange.mean(key)
        if mean is None:
            raise RuntimeError(f"worker {self.me}: a peer's PowerSGD factors for update {key[0]} "
                               "are misshapen; a blocking strategy cannot drop a round")
        u, phase = key
        self.note_score(u, key)  # both rounds are merged at u, into Ĝ
        if phase == 0:
            return self.share((u, 1), self.compressor.phase1((u, 0), mean), u)
        return self._apply(u, mean)

    def _apply(self, u: int, mean_q: torch.Tensor) -> list[Message]:
        """Round 1's average in: Ĝ becomes every parameter's gradient. Under a robust rule the
        error is against this replica's own Q (module docstring)."""
        estimate = self.compressor.finish((u, 0), mean_q, own=self.robust.gathers)
        for p, value in zip(self.params, estimate, strict=True):
            p.grad = value.to(p.dtype).clone()
        self._done.add(u)
        return []

    def pre_ready(self, u: int) -> bool:
        return u in self._done

    def post_step(self, u: int) -> list[Message]:
        self._done.discard(u)
        return []

    def expects(self, u: int) -> int:
        return 2 if self.replicas > 1 else 0

    def reset_local(self) -> None:
        """Error feedback ← 0: the residual is each replica's own (the warm-start Q, the
        replicas' common average, is kept)."""
        self.compressor.error = {}

    def basis_state(self) -> dict[str, BasisTensor]:
        # Matrices only: vectors keep no error, and a morph multiplies matrices.
        return {f"error.{self.names[i]}": BasisTensor(self.names[i], "gradient", e)
                for i, e in self.compressor.error.items() if self.params[i].dim() == 2}

    def state_dict(self) -> dict:
        return super().state_dict() | self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state)
