"""Who writes an elastic run's checkpoint, agreed mesh-wide, so a checkpoint taken after a
membership change is complete.

The fixed-membership checkpoint lists every worker's shard and waits for all of them at a barrier;
after a worker has left, that manifest names a shard nobody writes. Here the manifest lists the
shards of the rows that trained the step the checkpoint follows (``rows``: the same value in
every process, see ``elastic/rows.py``), and is written by one of them: the last stage of the
first such row. It waits, up to a deadline, for each listed shard to be reported on disk through
the run's store, and lists those that were; if a stage then has no shard at all (its replicas
died in between), it writes no manifest and the checkpoint stays incomplete — resume takes the one
before. Spectating replicas write their shards too (they are identical, unlisted).

On resume, a worker whose shard is not listed loads a listed replica of its own stage. The launcher
starts only the rows the manifest lists (``membership.py``), so a resumed run trains with the
membership the checkpoint was taken in; the other slots are free for ``meshlearn worker --join``.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from meshlearn.mesh.topology import MeshShape, WorkerId


def listed_workers(shards: list[str]) -> set[WorkerId]:
    """The workers whose shards a manifest lists (for the launcher of a resumed run)."""
    return {WorkerId.parse(name) for name in shards}


class ElasticCheckpoints:
    """``ShardedCheckpoint``'s ``membership`` for one elastic worker."""

    def __init__(self, store: dist.Store, mesh: MeshShape, me: WorkerId, rows, deadline_s: float):
        self.store = store
        self.mesh = mesh
        self.me = me
        self.rows = rows  # () -> the rows (stage → replica) that trained the last step (agreed)
        self.deadline_s = deadline_s
        self.last_taken: int | None = None  # the step count of this worker's latest checkpoint

    def taken_since(self, step: int) -> bool:
        """Whether this worker took a checkpoint after step ``step`` (0-based) ran: the next step
        then agrees its rows on the store (``peer_vote.ReusedRows``)."""
        return self.last_taken is not None and self.last_taken > step

    def writes(self) -> bool:
        """Whether this worker writes the manifest: the last stage of the first row that trained."""
        rows = self.rows()
        return bool(rows) and self.me == WorkerId(rows[0][-1], self.mesh.stages - 1)

    def manifest(self, step: int) -> tuple[list[str], bool]:
        """This worker's shard of the checkpoint after ``step`` steps is on disk: say so; the
        manifest's writer then collects the listed shards that are."""
        key = f"elastic/checkpoint/{step}"
        self.last_taken = step
        self.store.set(f"{key}/{self.me}", "1")
        if not self.writes():
            return [], False
        rows = self.rows()
        wanted = [WorkerId(r, s) for row in rows for s, r in enumerate(row)]
        end = time.monotonic() + self.deadline_s
        while not self.store.check([f"{key}/{w}" for w in wanted]) and time.monotonic() < end:
            time.sleep(0.01)
        written = [w for w in wanted if self.store.check([f"{key}/{w}"])]
        if {w.stage for w in written} != set(range(self.mesh.stages)):
            print(f"meshlearn worker {self.me}: the checkpoint of step {step} stays incomplete: "
                  f"no replica of some stage wrote its shard within {self.deadline_s:.1f} s",
                  file=sys.stderr, flush=True)
            return [], False
        return [str(w) for w in written], True

    def substitute(self, shard: str, listed: list[str]) -> str:
        """A listed replica of ``shard``'s stage (the checkpoint's rows hold identical states)."""
        stage = WorkerId.parse(shard).stage
        same = [name for name in sorted(listed) if WorkerId.parse(name).stage == stage]
        if not same:
            raise FileNotFoundError(f"the checkpoint lists no replica of stage {stage} for {shard}")
        return same[0]
