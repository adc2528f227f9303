"""AsyncMesh's asynchronous sparse parameter averaging (and SPARTA / AsyncSPARTA as its settings).

After every ``every``-th update a *round* starts: each replica takes the slice S of every tensor
that the round's partition names, keeps it as the snapshot s and sends it to the other replicas of
its stage. The average a of the replicas' slices is applied ``delay`` updates later, by rule:

    avg    w[S] ← a                                  (AsyncSPARTA; SPARTA when delay = 0)
    delta  w[S] ← a + λ·u,   u = w[S] − s            (the local drift since the snapshot)
    ema    e[S] ← m·e[S] + (1−m)·u,  w[S] ← a + λ·e[S]   (AsyncMesh)

Partitions (method note, open detail 3): tensor i of N elements is permuted by the seeded affine
map j ↦ (a·j + c) mod N, gcd(a, N) = 1, drawn from (seed, ⌊round/K⌋, i); round r takes positions
[⌊kN/K⌋, ⌊(k+1)N/K⌋) of it, k = r mod K, K = ⌈1/fraction⌉. So the K parts of an epoch are disjoint,
cover every element, and every replica derives them alone: no index travels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from meshlearn.dp.base import DPStrategy, Key
from meshlearn.mesh.messages import Message

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # never "step" or other counters


def parts_per_epoch(fraction: float) -> int:
    """K = ⌈1/p⌉ (guarded against 1/0.05 = 20.000000000000004)."""
    return max(1, math.ceil(1.0 / fraction - 1e-9))


def affine_permutation(seed: int, epoch: int, tensor: int, n: int) -> tuple[int, int]:
    """(a, c) of the permutation j ↦ (a·j + c) mod n, identical wherever it is drawn."""
    rng = random.Random(f"meshlearn-sparse:{seed}:{epoch}:{tensor}")
    if n <= 1:
        return 1, 0
    while True:
        a = rng.randrange(1, n)
        if math.gcd(a, n) == 1:
            return a, rng.randrange(n)


def partition(seed: int, round_no: int, tensor: int, n: int, parts: int) -> torch.Tensor:
    """The flat indices round ``round_no`` averages in a tensor of ``n`` elements."""
    epoch, k = divmod(round_no, parts)
    a, c = affine_permutation(seed, epoch, tensor, n)
    j = torch.arange(k * n // parts, (k + 1) * n // parts, dtype=torch.int64)
    return (j * a + c) % n


def ema_coefficient(update: int, m0: float, m1: float, warm: int, end: int) -> float:
    """m = m0 until ``warm``, then a cosine ramp to m1 at ``end`` (the method note's schedule)."""
    if update < warm:
        return m0
    sigma = 1.0 if end <= warm else min(1.0, max(0.0, (update - warm) / (end - warm)))
    return m0 + (m1 - m0) * 0.5 * (1.0 - math.cos(math.pi * sigma))


@dataclass
class Round:
    round_no: int
    snapshot: torch.Tensor  # this replica's slice when the round started
    average: torch.Tensor | None = None  # the replicas' mean, once every part is in
    dropped: bool = False


class SparseAveraging(DPStrategy):
    """``dp.name = sparse``. Parameters only, or also the optimizer's moments (``moments``)."""

    name = "sparse"

    def __init__(self, me, replicas, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 fraction: float, delay: int, every: int, rule: str, lam: float, m0: float,
                 m1: float, warm: int, ramp_end: int, ema_init: str, moments: bool, seed: int,
                 deadline_s: float | None):
        super().__init__(me, replicas)
        self.params = [p for _, p in module.named_parameters()]
        self.optimizer = optimizer
        self.parts = parts_per_epoch(fraction)
        self.delay, self.every, self.rule, self.lam = delay, every, rule, lam
        self.m0, self.m1, self.warm, self.ramp_end = m0, m1, warm, ramp_end
        self.ema_init, self.moments, self.seed = ema_init, moments, seed
        self._deadline_s = deadline_s
        self.pending: dict[int, Round] = {}  # by the update that started it
        self.ema: dict[int, torch.Tensor] = {}  # target index → e (flat), created on first use
        self.seen: dict[int, torch.Tensor] = {}  # per_coordinate init: coordinates with an e
        self.ema_started = False

    # --- what a round covers ------------------------------------------------------------------

    def starts_round(self, u: int) -> bool:
        return (u + 1) % self.every == 0

    def targets(self) -> list[torch.Tensor]:
        """The tensors a round averages: the parameters, then (moments) each one's moment
        tensors in a fixed order."""
        out = list(self.params)
        if self.moments:
            for p in self.params:
                state = self.optimizer.state.get(p, {})
                out += [state[k] for k in MOMENT_KEYS if isinstance(state.get(k), torch.Tensor)
                        and state[k].shape == p.shape]
        return out

    def indices(self, round_no: int) -> list[torch.Tensor]:
        """Per target: the flat indices of the round (moments use their parameter's)."""
        per_param = [partition(self.seed, round_no, i, p.numel(), self.parts)
                     for i, p in enumerate(self.params)]
        out = list(per_param)
        if self.moments:
            for i, p in enumerate(self.params):
                state = self.optimizer.state.get(p, {})
                out += [per_param[i] for k in MOMENT_KEYS if isinstance(state.get(k), torch.Tensor)
                        and state[k].shape == p.shape]
        return out

    def round_numel(self, round_no: int) -> int:
        return sum(i.numel() for i in self.indices(round_no))

    def _gather(self, targets, indices) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1)[i].float() for t, i in zip(targets, indices, strict=True)])

    # --- the phases ---------------------------------------------------------------------------

    def post_step(self, u: int) -> list[Message]:
        if not self.starts_round(u) or self.replicas == 1:
            return []  # one replica: nothing to average with
        round_no = (u + 1) // self.every - 1
        snapshot = self._gather(self.targets(), self.indices(round_no))
        self.pending[u] = Round(round_no, snapshot)
        self.rounds += 1
        return self.share((u, 0), snapshot, u + 1)

    def on_complete(self, key: Key) -> list[Message]:
        average = self.exchange.mean(key)
        pending = self.pending[key[0]]
        if average is None:
            pending.dropped = True
            self.dropped += 1
        else:
            pending.average = average
        return []

    def post_wait(self, u: int) -> Key | None:
        pending = self.pending.get(u - self.delay)
        if pending is None or pending.dropped or pending.average is not None:
            return None
        return (u - self.delay, 0)

    def expire(self, key: Key) -> None:
        pending = self.pending.get(key[0])
        if pending is not None and pending.average is None and not pending.dropped:
            pending.dropped = True
            self.exchange.expire(key)
            self.dropped += 1
        else:
            self.exchange.dropped.add(key)

    def deadline_s(self, key: Key) -> float | None:
        return None if self.delay == 0 else self._deadline_s

    def expects(self, u: int) -> int:
        return 1 if self.starts_round(u) and self.replicas > 1 else 0

    @torch.no_grad()
    def apply(self, u: int) -> None:
        pending = self.pending.pop(u - self.delay, None)
        if pending is None or pending.dropped:
            return
        self.note_score(u, (u - self.delay, 0))
        targets, indices = self.targets(), self.indices(pending.round_no)
        a = pending.average
        if self.rule == "avg":
            new = a
        else:
            drift = self._gather(targets, indices) - pending.snapshot
            if self.rule == "delta":
                new = a + self.lam * drift
            else:
                new = a + self.lam * self._ema(u, targets, indices, drift)
        offset = 0
        for t, (i, idx) in zip(targets, enumerate(indices), strict=True):
            values = new[offset:offset + idx.numel()].to(t.dtype)
            offset += idx.numel()
            if i >= len(self.params) and self._is_second_moment(t):
                values = values.clamp_min(0.0)
            t.data.view(-1)[idx] = values

    def _is_second_moment(self, t: torch.Tensor) -> bool:
        return any(state.get("exp_avg_sq") is t for state in self.optimizer.state.values())

    def _ema(self, u: int, targets, indices, drift: torch.Tensor) -> torch.Tensor:
        m = ema_coefficient(u, self.m0, self.m1, self.warm, self.ramp_end)
        out, offset = [], 0
        first = not self.ema_started
        self.ema_started = True
        for i, (t, idx) in enumerate(zip(targets, indices, strict=True)):
            d = drift[offset:offset + idx.numel()]
            offset += idx.numel()
            e = self.ema.setdefault(i, torch.zeros(t.numel(), dtype=torch.float32))
            if self.ema_init == "first_round":
                value = d.clone() if first else m * e[idx] + (1.0 - m) * d
            else:
                seen = self.seen.setdefault(i, torch.zeros(t.numel(), dtype=torch.bool))
                value = torch.where(seen[idx], m * e[idx] + (1.0 - m) * d, d)
                seen[idx] = True
            e[idx] = value
            out.append(value)
        return torch.cat(out)

    def post_rounds(self, u: int) -> bool:
        return self.replicas > 1 and self.starts_round(u)

    def reset_local(self) -> None:
        """The drift starts anew from here: every open round's snapshot ← the current slice, and
        the ema of the drift starts over (both are this replica's own); the averages are kept."""
        self.ema, self.seen, self.ema_started = {}, {}, False
        for pending in self.pending.values():
            pending.snapshot = self._gather(self.targets(), self.indices(pending.round_no))

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return super().state_dict() | {
            "pending": {u: vars(r).copy() for u, r in self.pending.items()},
            "ema": dict(self.ema), "seen": dict(self.seen), "ema_started": self.ema_started}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pending = {int(u): Round(**r) for u, r in state["pending"].items()}
        self.ema, self.seen = dict(state["ema"]), dict(state["seen"])
        self.ema_started = state["ema_started"]
