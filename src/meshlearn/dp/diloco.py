"""Streaming DiLoCo (Douillard et al. 2025): replicas train alone; parameter fragments sync in turn.

Every replica keeps the outer weights θ_outer (the last synced point) and an outer momentum. The
stage's tensors are cut into ``fragments`` contiguous groups; fragment f syncs after update u when
(u + 1) mod H = ⌊f·H/F⌋ (H = ``inner_steps``), so syncs are staggered. A sync averages the
pseudo-gradient Δ = θ_outer − θ_local over the replicas, takes an outer Nesterov-SGD step on
θ_outer (lr ``outer_lr``, momentum ``outer_momentum``), and ``overlap`` updates later merges
θ_local ← α·θ_outer + (1−α)·θ_local (α = ``merge_weight``). With overlap 0 the round is waited
for; otherwise it runs behind the inner steps and is dropped if it misses its deadline.

With ``compress = "powersgd"`` (the method note's DP mode B) the pseudo-gradient travels as rank-r
PowerSGD factors with error feedback (``dp.lowrank``): a sync is two rounds, P under the key
(u, f) and Q under (u, F + f), and the outer step takes the factors' product in place of the mean.

With H = 1, one fragment, no overlap, α = 1 and an outer step of lr 1 without momentum,
θ_outer ← mean of θ_local: synchronous parameter averaging (= all-reduce under plain SGD).

Under a change of basis W ← L·W (a protocol model's morph) the outer weights and the outer
momentum (a sum of weight differences) move as weights (``basis_state``); a merge still pending
(``overlap`` > 0) reads θ_outer when it applies, so it lands in the new basis too. All of it is
linear, so DiLoCo on the morphed model is the morphed DiLoCo trajectory for any invertible L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlearn.basis import BasisTensor
from meshlearn.dp.base import DPStrategy, Key
from meshlearn.dp.lowrank import LowRankCompressor
from meshlearn.mesh.messages import Message


@dataclass
class Sync:
    fragment: int
    merged: list[torch.Tensor] | None = None  # the new θ_outer of the fragment, once complete
    dropped: bool = False
    factored: bool = False  # compressed: round 0 (P) is done, round 1 (Q) is under way


class StreamingDiLoCo(DPStrategy):
    name = "diloco"

    def __init__(self, me, replicas, module: torch.nn.Module, *, inner_steps: int, fragments: int,
                 overlap: int, outer_lr: float, outer_momentum: float, merge_weight: float,
                 deadline_s: float | None, compress: str = "none", rank: int = 4, seed: int = 0):
        super().__init__(me, replicas)
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.H, self.overlap = inner_steps, overlap
        self.outer_lr, self.mu, self.alpha = outer_lr, outer_momentum, merge_weight
        self._deadline_s = deadline_s
        n = len(self.params)
        count = min(fragments, n)
        bounds = [f * n // count for f in range(count + 1)]
        self.fragments = [list(range(bounds[f], bounds[f + 1])) for f in range(count)]
        self.offsets = [f * inner_steps // count for f in range(count)]
        self.outer = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.pending: dict[Key, Sync] = {}
        # One compressor per fragment, seeded alike on every replica (None: the mean travels whole).
        self.compressors = None if compress == "none" else [
            LowRankCompressor([self.params[i].shape for i in frag], rank, seed * 1009 + me.stage * 31 + f)
            for f, frag in enumerate(self.fragments)]

    def agreed_weights(self) -> dict[str, torch.Tensor]:
        """θ_outer of every fragment as of its last sync: identical on every replica."""
        return dict(zip(self.names, self.outer, strict=True))

    def sync_key(self, key: Key) -> Key:
        """The sync a round key belongs to: (u, f) for round 0, (u, F + f) for round 1."""
        return key[0], key[1] % len(self.fragments)

    def syncing(self, u: int) -> list[int]:
        return [f for f, off in enumerate(self.offsets) if (u + 1) % self.H == off % self.H]

    def fragment_numel(self, f: int) -> int:
        return sum(self.params[i].numel() for i in self.fragments[f])

    @torch.no_grad()
    def post_step(self, u: int) -> list[Message]:
        if self.replicas == 1:
            return []
        out = []
        for f in self.syncing(u):
            delta = torch.cat([(self.outer[i] - self.params[i].detach()).reshape(-1).float()
                               for i in self.fragments[f]])
            self.pending[(u, f)] = Sync(f)
            self.rounds += 1
            if self.compressors is not None:
                delta = self.compressors[f].phase0((u, f), list(self._split(f, delta)))
            out += self.share((u, f), delta, u + 1)
        return out

    def _split(self, f: int, flat: torch.Tensor):
        """A fragment's flat vector → its tensors' shapes, in order."""
        offset = 0
        for i in self.fragments[f]:
            k = self.params[i].numel()
            yield flat[offset:offset + k].reshape(self.params[i].shape)
            offset += k

    @torch.no_grad()
    def on_complete(self, key: Key) -> list[Message]:
        mean = self.exchange.mean(key)
        sync_key = self.sync_key(key)
        sync = self.pending[sync_key]
        if mean is None:
            self.expire(sync_key)
            return []
        if self.compressors is not None:
            compressor = self.compressors[sync.fragment]
            if not sync.factored:  # round 0's P: start round 1
                sync.factored = True
                q = compressor.phase1(sync_key, mean)
                return self.share((key[0], len(self.fragments) + sync.fragment), q, key[0] + 1)
            deltas = compressor.finish(sync_key, mean, own=self.robust.gathers)
        else:
            deltas = list(self._split(sync.fragment, mean))
        for i, delta in zip(self.fragments[sync.fragment], deltas, strict=True):
            delta = delta.to(self.params[i].dtype)
            if self.mu > 0:  # torch.optim.SGD(nesterov=True) on the pseudo-gradient
                self.momentum[i].mul_(self.mu).add_(delta)
                delta = delta + self.mu * self.momentum[i]
            self.outer[i] = self.outer[i] - self.outer_lr * delta
        sync.merged = [self.outer[i] for i in self.fragments[sync.fragment]]
        return []

    def post_wait(self, u: int) -> Key | None:
        for key, sync in self.pending.items():
            if key[0] == u - self.overlap and sync.merged is None and not sync.dropped:
                return (key[0], len(self.fragments) + sync.fragment) if sync.factored else key
        return None

    def expire(self, key: Key) -> None:
        key = self.sync_key(key)
        sync = self.pending.get(key)
        if sync is not None and sync.merged is None and not sync.dropped:
            sync.dropped = True
            self.exchange.expire(key)
            if self.compressors is not None:  # both rounds: late parts of either are ignored
                self.exchange.expire((key[0], len(self.fragments) + sync.fragment))
                self.compressors[sync.fragment].discard(key)
            self.dropped += 1

    def deadline_s(self, key: Key) -> float | None:
        return None if self.overlap == 0 else self._deadline_s

    def expects(self, u: int) -> int:
        rounds = 1 if self.compressors is None else 2
        return rounds * len(self.syncing(u)) if self.replicas > 1 else 0

    @torch.no_grad()
    def apply(self, u: int) -> None:
        for key in [k for k in self.pending if k[0] == u - self.overlap]:
            sync = self.pending.pop(key)
            if sync.merged is None:
                continue
            self.note_score(u, key)
            if self.compressors is not None:  # the Q round of the same sync
                self.note_score(u, (key[0], len(self.fragments) + sync.fragment))
            for i in self.fragments[sync.fragment]:
                p = self.params[i]
                p.data.copy_(self.alpha * self.outer[i] + (1.0 - self.alpha) * p.data
                             if self.alpha < 1 else self.outer[i])

    def post_rounds(self, u: int) -> bool:
        return self.replicas > 1 and bool(self.syncing(u))

    @torch.no_grad()
    def reset_local(self) -> None:
        """θ_local ← θ_outer (the stage's last synced point: a joiner does not take over its
        healer's private inner progress, and a spectator's pseudo-gradient is 0), and the
        compressors' error feedback ← 0 (each replica's own residual). θ_outer, the outer
        momentum and the compressors' warm-start Q are the stage's: kept."""
        for p, outer in zip(self.params, self.outer, strict=True):
            p.data.copy_(outer)
        for compressor in self.compressors or ():
            compressor.error = {}

    def basis_state(self) -> dict[str, BasisTensor]:
        out = {}
        for n, outer, momentum in zip(self.names, self.outer, self.momentum, strict=True):
            out[f"outer.{n}"] = BasisTensor(n, "weight", outer)
            out[f"momentum.{n}"] = BasisTensor(n, "weight", momentum)  # sums of weight differences
        return out

    def state_dict(self) -> dict:
        compressors = [c.state_dict() for c in self.compressors or ()]
        return super().state_dict() | {"outer": self.outer, "momentum": self.momentum,
                                       "compressors": compressors,
                                       "pending": {f"{k[0]}:{k[1]}": vars(s).copy()
                                                   for k, s in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer, self.momentum = state["outer"], state["momentum"]
        for compressor, saved in zip(self.compressors or (), state.get("compressors", ()), strict=False):
            compressor.load_state_dict(saved)
        self.pending = {}
        for text, sync in state["pending"].items():
            a, b = text.split(":")
            self.pending[(int(a), int(b))] = Sync(**sync)
