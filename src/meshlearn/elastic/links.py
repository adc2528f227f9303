"""An elastic row's pipeline links: two-rank gloo groups of their own, over the run's store (or,
under ``elastic.membership = "control"``, two framed streams per hop from the run's connector: no
gloo, and in a cluster run the hosts' one port).

A row is an assignment stage → replica (``rows.Row``): a worker's neighbours are the row's workers
of the stages before and after its own, of the same replica in a slot row, of others in a
re-paired one; the links are keyed by those worker pairs.

The fixed-membership driver's links are sub-groups of the world group, which exists only for the
processes started together. An elastic row may be started later (``meshlearn worker --join``),
so every elastic row — the first ones too, one code path — links its stages with ``PairGroup``s:
one per direction and hop, each a rendezvous under a store prefix that names both ends, *their
generations* (a slot's generation counts the processes that have held it: 0 for the one the
launcher started, then one more per joiner) and the step the row links at, so a new incarnation
of a row never meets a dead one's half-built group. A row links at the first step it trains, and
again whenever its members do not all hold the same links (a partner died and the survivors
dropped theirs, one end dropped them alone, a joiner took a slot): the row agreement fixes the step
(``rows.Agreed``) and every live member of the row links at it. Before gloo's rendezvous (which
blocks in C++ up to its timeout) both ends meet in the store while the row's heartbeat watch runs,
so a partner that died after asking for the quorum is found in ``dist.dead_after_s`` (RowBroken).

With SENTINEL (``relayed``) every logical link is two hops through the verifier process, as in the
fixed-membership driver (``distributed/verifier.py``): worker → verifier on the link's ``in`` pair
group, verifier → worker on its ``out`` one. Each worker meets only the verifier, in its own
order (``hops``), and the verifier meets the workers one after the other in rank order, each
through that worker's hops in the same order, so no rendezvous waits on another (no cycle).
Such a run takes no joiners (``elastic/evictions.py``), so every slot is generation 0 there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from meshlearn.distributed.groups import PairGroup, pair_group
from meshlearn.distributed.health import WorkerFailure
from meshlearn.distributed.streams import StreamConnector
from meshlearn.elastic.rows import Row
from meshlearn.mesh.topology import MeshShape, WorkerId


def generation_key(wid: WorkerId) -> str:
    """The generation of the process that holds slot ``wid`` now (set by that process at start)."""
    return f"elastic/gen/{wid}"


class RowLinks:
    """This worker's links to the neighbouring stages of its row."""

    def __init__(self, store: dist.Store, mesh: MeshShape, me: WorkerId, generation: int,
                 interface: str, timeout_s: float, relayed: bool = False,
                 connector: StreamConnector | None = None):
        self.relayed = relayed
        self.connector = connector  # framed streams instead of pair groups (membership "control")
        self.store = store
        self.mesh = mesh
        self.me = me
        self.generation = generation
        self.interface = interface
        self.timeout_s = timeout_s

    def announce(self) -> None:
        self.store.set(generation_key(self.me), str(self.generation))

    def dropped_key(self, row: Row, step: int) -> str:
        """Set by a member that drops row ``row``'s links of step ``step`` (why), read by the
        others' heartbeat monitors (``Health.follow``), so no end stays waiting on a link its
        partner left."""
        return f"elastic/links/{'.'.join(map(str, row))}/{step}/dropped"

    def drop(self, row: Row, step: int, why: str) -> None:
        self.store.set(self.dropped_key(row, step), f"worker {self.me} dropped its row's links ({why})")

    def build(self, step: int, row: Row, check: Callable[[], None]
              ) -> dict[tuple[WorkerId, WorkerId], PairGroup]:
        """Rendezvous with each neighbour in ``row`` (its workers of the stages before and after
        this one's: of any replica, a re-paired row joins different ones) for the links the row
        trains on from step ``step``, lower hop first in every process (a stage in the middle meets
        its upstream neighbour, then its downstream one: no cycle of waits); ``check`` raises if a
        partner is found dead while waiting for it. Relayed: this worker's hops to the verifier
        instead (built once: such a run takes no joiners and is not re-paired, and its rows hold
        their first links to the end)."""
        if self.relayed:
            return {link: pair_group(relay_store(self.store, link, hop), 0 if hop == "in" else 1,
                                     self.interface, self.timeout_s)
                    for link, hop in hops(self.mesh, self.me)}
        self.store.compare_set(self.dropped_key(row, step), "", "")  # exists before anyone reads it
        groups = {}
        for peer in neighbours(row, self.me):
            a, b = (peer, self.me) if peer.stage < self.me.stage else (self.me, peer)
            ga, gb = (int(self.store.get(generation_key(w)).decode()) for w in (a, b))
            base = f"elastic/links/{a}.{ga}-{b}.{gb}/{step}"
            self._meet(base, peer, step, check)
            if self.connector is not None:
                groups |= self._streams(f"row-{a}.{ga}-{b}.{gb}-{step}", a, b)
                continue
            for src, dst in ((a, b), (b, a)):
                prefixed = dist.PrefixStore(f"{base}/{src}>{dst}/", self.store)
                groups[(src, dst)] = pair_group(prefixed, 0 if self.me == a else 1, self.interface,
                                                self.timeout_s)
        return groups

    def _streams(self, channel: str, a: WorkerId, b: WorkerId) -> dict[tuple[WorkerId, WorkerId], object]:
        """The link a → b and its way back as two framed streams from the connector, on a channel
        of this pair's own (its ends' generations and the step in its name, as the groups' prefix)."""
        ra, rb = self.mesh.rank(a), self.mesh.rank(b)
        hops = [((a, b), ra, rb), ((b, a), rb, ra)]
        ends = self.connector.connect(self.mesh.rank(self.me), {channel: hops}, self.timeout_s)[channel]
        return {link: ends[i] for i, (link, _, _) in enumerate(hops)}

    def _meet(self, base: str, peer: WorkerId, step: int, check: Callable[[], None]) -> None:
        """Wait for ``peer`` at the link's prefix, calling ``check`` between looks."""
        self.store.set(f"{base}/here/{self.me}", "1")
        end = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not self.store.check([f"{base}/here/{peer}"]):
            check()
            if time.monotonic() >= end:
                raise WorkerFailure(f"worker {peer} did not come to link its row at step {step + 1} "
                                    f"within {self.timeout_s:.1f} s (noticed by {self.me})")
            time.sleep(pause)
            pause = min(2 * pause, 1e-2)


