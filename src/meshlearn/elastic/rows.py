"""Which pipeline rows train a step: every process agrees on it, through the run's store.

A row (replica ``r``: one replica of every stage) can train a step only if every one of its stage
replicas is in its stage's quorum for that step. torchft forms each stage's quorum on its own; a
row that joined (``meshlearn worker --join``, one process per stage) reaches its stages' quorums at
different steps. So after each stage's quorum forms, every member says so in the store (its row,
and the quorum's size), and the first process that sees every stage's members accounted for fixes
the step's rows with compare-and-set; everyone adopts that value. The rows that are in it train
the step and split its global batch (``data_shards``); every other live replica *spectates*: it
takes part in its stage's all-reduce with zero gradients and a contribution count of 0, and
applies the same update as its peers, so it stays identical to them until its row is complete.

A quorum's members asked for it, so they are alive when it forms: their entries arrive within
milliseconds, and the deadline only matters if one dies in between (it then counts as absent).

The agreement also fixes, per row that trains, the links it trains on (``Agreed.linked_at``): each
member reports the step its pipeline links were built at (``NOT_LINKED``: it holds none — a
joiner, or a survivor that dropped them), and a row keeps its links only if every member reports
the same ones; else every member drops what it holds and links anew at this step
(``Agreed.plan``). Whether a worker links is thus decided by data every member of its row reads
identically, never by what it alone noticed: one end that dropped its links while the other kept
them (a one-sided break) cannot leave one waiting on a link the other never builds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from meshlearn.distributed.health import WorkerFailure
from meshlearn.mesh.topology import WorkerId

NOT_LINKED = -1  # a member's report: it holds no pipeline links


@dataclass(frozen=True)
class Agreed:
    """A step's agreed rows, and per row the step whose links it trains on."""

    rows: tuple[int, ...]
    linked_at: dict[int, int]

    def plan(self, replica: int, held: int | None) -> tuple[bool, int | None]:
        """What a member of row ``replica`` holding the links of step ``held`` (None: none) does:
        (drop what it holds, the step to link at or None). The same agreement gives every member
        of a row the same target, so all ends drop and link together."""
        if replica not in self.rows:
            return held is not None, None
        target = self.linked_at[replica]
        if held == target:
            return False, None
        return held is not None, target


def link_step(step: int, reports: Sequence[int]) -> int:
    """The links a complete row trains ``step`` on, from its members' reports (the step each one's
    links were built at, ``NOT_LINKED`` for none): the ones they all hold, if they hold the same;
    else new ones at ``step`` for all of them."""
    first = reports[0]
    return first if first != NOT_LINKED and all(r == first for r in reports) else step


def encode_agreed(agreed: Agreed) -> str:
    return ",".join(f"{r}@{agreed.linked_at[r]}" for r in agreed.rows) or "-"


def decode_agreed(raw: bytes | str) -> Agreed:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    pairs = [tuple(int(v) for v in item.split("@")) for item in text.split(",") if item not in ("", "-")]
    return Agreed(tuple(r for r, _ in pairs), dict(pairs))


def decode_rows(raw: bytes | str) -> tuple[int, ...]:
    """The agreed rows alone (the verifier's relay follows them, not their links)."""
    return decode_agreed(raw).rows


class RowAgreement:
    """``agree(step, me, participants, held)`` → the rows that train ``step`` and their links, the
    same in every process (``held``: the step this worker's links were built at, None: none)."""

    def __init__(self, store: dist.Store, stages: int, replicas: int, deadline_s: float):
        self.store = store
        self.stages = stages
        self.replicas = replicas
        self.deadline_s = deadline_s

    def agree(self, step: int, me: WorkerId, participants: int, held: int | None) -> Agreed:
        key = f"rows/{step}"
        held_at = NOT_LINKED if held is None else held
        self.store.set(f"{key}/links/{me}", str(held_at))  # before the row's count: a fixer reads it
        for s in range(self.stages):  # every counter exists before this stage's size says so, so a
            self.store.add(f"{key}/s{s}/count", 0)  # reader's multi_get never blocks on one
        self.store.add(f"{key}/r{me.replica}", 1)  # before the stage's count: a fixer sees it
        self.store.set(f"{key}/s{me.stage}/n", str(participants))
        self.store.add(f"{key}/s{me.stage}/count", 1)
        end = time.monotonic() + self.deadline_s
        pause = 1e-4
        while True:
            if self.store.check([f"{key}/fixed"]):
                return decode_agreed(self.store.get(f"{key}/fixed"))
            if self._complete(key):
                return self._fix(key, step)
            if time.monotonic() >= end:
                missing = [s for s in range(self.stages) if not self.store.check([f"{key}/s{s}/n"])]
                if missing:
                    raise WorkerFailure(f"no replica of stage {missing[0]} is left (step {step + 1} "
                                        f"has no quorum of it after {self.deadline_s:.1f} s; "
                                        f"noticed by {me})")
                return self._fix(key, step)
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _complete(self, key: str) -> bool:
        """Every stage's quorum has reported, each with all its members."""
        names = [f"{key}/s{s}/n" for s in range(self.stages)]
        if not self.store.check(names):
            return False
        sizes = [int(v) for v in self.store.multi_get(names)]
        counts = [int(v) for v in self.store.multi_get([f"{key}/s{s}/count" for s in range(self.stages)])]
        return all(c >= n for c, n in zip(counts, sizes, strict=True))

    def _fix(self, key: str, step: int) -> Agreed:
        """The complete rows, less those SENTINEL evicted (``evictions.evicted_key``, set by the
        verifier before the verdict every worker reads first): whatever a banned process still does;
        each with the links it trains on (``link_step``: every member of a complete row reported)."""
        present = [int(self.store.add(f"{key}/r{r}", 0)) for r in range(self.replicas)]
        rows = tuple(r for r, n in enumerate(present)
                     if n == self.stages and not self.store.check([f"evicted/r{r}"]))
        linked_at = {r: link_step(step, [int(v) for v in self.store.multi_get(
            [f"{key}/links/{WorkerId(r, s)}" for s in range(self.stages)])]) for r in rows}
        fixed = self.store.compare_set(f"{key}/fixed", "", encode_agreed(Agreed(rows, linked_at)))
        return decode_agreed(fixed)



def whole_batch(contributors: float, sequences: float, rows: tuple[int, ...], batch_size: int) -> bool:
    """A stage's verdict on its summed counts: every agreed row's replica of the stage contributed
    (spectators add 0) and together they trained the whole global batch, each sequence once. Only
    then may the step commit; the mean of the summed gradients divides by ``contributors``."""
    return bool(rows) and contributors == len(rows) and sequences == batch_size
