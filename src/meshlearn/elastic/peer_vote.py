"""The commit vote over the members' own streams, and the row agreement reused until a change
(``elastic.membership = "control"``): a steady step asks the run's store nothing.

Why: the store's vote (``quorum.CommitVote``) and row agreement (``rows.RowAgreement``) are
several store round trips per step each, most of them polls while the other stages catch up; in a
cluster run the store is the coordinator's, over a WAN link (docs/elastic.md, "Measured").

**The vote** (``PeerVote``). Its group is every member of every stage, as the last agreement made
on the store names them (``Agreed.present``, complete: every stage's quorum reported in full), so
the same set in every process; each step whose rows were agreed on the store connects streams
between every pair of it (the run's connector, channel ``pvote-<step>``, in a thread of its own:
no member waits for the others' connections before its pipeline, where a member dead since it
reported would hold it past the pipeline's deadline; the vote waits for them). Two rounds, each an
all-to-all of a few bytes over those streams (``FramedCollectives.all_gather``):

1. each member sends its *verdict*: its stage's commit bit (``ok``) and whether it is steady
   (nothing it knows of asks for a new row agreement: ``steady``);
2. each member that received every verdict sends the *outcome* they fix: commit = every verdict
   says commit; reuse = commit and every verdict says steady.

A member that receives every outcome adopts it without the store. A stream that fails, or stays
silent past the deadline, sends the member to the store (the *fallback*): it closes its streams,
proposes the outcome if it completed round 1 (else "no commit"), with compare-and-set on
``pvote/<step>/decision``, and adopts the value stored (the first proposal). A member whose
streams have not all connected by the vote waits for them, reading that key meanwhile: another's
fallback settles the step for it too (it sent no verdict, so nobody adopted one without the store).

**Why every process adopts one outcome** (so a step commits in every stage or in none). Adopting
without the store needs every member's outcome, and a member sends one only after it completed
round 1 — with the same verdicts as everyone else (each member sends the same verdict to all).
So if anyone adopted an outcome X without the store, every member completed round 1 and every
proposal in the fallback is X: the stored value is X. If nobody did, all adopt the stored value.
Members of different stages are in one group, so a stage that says no reaches every stage (what
the store's vote gave, without its polls). A failure costs: the fallback's streams are closed, so
the next step's vote (whose rows may be reused) finds them closed and goes to the store with "no
commit": that step commits nowhere and the one after agrees its rows and connects anew.

**Reuse** (``ReusedRows``). The agreement of a step is reused by the next one only if the outcome
says so: the step committed (a failed step re-forms the stages' quorums), no member's stage
flagged a change in its sums (a joiner, a lapsed heartbeat: ``ControlQuorum``) nor a failed sum,
and every member holds the links its row was agreed (a row partner found dead, a one-sided drop).
All read one outcome, so all reuse or none does. The step after a checkpoint agrees on the store
whatever the outcome (every process checkpoints after the same steps): the checkpoint's writer
waits up to the collective's deadline for the listed shards (``ElasticCheckpoints.manifest``), and
a member dead since the vote never writes its own, so the writer starts the next step late; an
agreement on the store holds every member until it arrives, where a reused one would send its
row partners into the pipeline, whose deadline is shorter.
A member that drops its links between the vote and the next step (a partner found dead) trains
nothing of a reused step: its stage's counts miss its row, the step commits nowhere, and the next
agrees on the store.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshlearn.distributed.collectives import FramedCollectives, Lost, Refused
from meshlearn.distributed.streams import StreamConnector
from meshlearn.elastic.control_quorum import all_pairs
from meshlearn.elastic.quorum import CommitVote
from meshlearn.elastic.rows import Agreed, Held, RowAgreement
from meshlearn.mesh.topology import MeshShape, WorkerId

Outcome = tuple[bool, bool]
"""(the step commits, the next step reuses its row agreement)."""


def decision_key(step: int) -> str:
    """Where a step's outcome is fixed when a stream failed: the first proposal stands."""
    return f"pvote/{step}/decision"


def encode_outcome(outcome: Outcome) -> str:
    return f"{int(outcome[0])}{int(outcome[1])}"


def decode_outcome(raw: bytes | str) -> Outcome:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return text[:1] == "1", text[1:2] == "1"


class Connecting:
    """The vote's streams of one step, connected in a thread; ``framed`` once they all are, ``error``
    if they did not. A member that stops waiting (``abandon``) leaves them to be closed when they
    come."""

    def __init__(self, connect: Callable[[], FramedCollectives]):
        self.framed: FramedCollectives | None = None
        self.error: str | None = None
        self.lock = threading.Lock()
        self.abandoned = False
        self.thread = threading.Thread(target=self._run, args=(connect,), name="pvote-connect", daemon=True)
        self.thread.start()

    def _run(self, connect: Callable[[], FramedCollectives]) -> None:
        try:
            framed = connect()
        except (TimeoutError, OSError, dist.DistStoreError) as err:  # a member gone since it reported
            self.error = str(err)
            return
        with self.lock:
            self.framed = framed
            if self.abandoned:
                framed.close(wait_s=0)

    def wait(self, seconds: float) -> bool:
        """Whether the connecting is over (connected or failed) within ``seconds``."""
        self.thread.join(seconds)
        return not self.thread.is_alive()

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
            if self.framed is not None:
                self.framed.close(wait_s=0.5)


