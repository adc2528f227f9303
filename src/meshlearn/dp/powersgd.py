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
from meshlearn.mesh.messages import Message


class PowerSGD(DPStrategy):
    name = "powersgd"
    drifts = False  # every replica steps on the same Ĝ

    def __init__(self, me, replicas, module: torch.nn.Module, *, rank: int, seed: int):
        super().__init__(me, replicas)
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.rank = rank
        self.matrices = [i for i, p in enumerate(self.params) if p.dim() >= 2]
        self.vectors = [i for i, p in enumerate(self.params) if p.dim() < 2]
        gen = torch.Generator().manual_seed(seed * 1009 + me.stage)
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[int, torch.Tensor] = {}
        for i in self.matrices:
            n, m = self.shape(i)
            self.q[i] = self._initial_q(m, min(rank, n, m), gen)  # identical on every replica
        self._work: dict[int, dict] = {}
        self._done: set[int] = set()

    @staticmethod
    def _initial_q(m: int, r: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(m, r, generator=gen)

    def shape(self, i: int) -> tuple[int, int]:
        p = self.params[i]
        return p.shape[0], p.numel() // p.shape[0]

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def wire_values(self) -> tuple[int, int]:
        """fp32 values per peer message of phase 0 and of phase 1 (the byte formula / 4)."""
        phase0 = sum(self.shape(i)[0] * self.q[i].shape[1] for i in self.matrices)
        phase0 += sum(self.params[i].numel() for i in self.vectors)
        phase1 = sum(self.shape(i)[1] * self.q[i].shape[1] for i in self.matrices)
        return phase0, phase1

    @torch.no_grad()
    def pre_step(self, u: int) -> list[Message]:
        ms, ps = {}, []
        for i in self.matrices:
            n, m = self.shape(i)
            M = self._grad(i).reshape(n, m).float() + self.error.get(i, 0.0)
            ms[i] = M
            ps.append((M @ self.q[i]).reshape(-1))
        ps += [self._grad(i).reshape(-1).float() for i in self.vectors]
        self._work[u] = {"M": ms}
        self.rounds += 1
        if self.replicas == 1:
            self._phase1(u, torch.cat(ps))
            return self._phase2(u, None)
        return self.share((u, 0), torch.cat(ps), u)

    def on_complete(self, key) -> list[Message]:
        mean = self.exchange.mean(key)
        if mean is None:
            raise RuntimeError(f"worker {self.me}: a peer's PowerSGD factors for update {key[0]} "
                               "are misshapen; a blocking strategy cannot drop a round")
        u, phase = key
        self.note_score(u, key)  # both rounds are merged at u, into Ĝ
        return self._phase1(u, mean) if phase == 0 else self._phase2(u, mean)

    def _phase1(self, u: int, mean_p: torch.Tensor) -> list[Message]:
        work, offset, qs = self._work[u], 0, []
        work["P"], work["vectors"] = {}, {}
        for i in self.matrices:
            n, r = self.shape(i)[0], self.q[i].shape[1]
            P = torch.linalg.qr(mean_p[offset:offset + n * r].reshape(n, r)).Q
            offset += n * r
            work["P"][i] = P
            qs.append((work["M"][i].T @ P).reshape(-1))
        for i in self.vectors:
            k = self.params[i].numel()
            work["vectors"][i] = mean_p[offset:offset + k]
            offset += k
        work["Q_local"] = torch.cat(qs) if qs else torch.zeros(0)
        if self.replicas == 1:
            return []
        return self.share((u, 1), work["Q_local"], u)

    def _phase2(self, u: int, mean_q: torch.Tensor | None) -> list[Message]:
        work = self._work.pop(u)
        mean_q = work["Q_local"] if mean_q is None else mean_q
        offset = 0
        own = self.robust.gathers  # the error against this replica's own Q (module docstring)
        for i in self.matrices:
            n, m = self.shape(i)
            r = self.q[i].shape[1]
            Q = mean_q[offset:offset + m * r].reshape(m, r)
            approx = work["P"][i] @ Q.T
            kept = work["P"][i] @ work["Q_local"][offset:offset + m * r].reshape(m, r).T if own else approx
            offset += m * r
            self.error[i] = work["M"][i] - kept
            self.q[i] = Q.clone()  # warm start
            self._set_grad(i, approx)
        for i, g in work["vectors"].items():
            self._set_grad(i, g)
        self._done.add(u)
        return []

    def _set_grad(self, i: int, value: torch.Tensor) -> None:
        p = self.params[i]
        p.grad = value.reshape(p.shape).to(p.dtype).clone()

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
        self.error = {}

    def basis_state(self) -> dict[str, BasisTensor]:
        # Matrices only: vectors keep no error, and a morph multiplies matrices.
        return {f"error.{self.names[i]}": BasisTensor(self.names[i], "gradient", e)
                for i, e in self.error.items() if self.params[i].dim() == 2}

    def state_dict(self) -> dict:
        return super().state_dict() | {"q": dict(self.q), "error": dict(self.error)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q, self.error = dict(state["q"]), dict(state["error"])
