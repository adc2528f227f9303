"""An elastic row's pipeline links: two-rank gloo groups of their own, over the run's store.

The fixed-membership driver's links are sub-groups of the world group, which exists only for the
processes started together. An elastic row may be started later (``meshlearn worker --join``),
so every elastic row — the first ones too, one code path — links its stages with ``PairGroup``s:
one per direction and hop, each a rendezvous under a store prefix that names both ends *and their
generations* (a slot's generation counts the processes that have held it: 0 for the one the
launcher started, then one more per joiner), so a new incarnation of a row never meets a dead
one's half-built group. A row links once, at the first step it trains.
"""

from __future__ import annotations

import torch.distributed as dist

from meshlearn.distributed.groups import PairGroup, pair_group
from meshlearn.mesh.topology import MeshShape, WorkerId


def generation_key(wid: WorkerId) -> str:
    """The generation of the process that holds slot ``wid`` now (set by that process at start)."""
    return f"elastic/gen/{wid}"


class RowLinks:
    """This worker's links to the neighbouring stages of its row."""

    def __init__(self, store: dist.Store, mesh: MeshShape, me: WorkerId, generation: int,
                 interface: str, timeout_s: float):
        self.store = store
        self.mesh = mesh
        self.me = me
        self.generation = generation
        self.interface = interface
        self.timeout_s = timeout_s

    def announce(self) -> None:
        self.store.set(generation_key(self.me), str(self.generation))

    def build(self) -> dict[tuple[WorkerId, WorkerId], PairGroup]:
        """Rendezvous with each neighbour, lower hop first in every process (a stage in the middle
        meets its upstream neighbour, then its downstream one: no cycle of waits)."""
        groups = {}
        neighbours = [p for p in (self.mesh.prev_stage(self.me), self.mesh.next_stage(self.me))
                      if p is not None]
        for peer in neighbours:
            a, b = (peer, self.me) if peer.stage < self.me.stage else (self.me, peer)
            ga, gb = (int(self.store.get(generation_key(w)).decode()) for w in (a, b))
            base = f"elastic/links/{a}.{ga}-{b}.{gb}"
            for src, dst in ((a, b), (b, a)):
                prefixed = dist.PrefixStore(f"{base}/{src}>{dst}/", self.store)
                groups[(src, dst)] = pair_group(prefixed, 0 if self.me == a else 1, self.interface,
                                                self.timeout_s)
        return groups