class PeerVote:
    """``CommitVote``'s interface (``decide``), over the group's streams; ``regroup`` at each step
    whose rows were agreed on the store; ``reuse``: whether the next step reuses them.
    ``store``: the run's store under ``elastic/`` (the fallback's keys); ``connector``: makes the
    streams, in their own thread (so with a store client of its own); ``fallback``: the store's
    vote, for a step whose agreement was not complete (fixed at its deadline: some member may vote
    without being in the group); ``steady``: this member's second bit (the driver's ``steady``);
    deadlines: ``collective_s`` for a round, ``connect_s`` for connecting the streams."""

    def __init__(self, store, connector: StreamConnector, mesh: MeshShape, me: WorkerId,
                 fallback: CommitVote, collective_s: float, connect_s: float, steady: Callable[[], bool]):
        self.store, self.connector, self.mesh, self.me = store, connector, mesh, me
        self.fallback, self.collective_s, self.connect_s = fallback, collective_s, connect_s
        self.steady = steady
        self.connecting: Connecting | None = None
        self.connect_until = 0.0  # the monotonic time the group's streams must have connected by
        self.group: list[int] = []  # the group's ranks, in rank order
        self.mode = "store"  # "peers", "alone" (the group is this member), "store", "broken"
        self.reuse = False
        self.settled_by_store = 0  # steps this member adopted from the store (fallbacks and "store")

    def regroup(self, step: int, agreed: Agreed) -> None:
        """Step ``step``'s rows were agreed on the store: the group is its members, on new streams
        (connecting while the step runs)."""
        self.close()
        self.reuse = False
        if not agreed.complete or self.me not in agreed.present:
            self.mode = "store"
            return
        self.group = sorted(self.mesh.rank(w) for w in agreed.present)
        if len(self.group) == 1:
            self.mode = "alone"
            return
        self.connecting = Connecting(lambda: self._connect(step, agreed.present))
        self.connect_until = time.monotonic() + self.connect_s
        self.mode = "peers"

    def decide(self, step: int, me: WorkerId, participants: int, ok: bool) -> bool:
        """Whether step ``step`` commits, the same in every process; sets ``reuse``."""
        if self.mode == "store":
            self.settled_by_store += 1
            self.reuse = False
            return self.fallback.decide(step, me, participants, ok)
        if self.mode == "alone":
            outcome = (ok, ok and self.steady())
        elif self.mode == "broken":
            outcome = self._settle(step, (False, False))
        else:
            outcome = self._connected(step)
            if outcome is None:
                outcome = self._rounds(step, ok, self.steady())
        self.reuse = outcome[1]
        return outcome[0]

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.abandon()
        self.connecting = None

    def _connected(self, step: int) -> Outcome | None:
        """Wait for the group's streams; None once they are there, else the outcome this member
        adopts without them: the store's, which another member's fallback has fixed, or its own
        fallback's once they failed (or the connect deadline passed)."""
        pause = 1e-3
        while not self.connecting.wait(pause):
            if time.monotonic() > self.connect_until:
                return self._settle(step, (False, False))
            key = decision_key(step)
            if self.store.check([key]):
                self.close()
                self.mode = "broken"
                self.settled_by_store += 1
                return decode_outcome(self.store.get(key))
            pause = min(2 * pause, 0.05)
        if self.connecting.framed is None:
            print(f"meshlearn worker {self.me}: the vote's streams did not connect "
                  f"({self.connecting.error}); it votes through the store", file=sys.stderr, flush=True)
            return self._settle(step, (False, False))
        return None

    def _rounds(self, step: int, ok: bool, steady: bool) -> Outcome:
        framed = self.connecting.framed
        known: Outcome | None = None
        try:
            verdicts = framed.all_gather(torch.tensor([float(ok), float(steady)]), self.group)
            commit = all(float(v[0]) == 1.0 for v in verdicts)
            known = (commit, commit and all(float(v[1]) == 1.0 for v in verdicts))
            sent = torch.tensor([float(known[0]), float(known[1])])
            outcomes = framed.all_gather(sent, self.group)
        except (Lost, Refused):
            return self._settle(step, known or (False, False))
        if any(not torch.equal(o, sent) for o in outcomes):  # no honest member sends another
            return self._settle(step, known)
        return known

    def _settle(self, step: int, proposal: Outcome) -> Outcome:
        """The fallback: close this member's streams (the others' next reads fail at once), then
        the first proposal on the store is the outcome."""
        self.close()
        self.mode = "broken"
        self.settled_by_store += 1
        won = self.store.compare_set(decision_key(step), "", encode_outcome(proposal))
        return decode_outcome(won)

    def _connect(self, step: int, members: tuple[WorkerId, ...]) -> FramedCollectives:
        """Streams between every ordered pair of ``members``, on a channel of this step's."""
        return all_pairs(self.connector, self.mesh, self.me, list(members), f"pvote-{step}",
                         self.connect_s, self.collective_s)


class ReusedRows:
    """``RowAgreement``'s interface (``agree``): the last agreement again while the vote's outcome
    says so (``PeerVote.reuse``) and no checkpoint was taken since the vote, else a new one on the
    store, which regroups the vote. ``checkpointed(step)``: whether this process took a
    checkpoint after step ``step`` ran (``ElasticCheckpoints.taken_since``; every process takes
    them after the same steps). ``at``: the step of the agreement in use (made on the store)."""

    def __init__(self, agreement: RowAgreement, vote: PeerVote,
                 checkpointed: Callable[[int], bool] = lambda step: False):
        self.agreement, self.vote, self.checkpointed = agreement, vote, checkpointed
        self.last: Agreed | None = None
        self.at = -1

    def agree(self, step: int, me: WorkerId, participants: int, held: Held | None) -> Agreed:
        if self.vote.reuse and self.last is not None and not self.checkpointed(step - 1):
            return dataclasses.replace(self.last, reused=True)
        agreed = self.agreement.agree(step, me, participants, held)
        self.vote.regroup(step, agreed)
        self.last, self.at = agreed, step
        return agreed
