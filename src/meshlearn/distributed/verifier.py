"""The SENTINEL verifier process of a dist run: every pipeline message passes through it.

With ``verify.name = "sentinel"`` the launcher (or torchrun) starts one rank more than the D × P
workers: rank D·P runs no model. It holds the unchanged ``Sentinel`` — every boundary verifier and
the ledger — and relays the pipeline, store and forward: worker (r, s) → verifier → worker
(r, s ± 1), each hop on a connection of its own per direction (``groups.py``: a TCP stream under
``dist.links = auto``, which no byte count a worker sends can abort; a gloo group with
``collective``), so a worker receives pipeline messages from the verifier only. Per message, in arrival order:

1. the *slot*: which step the message belongs to is read off its link's arrival count, never off
   its header — every schedule sends a link's messages step by step, M per step (async
   included), so message n of a link is of step n // M, and of microbatch ``send_order``'s
   (n mod M)-th (what a message whose header cannot be read is taken for);
   after a step that ends in evaluation, replica 0's forward links carry the validation batches
   next, relayed unverified (the simulator does not verify evaluation either);
2. the receiver's checks, before anything decodes it: the route (a message's kind and destination
   must be its link's) and ``WireGuard.admit`` with the slot's step — a forged message becomes a
   quarantined stand-in with a rejection record, as in the simulator, where the receiver's guard
   runs before the monitors; bytes the transport refused unread (``Forged``: no valid message, or
   a frame or oversize notice beyond ``wire.message_bound``) become the same stand-in;
3. ``Sentinel.inspect``, then the result — the message, a replacement or a skip-marked one — goes
   on to the link's destination (unshaped: the sender's hop already paced it to the logical
   link's profile).

Once all 2·(P − 1)·D·M messages of step t went through (dropped microbatches still send, their
later messages neutralized), it closes the step — ``Sentinel.end_step`` — and posts the verdict on
the store (``verdict_board.py``). Steps close in order: each link carries step t's messages before
step t + 1's.

- Flushing schedules: no message of step t + 1 exists before step t closed; every step ends at a
  drain point, so each ban's donor is chosen and the slot readmitted at the close, and every
  worker reads the verdict at its step's end (the trust plugin scores it, logs it (rank 0) and
  carries the bans out: the donor's state crosses the stage's DP group).
- ``async``: steps overlap. The Sentinel lags its view by the workers' feed lookahead L, as in
  the simulator (a step-u message exists only once stage 0 has finished step u − L − 1, whose
  messages all came through here first). A ban is pending until the next drain point; rank 0
  posts each drain point on the store before the drain's gather (``drained/<t>``), so the
  verifier learns whether step t drained when step t + 1's first message arrives — none can
  exist before — and only then readmits the pending slots and restarts its lag
  (``Sentinel.drained``), the simulator's ``TrustLayer.on_drain``. The donors are chosen at every
  close while a ban is pending, as that drain would choose them, and go with the verdict.

The verifier is trusted; it sees payloads, never weights.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

import torch

from meshlearn.assemble import resolve
from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.registry import build_codec
from meshlearn.compress.wire_checks import WireGuard
from meshlearn.config import RunConfig
from meshlearn.data import validation_batches
from meshlearn.data.corpus import load_corpus
from meshlearn.distributed.evaluation import evaluation_passes
from meshlearn.distributed.groups import Link, build_groups
from meshlearn.distributed.health import WorkerFailure, run_and_exit
from meshlearn.distributed.session import Session, train_tokenizer_once
from meshlearn.distributed.settings import derive_deadlines
from meshlearn.distributed.transport import Broken, Forged, Transport
from meshlearn.distributed.verdict_board import VerdictBoard, blob_state, state_blob
from meshlearn.distributed.wire import buffer_capacities, message_bound
from meshlearn.dp.settings import evicts_dp_outliers
from meshlearn.mesh.messages import Message, carried_kind
from meshlearn.mesh.schedule import feed_lookahead, pipeline_in_flight
from meshlearn.mesh.standin import slot_microbatch, stand_in
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.ledger import Ban
from meshlearn.verify.sentinel import Sentinel
from meshlearn.verify.trust import choose_donor
from meshlearn.verify.verdicts import ban_from_record, verdict_record

POLL_S = 0.2  # how often an idle verifier looks at liveness and at whether the workers are done
MAX_STATE_BYTES = 1 << 30  # the verifier's state handed back on resume (its ledger and counters)


def evaluates_after(cfg: RunConfig, step: int) -> bool:
    """Whether the trainer evaluates after 0-based ``step`` (its rule: every eval_every, and the end)."""
    return (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps


class Slots:
    """Which step each arrival on a link belongs to, from the arrival count alone (a header's step
    is the sender's claim; the guard checks it against this). ``trains(step, replica)``: elastic
    runs, whether that row trains the step (the agreed rows); a link's next step is then the next
    one its row trains — without it, every step."""

    def __init__(self, links: list[Link], microbatches: int, trains=None):
        self.microbatches = microbatches
        self.trains = trains
        self.trained = {link: 0 for link in links}  # training messages seen per link
        self.step = {link: -1 for link in links}  # the step of each link's latest training message
        self.evaluation = {link: 0 for link in links}  # validation batches still due per link

    def next(self, link: Link) -> int | None:
        """The step of the next message on ``link``, or None for a validation batch."""
        if self.evaluation[link]:
            self.evaluation[link] -= 1
            return None
        if self.trained[link] % self.microbatches == 0:  # the link's first message of a step
            step = self.step[link] + 1
            while self.trains is not None and not self.trains(step, link[0].replica):
                step += 1  # a step its row did not train (the rows of each step are fixed before it runs)
            self.step[link] = step
        self.trained[link] += 1
        return self.step[link]

    def restart(self, done: int) -> None:
        """On resume after ``done`` steps, each trained by every link."""
        self.trained = {link: done * self.microbatches for link in self.trained}
        self.step = {link: done - 1 for link in self.trained}

    def expect_evaluation(self, batches: int, rows=(0,)) -> None:
        """After a step that ends in evaluation: the forward links of ``rows`` carry ``batches``
        next (replica 0's; elastic runs evaluate through every row that trains)."""
        for src, dst in self.trained:
            if src.replica in rows and dst.stage == src.stage + 1:
                self.evaluation[(src, dst)] += batches


class RowMembership(Protocol):
    """An elastic run's rows, as the relay sees them (``elastic/evictions.py``: ``RelayMembership``)."""

    evicted: set[int]  # the replicas (rows) evicted so far

    def rows(self, step: int) -> tuple[int, ...]:
        """The rows agreed to train ``step``."""

    def trains(self, step: int, replica: int) -> bool:
        """Whether row ``replica`` trains ``step`` (agreed, and not evicted)."""

    def evict(self, ban: Ban) -> None:
        """Carry out ``ban``: its row leaves the run for good."""

    def left(self, wid: WorkerId) -> bool:
        """Whether ``wid`` was evicted."""


RelayLinks = Callable[[RunConfig, Session], tuple[dict[Link, tuple], RowMembership]]


class Relay:
    """The verifier's loop: receive, check, inspect, forward; close each step and post its verdict."""

    def __init__(self, cfg: RunConfig, session: Session, links: dict[Link, tuple], eval_batches: int,
                 board: VerdictBoard | None = None, membership: RowMembership | None = None):
        self.cfg = cfg
        self.mesh: MeshShape = session.mesh
        self.health = session.health
        self.eval_batches = eval_batches  # messages per forward link per evaluation (batches × passes)
        self.microbatches = cfg.mesh.microbatches
        self.micro = cfg.train.batch_size // self.mesh.replicas // self.microbatches
        self.sentinel = Sentinel(cfg.verify, self.mesh, build_codec(cfg.codec, cfg.model))
        self.guard = WireGuard(build_codec(cfg.codec, cfg.model), cfg.model.seq_len, cfg.model.d_model,
                               cfg.model.vocab_size)
        self.capacity, self.eval_capacity = buffer_capacities(cfg)
        message_bytes = self.micro * cfg.model.seq_len * cfg.model.d_model * 4
        deadlines = derive_deadlines(cfg.dist, cfg.link, message_bytes, 2 * self.microbatches, 0,
                                     self.mesh.replicas)
        self.transport = Transport(None, self.mesh, links, {}, torch.device("cpu"), self.health,
                                   deadlines.message_s, message_bound(cfg, 0))  # acts and grads only
        for link in links:  # receives stay posted for the whole run, WINDOW ahead per link
            self.transport.expect_link(link, sys.maxsize, self.capacity)
        # Elastic runs: the rows agreed per step, and the rows evicted (elastic/evictions.py).
        self.membership = membership
        self.slots = Slots(list(links), self.microbatches, membership.trains if membership else None)
        self.per_step = len(links) * self.microbatches  # with every row in
        self.seen: dict[int, int] = {}
        self.board = board or VerdictBoard(self.health, deadlines.collective_s)
        self.relayed = 0
        self.deferred = cfg.mesh.schedule == "async"  # bans wait for a drain point
        if self.deferred:  # the workers' feed lookahead (DistDriver.lookahead), as in the simulator
            self.sentinel.set_lag(feed_lookahead(pipeline_in_flight(cfg)[0], self.microbatches))
        self.pending: list[Ban] = []  # async: decided, carried out at the next drain point
        self.opened = 0  # async: the latest step whose first message came through
        self.forgettable = -1  # async: verdicts up to this step may be deleted at the next drain
        self.forgotten = -1  # ... and up to this one already were
        self.drained_at = 0  # async: the steps done at the last drain point carried out here
        self.closed = 0  # steps closed
        # DP evictions are decided by the workers (dp/attribution.py), posted by rank 0 at each
        # step's end; counted here through this step, before the next step's bans are decided.
        self.outside_bans = evicts_dp_outliers(cfg)
        self.counted_through = -1
        self.cpu_started = time.process_time()  # the relay's own CPU (every thread) from here on

    def run(self) -> None:
        """Until every worker has finished (its ``done`` key): a link whose worker finished may
        close under a posted receive, which is no failure."""
        while True:
            item = self.transport.next_arrival(POLL_S)
            self.health.check()
            if isinstance(item, Message | Forged):
                self.handle(item)
            elif isinstance(item, Broken) and not self._finished(item.link[0]):
                raise WorkerFailure(self.health.abort(item.message))
            elif item is None:
                self.answer_state_request()
                if self._all_done():
                    return
            if (error := self.transport.send_error()) is not None:
                raise WorkerFailure(self.health.abort(error))

    def handle(self, item: Message | Forged) -> None:
        """One arrival, in its link's order: a validation batch goes on as it is; a training
        message goes through the receiver's checks and SENTINEL to its destination."""
        link = item.link
        if self._left(link[0]):  # an evicted worker that still sends: nobody receives it any more
            return
        step = self.slots.next(link)
        if step is None:  # a validation batch: relayed as it is, to its link's destination
            if isinstance(item, Forged):  # not verified, and no stand-in for a whole batch
                raise WorkerFailure(self.health.abort(f"{item.message}, in place of a validation batch"))
            self.transport.send(dataclasses.replace(item, dst=link[1]), self.eval_capacity, shaped=False)
            return
        if self.deferred and step > self.opened:
            self.open(step)
        message = self.admit(item, link, step) if isinstance(item, Message) else self.refuse(item, step)
        delivered = self.sentinel.inspect(message)
        self.transport.send(delivered, self.capacity, shaped=False)
        self.relayed += 1
        self.seen[step] = self.seen.get(step, 0) + 1
        if self.seen[step] == self.expected(step):
            self.close(step)

    def expected(self, step: int) -> int:
        """The messages of ``step``: every link's M, or (elastic) those of the rows that train it."""
        if self.membership is None:
            return self.per_step
        rows = self.membership.rows(step)
        return sum(src.replica in rows for src, _ in self.slots.trained) * self.microbatches

    def micro_of(self, step: int) -> int:
        """Sequences per microbatch in ``step``: the rows that train it split the global batch."""
        rows = len(self.membership.rows(step)) if self.membership is not None else self.mesh.replicas
        return self.cfg.train.batch_size // rows // self.microbatches

    def admit(self, message: Message, link: Link, step: int) -> Message:
        """The receiver's checks, made here because the verifier decodes first: route, then guard."""
        src, dst = link
        kind = carried_kind(src, dst)
        if message.kind == kind and message.dst == dst:
            boundary = min(src.stage, dst.stage)  # the receiver's own context (the mask codec needs it)
            return self.guard.admit(message, step, self.micro_of(step), range(self.microbatches),
                                    lambda _kind, t, m: MessageContext(t, m, boundary, src.replica), src)
        reason = f"route: a {message.kind!r} for {message.dst} on the link {src}→{dst}"
        return self.quarantine(link, step, message.microbatch, reason)

    def refuse(self, forged: Forged, step: int) -> Message:
        """A message the transport refused unread (bytes that do not decode, or an oversize notice
        beyond the run's bound) takes its slot as a quarantined stand-in, like one the guard refuses:
        the receiver gets zeros marked skip, SENTINEL scores the sender on them, and the run goes on.
        Its microbatch is the slot's (``send_order``): the header that would name it is unreadable."""
        link = forged.link
        microbatch = slot_microbatch(self.cfg.mesh.schedule, link, self.mesh.stages, self.microbatches,
                                     self.slots.trained[link] - 1)
        return self.quarantine(link, step, microbatch, forged.reason)

    def quarantine(self, link: Link, step: int, microbatch: int, reason: str) -> Message:
        """The stand-in for a refused message of ``link`` (``mesh.standin``, as a worker's driver
        builds it), with the receiver's own context (the mask codec needs it)."""
        src, dst = link
        ctx = MessageContext(step, microbatch, min(src.stage, dst.stage), src.replica)
        return stand_in(self.guard, link, step, microbatch, self.micro_of(step), ctx, reason)

    def close(self, step: int) -> None:
        """``Sentinel.end_step`` and the verdict. Flushing schedules drain after every step: each
        ban's donor and readmission at once (``TrustLayer``'s order in the simulator, where bans
        are carried out between steps). Async: the donors the next drain would choose now."""
        del self.seen[step]
        self.count_outside_bans(step - 1)
        outcome = self.sentinel.end_step(step)
        if self.membership is not None:  # elastic: a ban is an eviction, the slot stays banned
            replacements = {}
            for ban in outcome.bans:
                self.membership.evict(ban)  # on the store before the verdict that announces it
                self.health.ignore({self.mesh.rank(WorkerId(ban.worker.replica, s))
                                    for s in range(self.mesh.stages)})
        elif self.deferred:
            self.pending += outcome.bans
            replacements = self._drain_donors()
        else:
            replacements = {}
            for ban in outcome.bans:
                replacements[ban.worker] = choose_donor(self.sentinel, self.mesh, ban.worker)
                self.sentinel.readmit(ban.worker)
        for ban in outcome.bans:
            print(f"verifier: step {step + 1}: banned {ban.worker} ({ban.boundary} {ban.kind} "
                  f"{ban.metric}, {ban.strikes} strikes); "
                  + (f"evicted: row {ban.worker.replica} leaves its stages' quorums"
                     if self.membership is not None else
                     "replaced at the next drain point" if self.deferred else
                     f"its replacement loads {replacements[ban.worker]}'s state"), flush=True)
        self.closed += 1
        record = verdict_record(step, outcome, replacements, self.guard.pop_rejections(), self.cost())
        self.board.post_verdict(step, record)
        if evaluates_after(self.cfg, step):
            rows = (0,) if self.membership is None else [r for r in self.membership.rows(step)
                                                         if r not in self.membership.evicted]
            self.slots.expect_evaluation(self.eval_batches, rows)

    def count_outside_bans(self, through: int) -> None:
        """The DP evictions of the steps up to ``through``: each spends its stage's budget in this
        ledger, as in the simulator's shared one, and its slot's record restarts (a fresh peer,
        ``Sentinel.readmit``). Rank 0 posted them at those steps' ends, before sending anything
        of a later step, so they are there by the time a later step closes (or a checkpoint)."""
        if not self.outside_bans:
            return
        for step in range(self.counted_through + 1, through + 1):
            for record in self.board.bans(step):
                ban = ban_from_record(record)
                self.sentinel.ledger.count(ban)
                self.sentinel.readmit(ban.worker)
                print(f"verifier: step {step + 1}: {ban.worker} was evicted as a DP outlier; it "
                      f"counts against stage {ban.worker.stage}'s ban budget", flush=True)
        self.counted_through = max(self.counted_through, through)

    def cost(self) -> dict:
        """The inspections' CPU time (``VerifierClock``), and the whole process's since the relay
        started: receiving, checking, inspecting, forwarding, closing steps (every thread)."""
        process = time.process_time() - self.cpu_started
        return self.sentinel.clock.summary() | {
            "process_cpu_s": process, "steps_closed": self.closed,
            "process_cpu_s_per_step": process / self.closed if self.closed else None}

    def open(self, step: int) -> None:
        """Async: the first message of ``step`` came through, so whether step − 1 ended in a drain
        point is on the store (rank 0 posts it before that drain's gather, which every sender of
        a step-``step`` message had left)."""
        assert step == self.opened + 1, f"step {step + 1} opened after step {self.opened + 1}"
        self.opened = step
        if self.drained_at != step and self.board.drained(step - 1):
            self.drain(step)

    def drain(self, done: int) -> None:
        """Async, at the drain point after ``done`` steps, as ``TrustLayer.on_drain``: the pending
        slots are readmitted (their donors went with the verdict) and the view lag restarts."""
        assert done - 1 not in self.seen, f"a drain point after step {done}, which is still open"
        donors = self._drain_donors()
        for ban in self.pending:
            self.sentinel.readmit(ban.worker)
            print(f"verifier: drain point after step {done}: {ban.worker} (banned at step {ban.step + 1}) "
                  f"replaced, loading {donors[ban.worker]}'s state", flush=True)
        self.pending = []
        self.sentinel.drained(done)
        self.drained_at = done
        # Every worker left this drain's gather, so each has read every verdict up to the
        # previous drain point (read at that drain, before it went on).
        self.board.forget(range(self.forgotten + 1, self.forgettable + 1))
        self.forgotten, self.forgettable = self.forgettable, done - 1

    # --- checkpoints: the state goes into rank 0's shard (verdict_board.py) ----------------------

    def answer_state_request(self) -> None:
        """At a checkpoint (a drain point: nothing in flight, so this idle verifier sees it): the
        drain carried out first (async; it would otherwise wait for the next step's first message),
        then everything a resumed verifier needs."""
        done = self.board.state_requested()
        if done is None:
            return
        if self.deferred and self.drained_at != done:
            self.drain(done)
        self.count_outside_bans(done - 1)
        state = {"sentinel": self.sentinel.state_dict(), "done": done}
        self.board.post_state(done, state_blob(state).numpy().tobytes())

    def restore(self, blob: bytes) -> None:
        """On resume: the state at the checkpoint's drain point (after its drain was carried out)."""
        state = blob_state(blob, "the verifier's state from rank 0's checkpoint", MAX_STATE_BYTES)
        self.sentinel.load_state_dict(state["sentinel"])
        done = state["done"]
        self.slots.restart(done)
        self.opened = self.drained_at = done
        self.counted_through = done - 1  # counted in the checkpoint's state
        self.forgotten = self.forgettable = done - 1  # a fresh store: nothing to delete before

    def _drain_donors(self) -> dict[WorkerId, WorkerId]:
        """The donor of each pending ban if the pipeline drains now: chosen one by one, each slot
        readmitted before the next choice (``TrustLayer.on_drain``), on a copy of the ledger."""
        ledger = copy.deepcopy(self.sentinel.ledger)
        donors = {}
        for ban in self.pending:
            donors[ban.worker] = choose_donor(ledger, self.mesh, ban.worker)
            ledger.readmit(ban.worker)
        return donors

    def _finished(self, wid) -> bool:
        """Whether a worker has finished (or was evicted): then its end of a link closing is no failure."""
        return self._left(wid) or self.board.store.check([f"done/{self.mesh.rank(wid)}"])

    def _left(self, wid: WorkerId) -> bool:
        """Whether ``wid`` was evicted (elastic): it left the run on purpose."""
        return self.membership is not None and self.membership.left(wid)

    def _all_done(self) -> bool:
        """Every worker still in the run has finished (an evicted one is out of it)."""
        return self.board.store.check([f"done/{self.mesh.rank(w)}" for w in self.mesh.workers()
                                       if not self._left(w)])


def run_verifier(cfg: RunConfig, run_dir: Path, resume: bool, session,
                 elastic_links: RelayLinks | None = None) -> NoReturn:
    """The verifier rank's whole life; ends the process (``run_and_exit``). ``elastic_links``: an
    elastic run's pair links and agreed rows (``elastic.evictions.elastic_relay``, given by the entry
    point); otherwise the world group's links, every row in."""
    def life() -> None:
        nonlocal cfg
        if cfg.data.tokenizer in ("bpe", "model") and not resume:
            train_tokenizer_once(cfg, run_dir, session)  # a collective of every rank
        corpus = load_corpus(cfg, Path(run_dir))
        cfg = resolve(cfg, corpus.vocab_size)
        batches = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size,
                                     cfg.model.seq_len)
        if elastic_links is not None:  # no world group: pair groups over the store, and the agreed rows
            links, membership = elastic_links(cfg, session)
        else:
            links, membership = build_groups(cfg, session.mesh, session.rank,
                                             connector=session.connector).links, None
        relay = Relay(cfg, session, links, len(batches) * evaluation_passes(cfg), membership=membership)
        if resume:  # rank 0 hands back the state it kept in its checkpoint shard
            relay.restore(relay.board.resume_state(cfg.dist.init_timeout_s))
        print(f"verifier (rank {session.rank}): SENTINEL on {len(links)} pipeline links, "
              f"{relay.per_step} messages a step" + (" with every row in" if membership else ""), flush=True)
        started = time.monotonic()
        relay.run()
        cost = relay.cost()
        print(f"verifier: done, {relay.relayed} messages in {time.monotonic() - started:.1f} s, "
              f"{cost['cpu_s']:.2f} s CPU inspecting, {cost['process_cpu_s']:.2f} s CPU in all, "
              f"{len(relay.sentinel.bans)} ban(s)", flush=True)

    run_and_exit(session.health, "verifier", "the verifier", life)
