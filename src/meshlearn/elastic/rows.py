"""Which pipeline rows train a step: every process agrees on it, through the run's store.

A row is an assignment stage → replica (``Row``): the workers (row[s], s), one of every stage. It
can train a step only if each of them is in its stage's quorum for that step. torchft forms each
stage's quorum on its own; a row that joined (``meshlearn worker --join``, one process per stage)
reaches its stages' quorums at different steps. So after each stage's quorum forms, every member
says so in the store (with the links it holds, and the quorum's size), and the first process that
sees every stage's members accounted for fixes the step's rows with compare-and-set
(``form_rows``); everyone adopts that value. The rows in it train the step and split its global
batch (the driver's ``data_plan``); every other live replica *spectates*: it takes part in its
stage's all-reduce with zero gradients and a contribution count of 0, and applies the same update
as its peers, so it stays identical to them until it is in a row again.

The rows are formed per step: rows whose members all still hold that row's links stay as they are,
then the complete slot rows (r, …, r), then the survivors of rows broken at different stages are
*re-paired* — the leftovers of each stage matched in replica order (P = 2 × D = 2 with r0s1 and
r1s0 dead: r0s0 and r1s1 form row (0, 1)). The replicas of one stage hold identical weights at a
committed step, so any replica of stage s can follow any replica of stage s − 1.

A quorum's members asked for it, so they are alive when it forms: their entries arrive within
milliseconds, and the deadline only matters if one dies in between (it then counts as absent).

The agreement also fixes, per row that trains, the links it trains on (``Agreed.linked_at``): each
member reports the row and step its pipeline links were built at (None: it holds none — a joiner,
or a survivor that dropped them), and a row keeps its links only if every member reports that
row's links of one build (``link_step``); else every member drops what it holds and links anew at
this step (``Agreed.plan``). Whether a worker links is thus decided by data every member of its
row reads identically, never by what it alone noticed: one end that dropped its links while the
other kept them (a one-sided break) cannot leave one waiting on a link the other never builds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from meshlearn.distributed.health import WorkerFailure
from meshlearn.mesh.topology import WorkerId

Row = tuple[int, ...]
"""A pipeline row: stage → replica, the workers (row[s], s) that train one share of a step. A slot
row is (r, …, r); a re-paired one joins the survivors of rows broken at different stages."""

Held = tuple[Row, int]
"""A member's links: the row they join and the step they were built at (a member that holds
none reports ``Held | None`` = None)."""


def slot_row(replica: int, stages: int) -> Row:
    return (replica,) * stages


def row_label(row: Row) -> int | list[int]:
    """How records name a row: a slot row by its replica, a re-paired one by its assignment."""
    return row[0] if len(set(row)) == 1 else list(row)


@dataclass(frozen=True)
class Agreed:
    """A step's agreed rows (in data order), and per row the step whose links it trains on.
    ``present``: every member the agreement was formed from (all stages, rank order); ``complete``:
    whether every stage's quorum had reported in full (not fixed at the deadline) — then
    ``present`` is every process that votes on the step (the peer vote's group, ``peer_vote.py``);
    ``reused``: this process reuses an earlier step's agreement (``peer_vote.ReusedRows``)."""

    rows: tuple[Row, ...]
    linked_at: dict[Row, int]
    present: tuple[WorkerId, ...] = ()
    complete: bool = False
    reused: bool = False

    def row_of(self, me: WorkerId) -> Row | None:
        return next((row for row in self.rows if row[me.stage] == me.replica), None)

    def plan(self, me: WorkerId, held: Held | None) -> tuple[bool, int | None]:
        """What worker ``me`` holding links ``held`` does: (drop what it holds, the step to link
        at or None). The same agreement gives every member of a row the same target, so all ends
        drop and link together."""
        row = self.row_of(me)
        if row is None:
            return held is not None, None
        target = (row, self.linked_at[row])
        if held == target:
            return False, None
        return held is not None, target[1]


def intact(row: Row, reports: Sequence[Held | None]) -> bool:
    """Whether every member of ``row`` (``reports``, in stage order) holds this row's links of
    one build."""
    first = reports[0]
    return first is not None and first[0] == row and all(r == first for r in reports)


def link_step(step: int, row: Row, reports: Sequence[Held | None]) -> int:
    """The links row ``row`` trains ``step`` on, from its members' reports: the ones they all hold,
    if the row is ``intact``; else new ones at ``step`` for all of them."""
    return reports[0][1] if intact(row, reports) else step


def form_rows(step: int, present: Sequence[set[int]], held: dict[WorkerId, Held | None],
              repair: bool, complete: bool = False) -> Agreed:
    """The fixer's rule. ``present[s]``: the replicas of stage s in its quorum (less evicted ones);
    ``held``: each present member's report. First the rows every member of which still holds that
    row's links (so a healthy row — a re-paired one too — never re-links), then the complete slot
    rows, then (``repair``) the leftovers of each stage paired in replica order: as many more rows
    as the stage with the fewest leftovers has. Without ``repair`` (SENTINEL: its relay's hops
    are the slot rows') only slot rows."""
    free = [set(p) for p in present]
    linked: dict[Row, int] = {}

    def reports(row: Row) -> list[Held | None]:
        return [held.get(WorkerId(r, s)) for s, r in enumerate(row)]

    def take(row: Row) -> None:
        linked[row] = link_step(step, row, reports(row))
        for s, r in enumerate(row):
            free[s].discard(r)

    def available(row: Row) -> bool:
        return all(r in free[s] for s, r in enumerate(row))

    stages = len(present)
    if repair:
        for row in sorted({h[0] for h in held.values() if h is not None}):
            if available(row) and intact(row, reports(row)):
                take(row)
    for r in sorted(set.intersection(*free) if free else set()):
        take(slot_row(r, stages))
    if repair:
        for left in zip(*[sorted(f) for f in free], strict=False):
            take(tuple(left))
    rows = tuple(sorted(linked))
    members = tuple(sorted((WorkerId(r, s) for s, replicas in enumerate(present) for r in replicas),
                           key=lambda w: (w.stage, w.replica)))
    return Agreed(rows, {row: linked[row] for row in rows}, members, complete)


def encode_held(held: Held | None) -> str:
    return "-" if held is None else f"{'.'.join(map(str, held[0]))}@{held[1]}"


def decode_held(raw: bytes | str) -> Held | None:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if text == "-":
        return None
    row, _, at = text.partition("@")
    return tuple(int(v) for v in row.split(".")), int(at)


def encode_agreed(agreed: Agreed) -> str:
    """``rows;members;complete``: ``0.0@3,1.1@3;r0s0,r1s0,r0s1,r1s1;1``."""
    rows = ",".join(encode_held((row, agreed.linked_at[row])) for row in agreed.rows) or "-"
    return f"{rows};{','.join(map(str, agreed.present))};{int(agreed.complete)}"


def decode_agreed(raw: bytes | str) -> Agreed:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    rows, _, rest = text.partition(";")
    members, _, complete = rest.partition(";")
    pairs = [decode_held(item) for item in rows.split(",") if item not in ("", "-")]
    present = tuple(WorkerId.parse(name) for name in members.split(",") if name)
    return Agreed(tuple(row for row, _ in pairs), dict(pairs), present, complete == "1")


def decode_rows(raw: bytes | str) -> tuple[int, ...]:
    """The agreed slot rows' replicas (the verifier's relay follows them; with SENTINEL every
    agreed row is a slot row)."""
    return tuple(row[0] for row in decode_agreed(raw).rows)


class RowAgreement:
    """``agree(step, me, participants, held)`` → the rows that train ``step`` and their links, the
    same in every process (``held``: the row and step of this worker's links, None: none).
    ``repair``: whether survivors of rows broken at different stages are paired (``form_rows``);
    ``evictions``: whether replicas may be evicted (SENTINEL's verifier), so the fixer reads them."""

    def __init__(self, store: dist.Store, stages: int, replicas: int, deadline_s: float,
                 repair: bool = True, evictions: bool = False):
        self.store = store
        self.evictions = evictions
        self.stages = stages
        self.replicas = replicas
        self.deadline_s = deadline_s
        self.repair = repair

    def agree(self, step: int, me: WorkerId, participants: int, held: Held | None) -> Agreed:
        key = f"rows/{step}"
        self.store.set(f"{key}/links/{me}", encode_held(held))  # before the stage's count: a fixer reads it
        # The count before the size: a stage's size exists only once its counter does, so a reader
        # (which asks for the counters once every size exists) never blocks on one, and nobody
        # creates the other stages' counters (a round trip each, on every step's path).
        self.store.add(f"{key}/s{me.stage}/count", 1)
        self.store.set(f"{key}/s{me.stage}/n", str(participants))
        end = time.monotonic() + self.deadline_s
        pause = 1e-4
        while True:
            if self.store.check([f"{key}/fixed"]):
                return decode_agreed(self.store.get(f"{key}/fixed"))
            if self._complete(key):
                return self._fix(key, step, complete=True)
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

    def _fix(self, key: str, step: int, complete: bool = False) -> Agreed:
        """``form_rows`` over the members that reported, less the replicas SENTINEL evicted
        (``evictions.evicted_key``, set by the verifier before the verdict every worker reads
        first): whatever a banned process still does (asked only with ``evictions``: a round trip
        per replica, on every step's path). The reports are read in one round trip (``multi_get``
        waits on a missing key: only those that exist are asked for)."""
        names = {WorkerId(r, s): f"{key}/links/{WorkerId(r, s)}" for r in range(self.replicas)
                 if not (self.evictions and self.store.check([f"evicted/r{r}"])) for s in range(self.stages)}
        reported = [w for w, name in names.items() if self.store.check([name])]
        values = self.store.multi_get([names[w] for w in reported]) if reported else []
        held = {w: decode_held(raw) for w, raw in zip(reported, values, strict=True)}
        present: list[set[int]] = [{w.replica for w in reported if w.stage == s} for s in range(self.stages)]
        agreed = form_rows(step, present, held, self.repair, complete)
        return decode_agreed(self.store.compare_set(f"{key}/fixed", "", encode_agreed(agreed)))


def whole_batch(contributors: float, sequences: float, rows: tuple[Row, ...], batch_size: int) -> bool:
    """A stage's verdict on its summed counts: every agreed row's replica of the stage contributed
    (spectators add 0) and together they trained the whole global batch, each sequence once. Only
    then may the step commit; the mean of the summed gradients divides by ``contributors``."""
    return bool(rows) and contributors == len(rows) and sequences == batch_size
