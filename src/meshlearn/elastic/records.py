"""Who writes an elastic run's records: one live process per step, agreed through the run's store.

Every last-stage replica in its stage's quorum holds the same record of a step: the train loss is
the mean over the contributing last stages (it rides in the all-reduce, spectators add zeros), and
``grad_norm``, ``participants``, ``rows``, ``batch`` and ``committed`` come from the summed values
and the agreed rows (only wall times and byte counters are the process's own). So any of them can
write it. The records of the step after ``done`` steps (train, eval, plugin events) are claimed
with compare-and-set on ``records/{done}``, and only the claimant appends them to ``metrics.jsonl``:

- the *preferred* writer, the last stage of the lowest row that trained the step, claims them
  before it sends its verdict in the step's commit vote (``before_vote``; a record outside a step
  is claimed when it comes) and writes each record as it comes;
- every other last stage keeps its records of the step; after the next step's quorum has formed
  (``after_quorum``) — or at the end of the run (``close``) — it claims them if nobody has: the
  preferred writer died (or was left out of that quorum) before it claimed. The first claim wins.

Why the preferred claims before its verdict: another last stage claims only after its own vote on
the step has ended, and that vote waits for every member's verdict, the preferred writer's too; so
while the preferred writer is in the step its claim comes first. Claimed after the step instead,
it would race the others' fallback claims (a steady step's quorum asks the store nothing), and a
fallback that won would write the step's records into its own folder: in a cluster run not the
coordinator's (a step was missing from the run's metrics so in ``bench/cluster.py --elastic-pair
--rtt-ms 0``).

Order in the file: a fallback claimant writes during the next step, before its stage's all-reduce,
and that all-reduce is what every last stage needs to finish the next step; so a step's records are
in the file before any of the next step's. Each record is one ``O_APPEND`` write (``append_record``).
What is lost: a claimant killed between winning the claim and its append (the preferred writer:
the step's vote and update; another: one store round trip).

Only a last stage writes: the others' records of a step are the last stage's too (the same step),
except a DP outlier report (``dp_outlier``, ``dp/attribution.py``): each stage attributes its own
contributions, so a report of another stage reaches no last stage. Each member of that stage
hands it to ``witness`` instead (the driver's membership event, in the launcher's workers.json).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from meshlearn.jsonl import append_record
from meshlearn.mesh.topology import MeshShape, WorkerId


class ElasticRecords:
    """The Trainer's records sink in one elastic worker. ``rows()``: the rows (stage → replica)
    that trained the step just run (the driver's agreed value). ``preferred``: the last stage that
    claims at once, if it is in the run (a cluster run's, on the coordinator: its folder holds the
    run's records); None: the first trained row's."""

    def __init__(self, store: dist.Store, mesh: MeshShape, me: WorkerId, rows,
                 preferred: WorkerId | None = None, witness: Callable[[dict], None] | None = None):
        self.store = store
        self.me = me
        self.rows = rows
        self.preferred = preferred
        self.witness = witness
        self.eligible = me.stage == mesh.stages - 1  # only a last stage has the losses
        self.path: Path | None = None
        self.held: set[int] = set()  # the steps (done counts) whose records this process writes
        self.pending: dict[int, list[dict]] = {}  # records of a step nobody has claimed for us yet
        self.lost: set[int] = set()  # steps whose claim another process won

    def attach(self, path: Path) -> None:
        self.path = path

    def write(self, done: int, record: dict) -> None:
        """A record of the step after ``done`` steps."""
        if not self.eligible and record.get("kind") == "dp_outlier" and self.witness is not None:
            self.witness(record)
        if not self.eligible or self.path is None or done in self.lost:
            return
        if done in self.held:
            append_record(self.path, record)
            return
        self.pending.setdefault(done, []).append(record)
        if self._prefers():
            self._claim(done)

    def before_vote(self, done: int) -> None:
        """The step whose records come after ``done`` steps is about to be voted on: the preferred
        writer claims them now, before its verdict leaves (the module's docstring says why)."""
        if self.eligible and self.path is not None and done not in self.held | self.lost and self._prefers():
            self._claim(done)

    def after_quorum(self, step: int) -> None:
        """Step ``step`` (0-based) has its quorum: the records of the steps before it that nobody
        claimed are this process's to write, if it claims them first."""
        for done in sorted(d for d in self.pending if d <= step):
            self._claim(done)

    def close(self) -> None:
        for done in sorted(self.pending):
            self._claim(done)

    def holds(self, done: int) -> bool:
        """Whether this process wrote the records of the step after ``done`` steps."""
        return done in self.held

    def _prefers(self) -> bool:
        """Whether this process is the preferred writer of the step the rows trained."""
        rows = self.rows()
        first = WorkerId(rows[0][-1], self.me.stage) if rows else None  # the first row's last stage
        return self.me == (self.preferred or first)

    def _claim(self, done: int) -> None:
        records = self.pending.pop(done, [])
        mine = str(self.me)
        winner = self.store.compare_set(f"records/{done}", "", mine)
        if (winner.decode() if isinstance(winner, bytes) else str(winner)) != mine:
            self.lost.add(done)
            return
        self.held.add(done)
        for record in records:
            append_record(self.path, record)
