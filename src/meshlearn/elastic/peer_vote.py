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
silent past the deadline, sends the member to the store (the *fallback*): it proposes the outcome
if it completed round 1 (else "no commit"), with compare-and-set on ``pvote/<step>/decision``,
adopts the value stored (the first proposal), and only then closes its streams (so whoever falls
back because of it finds its proposal first). A member whose streams have not all connected by
the vote waits for them, reading that key meanwhile: another's fallback settles the step for it too
(it sent no verdict, so nobody adopted one without the store).

**Speculation: round 2 off the critical path.** A member whose round 1 says (commit, reuse) —
every verdict (1, 1) — applies the update at once and goes on with the next step (same rows,
same stage records); round 2 runs in a thread meanwhile (``SecondRound``) and is settled
(``settle``) before the next step's vote, and earlier wherever the state is read as committed
(the driver: the step's record at a last stage, a drain's evaluation and checkpoint, a heal, the
end). If the settle finds every outcome, the step stands; if not, the member falls back with the
outcome it applied, and if the store says "no commit" it rolls the update back exactly
(``Rollback``: weights, optimizer, spectral anchors and strategy state). Every other outcome
runs round 2 at once, as before. A member whose round 1 fails proposes "no commit" as
``01`` (*kept*: no commit, the next step keeps the rows and the stage records) if its own
verdict was (1, 1) — others may have all the verdicts and be speculating — else ``00``.

