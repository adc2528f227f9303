"""A cluster host's view of the elastic slots it does not run: whose claim a slot is, and when a
slot held on another machine is lost with that machine.

Why: on one machine the launcher sees every worker end (its children, or a joiner's pid). In a
cluster run each host's launcher sees only its own; the others learn of an end from the host that
saw it (``membership.ended_key``). A machine that is lost whole tells nobody — its launcher is gone
with its workers — so its slots would stay held for good and no joiner could replace them. The
coordinator, which may free any slot (``cluster/slots.py``), watches the heartbeat every worker
process beats on the control service (``hb/<rank>``, ``distributed/health.py``): a slot whose
counter has moved in its current generation and then stands still for ``dead_after_s`` (longer
than a row partner waits: freeing a live holder's slot would be worse than waiting), its process
not having said it finished (``done/<rank>``), is lost, and the coordinator frees it. Should that
machine come back, slot authority keeps it out: once a joiner has claimed the slot, its old
holder may write none of the slot's records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from meshlearn.cluster.slots import parse_claim


@dataclass(frozen=True)
class ClusterWatch:
    """A cluster host's part in ``membership.watch_elastic``: its name, the slots the placement
    gives other hosts, whether it keeps workers.json and frees lost machines' slots (the
    coordinator), every slot's rank, and how long a slot's heartbeat may stand still."""

    host: str
    remote: tuple[str, ...]
    coordinator: bool
    ranks: Mapping[str, int] = field(default_factory=dict)
    dead_after_s: float = 0.0


def claimant(value: str, cluster: ClusterWatch | None) -> tuple[str | None, int | None]:
    """(host, pid) of a slot's claim: a pid on one machine, ``HOST:PID`` in a cluster run, whose
    pid only its own host can watch (None elsewhere)."""
    if cluster is None:
        return None, int(value)
    host, pid = parse_claim(value)
    return host, pid if host == cluster.host else None


class Lapses:
    """Heartbeats of slots held elsewhere, read through ``store`` (the workers' namespace)."""

    def __init__(self, store, ranks: Mapping[str, int], dead_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.ranks, self.dead_after_s, self.clock = store, dict(ranks), dead_after_s, clock
        self._seen: dict[str, tuple[int, int, float, bool]] = {}  # slot → generation, beat, since, moved

    def lapsed(self, slot: str, generation: int) -> float | None:
        """Seconds ``slot``'s heartbeat has stood still, once beyond ``dead_after_s`` after it moved
        in ``generation`` (None: it beats, or it has not started beating in this generation)."""
        rank = self.ranks[slot]
        beat, now = int(self.store.add(f"hb/{rank}", 0)), self.clock()
        was = self._seen.get(slot)
        if was is None or was[0] != generation:  # a new holder: its counter goes on from the last one's
            self._seen[slot] = generation, beat, now, False
            return None
        _, last, since, moved = was
        if beat != last:
            self._seen[slot] = generation, beat, now, True
            return None
        silent = now - since
        if not moved or silent <= self.dead_after_s or self.store.check([f"done/{rank}"]):
            return None  # a holder that finished stops beating too: its host says how it ended
        return silent
