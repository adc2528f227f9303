"""PowerSGD's compression of a list of tensors, as two rounds of averaging (for any strategy).

The one copy of PowerSGD's arithmetic (Vogels et al. 2019), detached from gradients so a strategy
can compress what it averages: ``dp.powersgd.PowerSGD`` applies it to the gradients, streaming
DiLoCo to its pseudo-gradients (``dp.compress = powersgd``, the method note's DP mode B). Per
matrix T (a tensor viewed as (shape[0], rest)), r = min(rank, n, m), with error feedback e and a
warm-started Q:

    M = T + e;  P = M·Q             → round 0 averages P (vectors travel whole in it)
    P ← orthonormal(mean P);  Q = Mᵀ·P   → round 1 averages Q
    T̂ = P·Qᵀ;  e ← M − T̂;  Q kept for the next round (warm start)

Every replica starts from the same seeded Q, so the averaged factors are the same everywhere and
T̂ is the replicas' common estimate of the mean. A round that is dropped leaves e and Q as they were.
Under a robust rule the error is M − P·Q_iᵀ with this replica's own Q_i (``finish(own=True)``): what
the rule left out must not be fed back (``dp.powersgd``'s docstring says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlearn.dp.base import Key


@dataclass
class _Work:
    ms: dict[int, torch.Tensor]  # M = T + e per matrix
    ps: dict[int, torch.Tensor] = field(default_factory=dict)  # orthonormalized mean P
    qs: dict[int, torch.Tensor] = field(default_factory=dict)  # this replica's own Q = Mᵀ·P
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)


class LowRankCompressor:
    """Two-round PowerSGD over tensors of fixed ``shapes`` (one compressor per set that syncs
    together, e.g. a DiLoCo fragment); work in progress is kept per round key."""

    def __init__(self, shapes: list[torch.Size], rank: int, seed: int, *, draw_q: bool = True):
        """``draw_q = False``: sizes only (the planner's cost-only strategies never compress)."""
        self.shapes = [torch.Size(s) for s in shapes]
        self.matrices = [i for i, s in enumerate(self.shapes) if len(s) >= 2]
        self.vectors = [i for i, s in enumerate(self.shapes) if len(s) < 2]
        self.ranks = {i: min(rank, *self._nm(i)) for i in self.matrices}
        gen = torch.Generator().manual_seed(seed)
        self.q = {i: torch.randn(self._nm(i)[1], self.ranks[i], generator=gen)
                  for i in self.matrices} if draw_q else {}
        self.error: dict[int, torch.Tensor] = {}
        self._work: dict[Key, _Work] = {}

    def _nm(self, i: int) -> tuple[int, int]:
        s = self.shapes[i]
        return s[0], s.numel() // s[0]

    def wire_values(self) -> tuple[int, int]:
        """Values each replica sends each peer in round 0 and in round 1 (fp32: 4 bytes each)."""
        phase0 = sum(self._nm(i)[0] * self.ranks[i] for i in self.matrices)
        phase0 += sum(self.shapes[i].numel() for i in self.vectors)
        return phase0, sum(self._nm(i)[1] * self.ranks[i] for i in self.matrices)

    @torch.no_grad()
    def phase0(self, key: Key, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This replica's part of round 0 for ``tensors``."""
        ms, parts = {}, []
        for i in self.matrices:
            m = tensors[i].reshape(self._nm(i)).float() + self.error.get(i, 0.0)
            ms[i] = m
            parts.append((m @ self.q[i]).reshape(-1))
        parts += [tensors[i].reshape(-1).float() for i in self.vectors]
        self._work[key] = _Work(ms)
        return torch.cat(parts) if parts else torch.zeros(0)

    @torch.no_grad()
    def phase1(self, key: Key, mean_p: torch.Tensor) -> torch.Tensor:
        """Round 0's average in; this replica's part of round 1 out."""
        work, offset, parts = self._work[key], 0, []
        for i in self.matrices:
            n, r = self._nm(i)[0], self.ranks[i]
            work.ps[i] = torch.linalg.qr(mean_p[offset:offset + n * r].reshape(n, r)).Q
            offset += n * r
            work.qs[i] = work.ms[i].T @ work.ps[i]
            parts.append(work.qs[i].reshape(-1))
        for i in self.vectors:
            k = self.shapes[i].numel()
            work.vectors[i] = mean_p[offset:offset + k]
            offset += k
        return torch.cat(parts) if parts else torch.zeros(0)

    @torch.no_grad()
    def finish(self, key: Key, mean_q: torch.Tensor, own: bool = False) -> list[torch.Tensor]:
        """Round 1's average in: the estimate of the mean of every tensor (fp32, its shape).
        ``own``: the error against this replica's own Q (a robust rule; module docstring)."""
        work, offset = self._work.pop(key), 0
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for i in self.matrices:
            m, r = self._nm(i)[1], self.ranks[i]
            q = mean_q[offset:offset + m * r].reshape(m, r)
            offset += m * r
            approx = work.ps[i] @ q.T
            self.error[i] = work.ms[i] - (work.ps[i] @ work.qs[i].T if own else approx)
            self.q[i] = q.clone()
            out[i] = approx.reshape(self.shapes[i])
        for i, v in work.vectors.items():
            out[i] = v.reshape(self.shapes[i])
        return out

    def discard(self, key: Key) -> None:
        """Round ``key`` was dropped: forget its work (e and Q stay as they were)."""
        self._work.pop(key, None)

    def state_dict(self) -> dict:
        return {"q": dict(self.q), "error": dict(self.error)}

    def load_state_dict(self, state: dict) -> None:
        self.q, self.error = dict(state["q"]), dict(state["error"])