**Why every process adopts one outcome** (so a step commits in every stage or in none). Adopting
without the store needs every member's outcome, and a member sends one only after it completed
round 1 — with the same verdicts as everyone else (each member sends the same verdict to all).
So if anyone adopted an outcome X without the store, every member completed round 1 and every
proposal in the fallback is X: the stored value is X. If nobody did, all adopt the stored value.
Speculation changes when a member acts, not what it finally adopts: a speculating member holds
X = (1, 1) and adopts X (all outcomes came) or the stored value (its own proposal is X), so the
final value is the same in every process. Only the stored value may differ from what it applied,
and then it is a round-1 failer's "no commit" (every other proposal of a speculated step is X: a
member that completed round 1 got X; a member already fallen back sent no verdict, so nobody could
speculate): the update is undone in every process that applied it, and nobody else applied it.
The step after a speculated one is the same shape everywhere: speculating members start it with
the rows and records kept; a round-1 failer stored ``01``, so it and everyone adopting ``01`` keep
them too (the quorum's fast path is taken whatever a member saw: ``ControlQuorum.settled``; the
rows are reused even after a checkpoint). That step commits nowhere: every member of it has
fallen back (a speculating one at its settle, which proposes "no commit" for it before closing,
``_settle(then=…)``), so its vote goes through the store with ``00``, and every member's state
before it is the one before the undone update; the one after agrees rows and records anew. A
checkpoint holds only settled steps (the driver settles at a drain before anything is saved), and
a step settled as "no commit" is rolled back before its record is written (a last stage that may
write it settles at its step's end: the next step's first activations reach it one link later
anyway; one that knows the records are another's, ``ElasticRecords.keeps``, does not: on three
machines its settle delayed its row's next step, docs/elastic.md).
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


class SecondRound:
    """The vote's second round of step ``step`` (every member's outcome ``known``), in a thread
    of its own: it runs while the next step does; ``agreed`` waits for it."""

    def __init__(self, framed: FramedCollectives, group: list[int], step: int, known: Outcome):
        self.step, self.known = step, known
        self.same = False
        self.thread = threading.Thread(target=self._run, args=(framed, group), name="pvote-settle",
                                       daemon=True)
        self.thread.start()

    def _run(self, framed: FramedCollectives, group: list[int]) -> None:
        sent = torch.tensor([float(self.known[0]), float(self.known[1])])
        try:
            outcomes = framed.all_gather(sent, group)
        except (Lost, Refused, OSError):  # OSError: this member closed its streams meanwhile
            return
        self.same = all(torch.equal(o, sent) for o in outcomes)  # no honest member sends another

    def agreed(self) -> bool:
        """Whether every member sent the same outcome (each completed the first round), within the
        collective's deadline."""
        self.thread.join()
        return self.same


class PeerVote:
    """``CommitVote``'s interface (``decide``), over the group's streams; ``regroup`` at each step
    whose rows were agreed on the store; ``reuse``: whether the next step reuses them.
    ``store``: the run's store under ``elastic/`` (the fallback's keys); ``connector``: makes the
    streams, in their own thread (so with a store client of its own); ``fallback``: the store's
    vote, for a step whose agreement was not complete (fixed at its deadline: some member may vote
    without being in the group); ``steady``: this member's second bit (the driver's ``steady``);
    deadlines: ``collective_s`` for a round, ``connect_s`` for connecting the streams.
    ``heard``: the members whose verdicts of the last step this member received (all of its group
    once round 1 completed; none when it went to the store): each did what comes before its verdict
    (``ElasticRecords.after_vote`` relies on the preferred writer's claim)."""

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
        self.kept = False  # the last outcome: no commit, the next step keeps everything (and fails)
        self.heard: tuple[WorkerId, ...] = ()
        self.settled_by_store = 0  # steps this member adopted from the store (fallbacks and "store")
        self.pending: SecondRound | None = None  # the step decided at its first round, not settled
        self.undone = 0  # steps this member applied at their first round that did not commit

    def regroup(self, step: int, agreed: Agreed) -> None:
        """Step ``step``'s rows were agreed on the store: the group is its members, on new streams
        (connecting while the step runs). The step before is settled by now (``settle``: every
        process calls it before a checkpoint, after which rows are agreed on the store)."""
        if self.pending is not None:
            raise RuntimeError(f"{self.me}: step {self.pending.step + 1}'s vote is not settled "
                               f"before step {step + 1}'s rows are agreed on the store")
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

    @property
    def speculative(self) -> bool:
        """Whether the step just decided committed at its first round, its outcome not settled yet
        (``settle``): the caller keeps what it needs to roll the update back."""
        return self.pending is not None

    def settle(self) -> bool:
        """Settle the step decided at its first round (its second round ran meanwhile): True if
        the mesh did not commit it after all, so the caller rolls its update back (exactly, and
        before anything reads it: a checkpoint, an evaluation, the step's record). Called before
        every ``decide``; sets ``reuse``. A member whose second round failed falls back to the
        store, proposing the outcome it applied; the step after it commits nowhere (it votes in
        it through the store)."""
        pending, self.pending = self.pending, None
        if pending is None or pending.agreed():
            return False
        outcome = self._settle(pending.step, pending.known, then=pending.step + 1)
        self.reuse = outcome[1]
        self.kept = not outcome[0] and outcome[1]
        if outcome[0]:
            return False
        self.undone += 1
        return True

    def decide(self, step: int, me: WorkerId, participants: int, ok: bool) -> bool:
        """Whether step ``step`` commits, the same in every process (once settled: ``speculative``);
        sets ``reuse`` and ``heard``. The step before must be settled (``settle``)."""
        self.heard = ()
        if self.pending is not None:
            raise RuntimeError(f"{self.me}: step {self.pending.step + 1}'s vote is not settled "
                               f"before step {step + 1}'s")
        if self.mode == "store":
            self.settled_by_store += 1
            self.reuse = self.kept = False
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
        self.kept = not outcome[0] and outcome[1]
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
        try:
            verdicts = self._verdicts(framed, step, ok, steady)
        except (Lost, Refused):  # others may have all the verdicts, and speculate if all say (1, 1)
            return self._settle(step, (False, ok and steady))
        commit = all(float(v[0]) == 1.0 for v in verdicts)
        known = (commit, commit and all(float(v[1]) == 1.0 for v in verdicts))
        if known == (True, True):  # applied now; the second round completes during the next step
            self.pending = SecondRound(framed, self.group, step, known)
            return known
        sent = torch.tensor([float(known[0]), float(known[1])])
        try:
            outcomes = framed.all_gather(sent, self.group)
        except (Lost, Refused):
            return self._settle(step, known)
        if any(not torch.equal(o, sent) for o in outcomes):  # no honest member sends another
            return self._settle(step, known)
        return known

    def _verdicts(self, framed: FramedCollectives, step: int, ok: bool, steady: bool) -> list[torch.Tensor]:
        """The first round: every member's (commit bit, steady bit) for step ``step``."""
        verdicts = framed.all_gather(torch.tensor([float(ok), float(steady)]), self.group)
        self.heard = tuple(self.mesh.worker(rank) for rank in self.group)
        return verdicts

    def _settle(self, step: int, proposal: Outcome, then: int | None = None) -> Outcome:
        """The fallback: the first proposal on the store is the outcome. This member proposes,
        also plain "no commit" for step ``then`` (one it will not vote in over its streams: nobody
        completes that step's first round, so nobody speculates on it), and only then closes its
        streams (the others' next reads fail at once): whoever falls back because of this member
        finds its proposals stored first."""
        won = decode_outcome(self.store.compare_set(decision_key(step), "", encode_outcome(proposal)))
        if then is not None:
            self.store.compare_set(decision_key(then), "", encode_outcome((False, False)))
        self.close()
        self.mode = "broken"
        self.settled_by_store += 1
        return won

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
        if self.vote.reuse and self.last is not None and (self.vote.kept or not self.checkpointed(step - 1)):
            return dataclasses.replace(self.last, reused=True)
        agreed = self.agreement.agree(step, me, participants, held)
        self.vote.regroup(step, agreed)
        self.last, self.at = agreed, step
        return agreed