def row_peer(row: Row, stage: int) -> WorkerId | None:
    """``row``'s worker of ``stage``; None past either end of the pipeline."""
    return WorkerId(row[stage], stage) if 0 <= stage < len(row) else None


def neighbours(row: Row, me: WorkerId) -> list[WorkerId]:
    """``me``'s partners in ``row``: the workers of the stage before and the stage after."""
    return [p for p in (row_peer(row, me.stage - 1), row_peer(row, me.stage + 1)) if p is not None]


def hops(mesh: MeshShape, wid: WorkerId) -> list[tuple[tuple[WorkerId, WorkerId], str]]:
    """Worker ``wid``'s hops to the verifier, in the order it builds them: per neighbour (upstream
    first), the link from the lower stage, then the one back; ``in`` where ``wid`` sends, ``out``
    where it receives."""
    out = []
    for peer in (mesh.prev_stage(wid), mesh.next_stage(wid)):
        if peer is None:
            continue
        a, b = (peer, wid) if peer.stage < wid.stage else (wid, peer)
        out += [((src, dst), "in" if src == wid else "out") for src, dst in ((a, b), (b, a))]
    return out


def relay_store(store: dist.Store, link: tuple[WorkerId, WorkerId], hop: str) -> dist.Store:
    src, dst = link
    return dist.PrefixStore(f"elastic/relay/{src}>{dst}/{hop}/", store)


def verifier_links(store: dist.Store, mesh: MeshShape, interface: str, timeout_s: float
                   ) -> dict[tuple[WorkerId, WorkerId], tuple[PairGroup, PairGroup]]:
    """The verifier's side: per logical link, its (receive, send) pair groups. Workers are met in
    rank order, each through its own hops in its order (so nobody waits on a third process)."""
    made: dict[tuple[tuple[WorkerId, WorkerId], str], PairGroup] = {}
    for wid in mesh.workers():
        for link, hop in hops(mesh, wid):
            made[(link, hop)] = pair_group(relay_store(store, link, hop), 1 if hop == "in" else 0,
                                           interface, timeout_s)
    return {link: (made[(link, "in")], made[(link, "out")])
            for (link, hop) in made if hop == "in"}
