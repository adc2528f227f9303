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
"""

from __future__ import annotations

import time

import torch.distributed as dist

from meshlearn.distributed.health import WorkerFailure
from meshlearn.mesh.topology import WorkerId


def encode_rows(rows: tuple[int, ...]) -> str:
    return ",".join(map(str, rows)) or "-"


def decode_rows(raw: bytes | str) -> tuple[int, ...]:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return tuple(int(r) for r in text.split(",") if r not in ("", "-"))


class RowAgreement:
    """``agree(step, me, participants)`` → the rows that train ``step``, the same in every process."""

    def __init__(self, store: dist.Store, stages: int, replicas: int, deadline_s: float):
        self.store = store
        self.stages = stages
        self.replicas = replicas
        self.deadline_s = deadline_s

    def agree(self, step: int, me: WorkerId, participants: int) -> tuple[int, ...]:
        key = f"rows/{step}"
        for s in range(self.stages):  # every counter exists before this stage's size says so, so a
            self.store.add(f"{key}/s{s}/count", 0)  # reader's multi_get never blocks on one
        self.store.add(f"{key}/r{me.replica}", 1)  # before the stage's count: a fixer sees it
        self.store.set(f"{key}/s{me.stage}/n", str(participants))
        self.store.add(f"{key}/s{me.stage}/count", 1)
        end = time.monotonic() + self.deadline_s
        pause = 1e-4
        while True:
            if self.store.check([f"{key}/fixed"]):
                return decode_rows(self.store.get(f"{key}/fixed"))
            if self._complete(key):
                return self._fix(key)
            if time.monotonic() >= end:
                missing = [s for s in range(self.stages) if not self.store.check([f"{key}/s{s}/n"])]
                if missing:
                    raise WorkerFailure(f"no replica of stage {missing[0]} is left (step {step + 1} "
                                        f"has no quorum of it after {self.deadline_s:.1f} s; "
                                        f"noticed by {me})")
                return self._fix(key)
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

    def _fix(self, key: str) -> tuple[int, ...]:
        """The complete rows, less those SENTINEL evicted (``evictions.evicted_key``, set by the
        verifier before the verdict every worker reads first): whatever a banned process still does."""
        present = [int(self.store.add(f"{key}/r{r}", 0)) for r in range(self.replicas)]
        rows = tuple(r for r, n in enumerate(present)
                     if n == self.stages and not self.store.check([f"evicted/r{r}"]))
        return decode_rows(self.store.compare_set(f"{key}/fixed", "", encode_rows(rows)))



def whole_batch(contributors: float, sequences: float, rows: tuple[int, ...], batch_size: int) -> bool:
    """A stage's verdict on its summed counts: every agreed row's replica of the stage contributed
    (spectators add 0) and together they trained the whole global batch, each sequence once. Only
    then may the step commit; the mean of the summed gradients divides by ``contributors``."""
    return bool(rows) and contributors == len(rows) and sequences == batch_size
