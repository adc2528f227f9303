"""Cost-only DP strategies for ``meshlearn plan``: the real strategies over meta-device modules.

A cost-only worker (``Worker(cost_only=...)``) holds its stage on the meta device: every tensor
has its shape and dtype but no values. The strategies' phases, round schedules, deadlines and
message sizes are their own code; only what needs values is replaced here:

- ``CostExchange.receive`` keeps a peer's part without the finiteness check (a meta tensor has no
  values to check);
- sparse averaging counts a round's indices in closed form (the partition's slice lengths,
  ⌊(k+1)N/K⌋ − ⌊kN/K⌋ per tensor) instead of materializing them, and its ``apply`` merges nothing.

- PowerSGD sends its two phases at the sizes of its own ``wire_values`` and streaming DiLoCo
  each fragment's ``fragment_numel``, with their phase logic (pre_ready, post_wait, deadlines,
  which fragments sync at which update) inherited unchanged.

(Meta arithmetic would give the same sizes, but every meta op runs through Python decompositions:
seconds per simulated step.)
"""

from __future__ import annotations

import functools

import torch

from meshlearn.compress.codecs import SizedEncoded
from meshlearn.dp.base import DPStrategy, Exchange, Key
from meshlearn.dp.diloco import StreamingDiLoCo, Sync
from meshlearn.dp.lowrank import LowRankCompressor
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.dp.registry import _deadline, builder_of, robust_of
from meshlearn.dp.sparse import Round, SparseAveraging
from meshlearn.mesh.messages import Message


class CostExchange(Exchange):
    def share(self, key: Key, values: torch.Tensor, version: int) -> list[Message]:
        """``Exchange.share`` of a round's meta values (``_values``: already flat, no grad), with
        one payload per round size: its wire size is counted once, not per message."""
        payload = _payload(values.numel())
        self.parts.setdefault(key, {})[self.me.replica] = values
        return [Message("dp", key[0], key[1], self.me, peer, payload, version=version)
                for peer in self.peers]

    def receive(self, message: Message) -> Key | None:
        key = (message.step, message.microbatch)
        if key in self.dropped:
            return None
        self.parts.setdefault(key, {})[message.src.replica] = message.payload.tensors["values"]
        return key if self.complete(key) else None

    def mean(self, key: Key) -> torch.Tensor | None:
        parts = self.parts.pop(key)
        return parts[self.me.replica]  # a meta tensor of the round's size: nothing to average


@functools.lru_cache(maxsize=1024)
def _values(n: int) -> torch.Tensor:
    """A round's values: a meta tensor of the round's size (shared: nothing writes to it)."""
    return torch.empty(n, device="meta")


@functools.lru_cache(maxsize=1024)
def _payload(n: int) -> SizedEncoded:
    """The payload of a round of ``n`` values (``_values(n)``: every cost-only round's)."""
    values = _values(n)
    return SizedEncoded({"values": values}, tuple(values.shape), values.dtype)


class CostPowerSGD(PowerSGD):
    @staticmethod
    def _compressor(shapes: list[torch.Size], rank: int, seed: int) -> LowRankCompressor:
        return LowRankCompressor(shapes, rank, seed, draw_q=False)  # sizes are all the wire needs

    def wire_values(self) -> tuple[int, int]:
        if not hasattr(self, "_wire"):  # shapes never change: counted once
            self._wire = super().wire_values()
        return self._wire

    def pre_step(self, u: int) -> list[Message]:
        self.rounds += 1
        if self.replicas == 1:
            self._done.add(u)
            return []
        return self.share((u, 0), _values(self.wire_values()[0]), u)

    def on_complete(self, key: Key) -> list[Message]:
        self.exchange.mean(key)
        u, phase = key
        if phase == 0:
            return self.share((u, 1), _values(self.wire_values()[1]), u)
        self._done.add(u)
        return []


class CostDiLoCo(StreamingDiLoCo):
    def _round0_numel(self, f: int) -> int:
        return self.fragment_numel(f) if self.compressors is None else self.compressors[f].wire_values()[0]

    def post_step(self, u: int) -> list[Message]:
        if self.replicas == 1:
            return []
        out = []
        for f in self.syncing(u):
            self.pending[(u, f)] = Sync(f)
            self.rounds += 1
            out += self.share((u, f), _values(self._round0_numel(f)), u + 1)
        return out

    def on_complete(self, key: Key) -> list[Message]:
        self.exchange.mean(key)
        sync = self.pending[self.sync_key(key)]
        if self.compressors is not None and not sync.factored:  # dp.compress: round 1 (Q) next
            sync.factored = True
            size = self.compressors[sync.fragment].wire_values()[1]
            return self.share((key[0], len(self.fragments) + sync.fragment), _values(size), key[0] + 1)
        sync.merged = []
        return []

    def apply(self, u: int) -> None:
        for key in [k for k in self.pending if k[0] == u - self.overlap]:
            self.pending.pop(key)


class CostSparseAveraging(SparseAveraging):
    """Sparse averaging whose rounds have the real sizes and timing but move no values.

    With ``moments`` a round also carries each parameter's moment tensors: counted as the
    registry's deadline rule counts them (AdamW's two, 3× the parameter slice)."""

    def round_numel(self, round_no: int) -> int:
        k = round_no % self.parts
        if k not in self._numel:
            sizes = sum((k + 1) * p.numel() // self.parts - k * p.numel() // self.parts
                        for p in self.params)
            self._numel[k] = 3 * sizes if self.moments else sizes
        return self._numel[k]

    def _round_values(self, round_no: int) -> torch.Tensor:
        return _values(self.round_numel(round_no))

    def post_step(self, u: int) -> list[Message]:
        if not self.starts_round(u) or self.replicas == 1:
            return []
        round_no = (u + 1) // self.every - 1
        snapshot = self._round_values(round_no)
        self.pending[u] = Round(round_no, snapshot)
        self.rounds += 1
        return self.share((u, 0), snapshot, u + 1)

    def apply(self, u: int) -> None:
        self.pending.pop(u - self.delay, None)


def build_cost_strategy(cfg, worker, profile) -> DPStrategy:
    """``dp.registry.build_strategy`` for a cost-only worker (same deadlines, same phases)."""
    if cfg.name == "sparse":
        strategy = CostSparseAveraging(
            worker.id, worker.mesh.replicas, worker.module, worker.optimizer, fraction=cfg.fraction,
            delay=cfg.delay, every=cfg.every, rule=cfg.rule, lam=cfg.lam, m0=cfg.ema_m,
            m1=cfg.ema_m_final, warm=cfg.ema_warm_updates, ramp_end=cfg.ema_ramp_end,
            ema_init=cfg.ema_init, moments=cfg.moments, seed=cfg.seed, deadline_s=None)
        strategy._numel = {}  # round sizes by part (they depend on round_no % parts only)
        nbytes = 4 * max(strategy.round_numel(r) for r in range(strategy.parts))
        strategy._deadline_s = _deadline(cfg, nbytes, profile)
    elif cfg.name == "powersgd":  # the registry's rule, without drawing a random Q on meta
        strategy = CostPowerSGD(worker.id, worker.mesh.replicas, worker.module, rank=cfg.rank, seed=cfg.seed)
    else:
        strategy = builder_of(cfg.name)(cfg, worker, profile)
        cost_class = {"diloco": CostDiLoCo}.get(cfg.name)
        if cost_class is not None:
            strategy.__class__ = cost_class  # built by the registry's own rule, then made cost-only
    strategy.exchange = CostExchange(worker.id, worker.mesh.replicas, robust_of(cfg))
    return strategy
