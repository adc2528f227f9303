"""ElasticDriver: the DistDriver's pipeline, with the DP axis on one torchft quorum per stage.

What changes against the fixed-membership DistDriver (the pipeline, its messages and shaping
are the same code):

- each step starts with the stage's quorum (``StageQuorum.begin``), then the rows that train the
  step are agreed (``RowAgreement``: rows every worker of which is in its stage's quorum); they split the
  step's global batch (``data_plan``); the other live replicas spectate (``Worker.spectate``);
- the gradients are summed over the quorum (torchft's all-reduce) with two counts beside them,
  contributing replicas and sequences trained: the mean divides by the former, and a stage says
  yes only if the latter is the whole global batch (with ``dp.robust`` every member's part and
  counts are gathered, and each member's counts checked against the agreed rows instead:
  ``elastic/counts.py``);
- no collective spans the mesh: clipping is per stage at ``train.grad_clip / √P`` (as under
  ``async``), and the step's report is built from this worker's own numbers; the last stages put
  their loss sum and count beside the gradients, so every last stage holds the mean train loss
  over the contributing ones, and one of them, agreed per step, writes the step's records
  (``ElasticRecords``);
- a step commits in every stage or in none (``CommitVote`` on the store; under
  ``elastic.membership = "control"`` ``PeerVote`` over the members' streams, and the rows agreed
  at one step reused until a change: ``peer_vote.py``); a step that does not commit leaves
  every worker's weights and optimizer state as they were (``Worker.discard_update``), and its
  global batch is trained again by the next step (``batch_index`` counts committed steps);
- pipeline links are pair groups of the row's own (``RowLinks``), built at the first step the row
  trains; a worker whose pipeline partner is gone (a closed link, a silent heartbeat, or its row
  missing from a step's agreement) drops the links — a step in flight is abandoned, its work
  dropped, and the worker adds zeros to its stage's sum, so the step commits nowhere and its batch
  is trained again — and *stays*: in its stage's quorum, spectating, until its row is complete
  again (a ``meshlearn worker --join`` for the dead slot) or re-paired (rows are assignments
  stage → replica formed per step: survivors of rows broken at different stages make one row,
  and the driver's peers, links, pacers and heartbeat watch follow the agreed row); whether a
  member keeps its links or links anew, and at which step, is the row agreement's
  (``rows.Agreed``), the same for every end;
- a message-based DP strategy (DiLoCo, PowerSGD, sparse averaging) runs its rounds as sums over
  the quorum (``QuorumExchange``) inside the step, before the vote; an update that does not commit
  is rolled back (``Rollback``) and retried, as the same update ``u`` (committed updates so far), by
  the next step over the next quorum;
- with SENTINEL the links lead to the verifier process, and a ban is an eviction: the banned
  worker's row leaves before the next step (``Evictions``, elastic/evictions.py); a partner's
  death there still makes the row leave (the verifier relays the rows it started with).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from meshlearn.cluster.elastic_checkpoints import ElasticClusterCheckpoint, resume_step
from meshlearn.cluster.placement import elastic_writer
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.health import RowBroken, WorkerFailure
from meshlearn.distributed.shaping import Pacer
from meshlearn.distributed.transport import Transport
from meshlearn.dp.registry import robust_of
from meshlearn.elastic.binding import check_bound
from meshlearn.elastic.checkpoints import ElasticCheckpoints
from meshlearn.elastic.evictions import Evictions
from meshlearn.elastic.links import RowLinks, neighbours, row_peer
from meshlearn.elastic.membership import WRITER_ENV
from meshlearn.elastic.progress import ProgressBeacon
from meshlearn.elastic.quorum import CommitVote, QuorumStep, StageQuorum
from meshlearn.elastic.records import ElasticRecords
from meshlearn.elastic.rollback import Rollback
from meshlearn.elastic.rows import Agreed, Held, Row, RowAgreement, row_label, slot_row
from meshlearn.elastic.stage_reduce import StageReduce
from meshlearn.mesh.messages import Message
from meshlearn.mesh.report import AxisBytes, StepReport, run_summary
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.update import Commit, ReduceGradients
from meshlearn.mesh.update_run import Apply, Send, UpdateRun, drive
from meshlearn.mesh.worker import StepStats, StepWork


class ElasticDriver(Evictions, DistDriver):
    """This process's worker; its quorum, vote, row agreement and links are built by
    ``elastic.worker``. ``generation``: how many processes held this slot before this one."""

    def __init__(self, cfg, worker, health, device, comm, quorum: StageQuorum, vote: CommitVote,
                 rows: RowAgreement, links: RowLinks, progress, beacon: ProgressBeacon,
                 requests: Callable[[], int] | None = None):
        super().__init__(cfg, worker, health, device, comm, None, {})  # links: at the first step trained
        self.quorum = quorum
        self.vote = vote
        self.agreement = rows
        self.requests = requests  # the vote's and the row agreement's store requests so far (counted)
        self.requests_mark = 0
        self.agreed: Agreed | None = None  # the coming step's agreement
        self.links = links
        self.generation = links.generation
        self.progress = progress  # the run store: membership events, records' claims, checkpoints
        self.beacon = beacon  # this worker's last step, for workers.json (set off the step's path)
        # writes config.toml, run.json and starts metrics.jsonl: the launcher names it (a resume
        # may not start r0s{P-1}; a joiner never is); the records of each step are written by the
        # process that claims them (``records``), the summary by the last one's
        writer = os.environ.get(WRITER_ENV, str(WorkerId(0, self.mesh.stages - 1)))
        self.writes_records = writer == str(self.me)
        # a cluster run's records go to the coordinator's folder while its last stage is in the run;
        # its checkpoints are the rows' shards on the hosts that held them, agreed on the control
        # service and recorded in every host's folder (cluster/elastic_checkpoints.py)
        self.records = ElasticRecords(progress, self.mesh, self.me, lambda: self.rows,
                                      WorkerId.parse(elastic_writer(cfg)) if self.cluster else None,
                                      witness=self._witness)
        self.checkpoint_store = None if self.cluster is None else lambda run_dir: ElasticClusterCheckpoint(
            run_dir, str(self.me), self.cluster.placement.host, self.checkpoint_membership, progress,
            self.deadlines.collective_s, cfg.dist.keep_checkpoints, resume_step())
        self.current: QuorumStep | None = None
        self.uncommitted = 0  # steps this worker trained whose update was dropped everywhere
        self.spectated = 0  # steps this worker applied without training (its row incomplete)
        self.quorum_s = 0.0
        self.next_step = 0  # the step this worker is about to run (what a joiner is healed to)
        self.joined_at: int | None = None  # set when healed from a peer: the step to train from
        self.formed = False  # a quorum is already formed for the coming step (a joiner's first)
        self.rows: tuple[Row, ...] = ()  # the rows that train the coming step (agreed)
        self.batch_index = 0  # the global batch the coming step trains: committed steps so far
        self.trained_batch = 0  # the one the last step trained (its record's ``batch``)
        self.sequences = 0  # sequences this worker trains in the coming step (0: spectating)
        self.linked_at: int | None = None  # the step this worker's row links were built at (None: none)
        self.row: Row | None = None  # the row those links join (stage → replica)
        self.contributed_at: int | None = None  # the last step this process's row linked at
        self.events = 0  # membership events sent to the launcher (``_event``)
        self.checkpoint_membership = ElasticCheckpoints(progress, self.mesh, self.me, lambda: self.rows,
                                                        self.deadlines.collective_s)
        last = self.me.stage == self.mesh.stages - 1
        self.reduce = StageReduce(worker, quorum, self.dp_axis, self.me, last, cfg.train.batch_size,
                                  cfg.mesh.microbatches)
        if self.dp_axis.strategy is not None:  # a message-based strategy: its rounds are quorum reduces
            self.dp_axis.strategy.exchange = self.reduce.exchange(self.mesh.replicas, robust_of(cfg.dp))
        self.setup_verification(cfg)
        # A re-paired row links this worker to any replica of its neighbouring stages: a pacer
        # per such destination, each with its own link model (one per destination, as always).
        pacers = self.transport.pacers
        for s in (self.me.stage - 1, self.me.stage + 1):
            for r in range(self.mesh.replicas) if 0 <= s < self.mesh.stages else ():
                peer = WorkerId(r, s)
                if peer not in pacers:
                    pacers[peer] = Pacer(self.network.link(self.me, peer), self.epoch, self.shaped)

    # --- joining: what a live peer hands a new replica of its stage (torchft's healing) ---------

    def heal_state(self) -> dict:
        """Called by torchft in a live replica, at the quorum of step ``next_step``."""
        return {"worker": self.worker.state_dict(), "step": self.next_step, "busy_s": self.busy_s,
                "batch_index": self.batch_index}

    def load_heal_state(self, state: dict) -> None:
        """The peer's state, less what is the peer's own (``DPStrategy.reset_local``: its error
        feedback, its drift since the last sync); docs/elastic.md lists what a joiner gets."""
        self.worker.load_state_dict(state["worker"])
        if self.dp_axis.strategy is not None:
            self.dp_axis.strategy.reset_local()
        self.joined_at = state["step"]
        self.batch_index = state["batch_index"]

    def join(self) -> None:
        """A new replica: take part in the stage's next quorum, which heals it from a live peer;
        ``joined_at`` is then the step it runs from (the Trainer starts there)."""
        self.current = self.quorum.begin()
        self.formed = True
        check_bound(os.getpid(), self.cfg.elastic.host, f"worker {self.me}")
        if self.joined_at is None:
            raise RuntimeError(f"{self.me} joined a quorum of {self.current.participants} replicas "
                               "but was not healed: nobody in it had trained yet")
        self.progress.set(f"elastic/joined/{self.me}/{self.generation}",
                          json.dumps({"step": self.joined_at, "pid": os.getpid(), "at": time.time()}))
        print(f"meshlearn worker {self.me}: joined at step {self.joined_at + 1}, healed from a live "
              f"replica of stage {self.me.stage} ({self.current.participants} in the quorum)", flush=True)

    # --- one step: the quorum, the rows that train it, then train or spectate ------------------

    def run_step(self, step: int, source) -> list[StepReport]:
        self.check_eviction()  # banned at the end of the last step: its row leaves before this one
        self.next_step = step
        self._check_row(step)  # a partner's death noticed since the last step: drop the row's links
        first = self.current is None
        if self.formed:  # a joiner's first step: its quorum is the one it healed in
            self.formed = False
        else:
            self.current = self.quorum.begin()
        if first:  # every socket of torchft's exists now: prove none is on another address
            check_bound(os.getpid(), self.cfg.elastic.host, f"worker {self.me}")
        self.quorum_s += self.current.quorum_s
        held = self._held()
        self.requests_mark = self.requests() if self.requests is not None else 0
        agreed = self.agreement.agree(step, self.me, self.current.participants, held)
        self.agreed, self.rows = agreed, agreed.rows
        if not self.rows:  # some stage has no live replica that is not evicted (SENTINEL: no re-pairing)
            raise WorkerFailure(f"no pipeline row is complete in step {step + 1}'s quorums: every row "
                                f"lost a stage replica, so nothing can train (noticed by {self.me})")
        self.records.after_quorum(step)  # before the all-reduce: the file stays in step order
        # Every live member of the row reads this agreement: all drop their links at this step, or
        # all link (again) at it, whatever each of them noticed alone.
        drop, link_at = agreed.plan(self.me, held)
        if agreed.reused and link_at is not None:  # it dropped its row's links since the vote: it
            drop, link_at = held is not None, None  # trains nothing, so the step commits nowhere
        row = agreed.row_of(self.me)
        if drop and link_at is None and not self.links.relayed:
            self._drop_links(step, f"its links are not its row's of the reused agreement at step {step + 1}"
                             if agreed.reused else f"its row is not complete in step {step + 1}'s quorums")
        if link_at is not None:
            self._link_row(link_at, row)
        trains = row is not None and self.linked_at is not None
        reports = super().run_step(step, source) if trains else [self._spectate(step, source)]
        self.beacon.report(step + 1)
        return reports

    def steady(self) -> bool:
        """Whether nothing this worker knows of asks for a new row agreement at the next step (its
        bit in the peer vote, ``peer_vote.py``): its stage's record stands (no sum failed or flagged
        a change), and it holds the links the agreement gave its row."""
        row = self.agreed.row_of(self.me) if self.agreed is not None else None
        target = None if row is None else (row, self.agreed.linked_at[row])
        return self.agreed is not None and self.quorum.unchanged() and self._held() == target

    def _held(self) -> Held | None:
        """The links this worker holds, as it reports them to the row agreement."""
        return None if self.linked_at is None else (self.row, self.linked_at)

    def data_plan(self, step: int) -> tuple[int, tuple[Row, ...]]:
        """(the global batch step ``step`` trains, the rows that split it): see ``Trainer.work``."""
        return self.batch_index, self.rows

    def _link_row(self, step: int, row: Row) -> None:
        """The agreement links ``row`` (this worker's, stage → replica) at ``step`` (its first step
        trained, or its members do not all hold its links of one build): drop what this worker
        holds, link anew to the row's workers of the neighbouring stages, and their deaths become
        its concern (they are all in their quorums: the slots name live processes). A partner
        found dead while linking breaks the row: this worker spectates the step."""
        held, previous = self.linked_at, self.row
        if held is not None:
            self._unlink(f"its row links anew at step {step + 1}")
        members = {self.mesh.rank(WorkerId(r, s)) for s, r in enumerate(row)}
        verifier = {self.mesh.world_size} if self.verdicts is not None else set()  # its rank, after ours
        self.health.watch(members | verifier)
        try:
            groups = self.links.build(step, row, self.health.check)
        except RowBroken as err:  # (relayed links are built once, at the start: no partner died yet)
            self.health.forget_row()
            self.links.drop(row, step, str(err))  # partners that linked with it already need not wait
            self._spectates(step, str(err))
            return
        self._replace_transport(groups, wait_s=1.0)
        check_bound(os.getpid(), self.cfg.elastic.host, f"worker {self.me}")  # the links' sockets too
        self.linked_at, self.row = step, row
        self.prev, self.next = row_peer(row, self.me.stage - 1), row_peer(row, self.me.stage + 1)
        if not self.links.relayed:
            self.health.follow(self.links.dropped_key(row, step))
        label = row_label(row)
        if row != previous and row != slot_row(self.me.replica, self.mesh.stages):
            self._event("repaired", step, row=label, partners=[str(p) for p in neighbours(row, self.me)])
        elif held is not None:
            self._event("relinks", step, row=label,
                        why=f"not every member of its row held its links of step {held + 1}")
        elif self.joined_at is not None or self.contributed_at is not None:  # not the start's links
            self._event("contributes", step)
        self.contributed_at = step

    # --- a broken row: its survivors stay in their stages' quorums and spectate -----------------

    def _check_row(self, step: int) -> None:
        """Between steps: a partner found dead by the heartbeat watch breaks the row."""
        try:
            self.health.check()
        except RowBroken as err:
            self._row_broke(step, err)

    def route(self, message: Message) -> Message | None:
        """The worker addresses its slot row's neighbour; the agreed row's may be another replica.
        Nothing leaves a worker whose row broke earlier in this step (its work is abandoned)."""
        if self.linked_at is None:
            return None
        dst = {"act": self.next, "grad": self.prev}.get(message.kind, message.dst)
        return dataclasses.replace(message, dst=dst) if dst != message.dst else message

    def lost_partner(self, err: RowBroken) -> None:
        """A partner died in the middle of this step's pipeline: the step's microbatches in flight
        are dropped (it cannot commit anywhere: its row was agreed to train it), and this worker
        takes part in its stage's sum as a spectator (zeros, a contribution of 0), so its stage's
        replicas are not held up; its batch is trained again by the next step."""
        self._row_broke(self.next_step, err)
        self.worker.abandon(self.next_step)
        self.sequences = 0

    def _row_broke(self, step: int, err: RowBroken) -> None:
        """A row partner died: drop the row's links, stay (with SENTINEL the verifier relays the
        links of the rows it started with and ends the run on such a death: leave, as before)."""
        if self.links.relayed:
            raise err
        self._drop_links(step, str(err))

    def _drop_links(self, step: int, why: str) -> None:
        """Step ``step`` is the first this worker does not train: close its row's links; it stays
        in its stage's quorum and spectates until the row is complete again (``_link_row``)."""
        if self.linked_at is None:
            self.health.forget_row()
            return
        self._unlink(why)
        self._spectates(step, why)

    def _spectates(self, step: int, why: str) -> None:
        self._event("spectates", step, why=why)
        print(f"meshlearn worker {self.me}: stops training at step {step + 1} ({why}); it stays in its "
              f"stage's quorum and spectates until its row is complete again", file=sys.stderr, flush=True)

    def _unlink(self, why: str) -> None:
        """Close the row's links, telling the partners why (one may be waiting on a link from this
        worker: its heartbeat monitor reads it, ``Health.follow``); no partner's death concerns
        this worker until it links again."""
        self.health.forget_row()
        self.links.drop(self.row, self.linked_at, why)
        self._replace_transport({}, wait_s=0)
        self.linked_at = self.row = None

    def _replace_transport(self, groups: dict, wait_s: float) -> None:
        """Links ``groups`` from now on (none: a broken row's survivor); the old links' threads are
        waited for up to ``wait_s`` each."""
        pacers = self.transport.pacers
        self.transport.close(wait_s)
        self.transport = Transport(self.me, self.mesh, groups, pacers, self.device, self.health,
                                   self.deadlines.message_s, self.max_message_bytes)

    def _witness(self, record: dict) -> None:
        """A DP outlier report of this worker's stage (not a last one, whose records go to
        metrics.jsonl), as this process saw it: a membership event for workers.json."""
        self._event("dp_outlier", record["step"] - 1, worker=record["worker"], score=record["score"],
                    count=record["count"], evicted=record.get("evicted", False))

    def _event(self, kind: str, step: int, **fields) -> None:
        """A membership event of this process for the launcher's ``workers.json`` (``membership``):
        the body first, then the count that makes it visible."""
        base = f"elastic/events/{self.me}/{self.generation}"
        self.progress.set(f"{base}/{self.events}", json.dumps({"event": kind, "step": step, **fields,
                                                               "at": time.time()}))
        self.events += 1
        self.progress.add(f"{base}/count", 1)

    def take(self, work: StepWork) -> None:
        """The coming step's work (the feeding policy feeds nothing ahead under the flushing
        schedules elastic runs: its split follows the rows agreed for it); its receives are posted
        only if this worker trains it: an agreed row's member that could not link (a partner
        found dead) trains nothing of its share."""
        trains = self.linked_at is not None
        self.sequences = work.microbatch_size * self.cfg.mesh.microbatches if trains else 0
        if self.sequences:
            super().take(work)
        else:
            self.worker.feed(work)

    def _spectate(self, step: int, source) -> StepReport:
        """A step this worker's row does not train: zero gradients into the stage's sum, then the
        update every replica of the stage applies."""
        self.feed(step, source)
        report = self.update(self.worker.spectate(), self.step_bytes.begin())
        self.step_bytes.end()
        self.worker.pop_stats(step)
        self.spectated += 1
        return report

    def update(self, action, start: AxisBytes) -> StepReport:
        """The step's update over the stage's quorum, the update protocol's actions executed with
        the quorum's collectives (``_execute_over_quorum``), and the step's report from this
        worker's own numbers (no collective spans the mesh)."""
        worker = self.worker
        step = action.microbatch // self.cfg.mesh.microbatches
        u = self.batch_index  # committed updates so far: one that does not commit is retried as u
        run = UpdateRun.of(worker, self.cfg.train.grad_clip, self.dp_axis.started, u,
                           spectator=self.sequences == 0, mesh_wide=False, votes=True,
                           collective_deadline_s=self.deadlines.collective_s)
        losses = list(worker.stats.get(step, StepStats()).losses.values())
        self.reduce.begin(self.current, self.rows, self.next_step, self.sequences > 0)
        started = time.monotonic()
        counts = [sum(losses), len(losses), float(self.sequences > 0), self.sequences]
        sq_norm, loss = self._execute_over_quorum(action, u, run, counts)
        self.dp_axis.wait_s += time.monotonic() - started
        mean_loss = loss if self.current.mean_ok else None
        bytes_pp, bytes_dp = self.step_bytes.since(start)
        return StepReport(step=step, losses=[mean_loss] if mean_loss is not None else [],
                          sim_s=None, bytes_pp=bytes_pp, bytes_dp=bytes_dp,
                          grad_norm=sq_norm**0.5, staleness=[],
                          dp_scores={w: [s] for w, s in self.reduce.scores.items()} if self.current.committed
                          else {})

    def _execute_over_quorum(self, action, u: int, run: UpdateRun,
                             counts: list[float]) -> tuple[float, float | None]:
        """Run update ``u`` (``run``) over the quorum with this worker's ``counts`` (loss sum,
        loss count, contributing, sequences); returns (the clip's squared norm, the stage's train
        loss: None where no contributor has one).

        The counts ride with the gradients' sum (``ReduceGradients``: the mean divides by the
        contributing replicas) or, for a strategy, are a sum of their own before its phases, whose
        rounds are sums over the quorum too (``QuorumExchange``). The stage says yes only if the
        whole global batch was trained by the agreed rows (no sequence of a committed step missing
        or counted twice). With a robust rule they are gathered instead, each member's checked
        against the agreement (``elastic/counts.py``): a member that lies about them is left out
        of the step's reduce and scored ∞. A step that does not commit applies nothing after its ``Commit``;
        what came before is undone: the gradients dropped (``discard_update``) and, for a strategy,
        its state and any optimizer step its rounds followed (``Rollback``). A spectator adds
        zeros to every sum, applies what its peers apply, and forgets what would be its own
        (``reset_local``)."""
        worker, current, strategy = self.worker, self.current, self.dp_axis.strategy
        trains = self.sequences > 0
        rollback = None
        loss = None
        if strategy is not None:
            rollback = Rollback(worker, weights=strategy.post_rounds(u))
            strategy.exchange.contributes = trains
            loss = self.reduce.strategy_counts(counts, strategy.exchange)

        def reduce(act: ReduceGradients) -> None:
            nonlocal loss
            stage = self.reduce
            loss = stage.robustly(counts, act.rule) if act.rule.gathers else stage.gradients(counts)

        step = action.microbatch // self.cfg.mesh.microbatches
        outcome = drive(run, {ReduceGradients: reduce, Send: self._no_messages,  # rounds are quorum sums
                              Commit: lambda _act: self._decide(step),
                              Apply: lambda act: self._apply(action, act.coefficient, act.sq_norm)})
        current.committed = outcome.committed
        self.trained_batch = self.batch_index
        if current.committed:
            self.batch_index += 1
        else:
            self.uncommitted += 1
            if not outcome.stepped:
                worker.discard_update(action)
            if rollback is not None:
                rollback.restore(worker)
        return outcome.sq_norm, loss

    def _decide(self, step: int) -> bool:
        """This stage's verdict (torchft's, and the whole batch from the agreed rows), then the
        vote of every stage."""
        current = self.current
        current.stage_commit = self.quorum.should_commit() and current.mean_ok
        self.records.before_vote(step + 1)  # its records: the step after step + 1 steps
        committed = self.vote.decide(step, self.me, current.participants, current.stage_commit)
        if self.requests is not None:
            current.vote_rows_requests = self.requests() - self.requests_mark
        return committed

    def _no_messages(self, request: Send) -> float:
        """A strategy's phase sends nothing here: its rounds ran as quorum sums inside it (a
        ``Wait`` that follows is not executable here either: nothing may stay open)."""
        if request.messages:
            raise RuntimeError(f"worker {self.me}: update {request.phase.u + 1}'s DP strategy sent "
                               "messages; in an elastic run its rounds are sums over the quorum")
        return time.monotonic()

    def record_fields(self) -> dict:
        current = self.current
        if current is None:
            return {}
        return {"participants": current.participants, "rows": [row_label(r) for r in self.rows],
                "batch": self.trained_batch,
                "committed": current.committed, "quorum_s": current.quorum_s} | (
                    {} if current.requests is None else {"quorum_requests": current.requests}) | (
                    {} if current.vote_rows_requests is None
                    else {"vote_rows_requests": current.vote_rows_requests})

    @torch.no_grad()
    def evaluate(self, batches) -> float | None:
        """The evaluation plan's one pass (no averaging: the rows are identical replicas at a
        committed step; no masked pass) through this worker's own pipeline row; the last stage has
        the loss, the others return None. A row that has not trained yet has no links, and an
        evicted one sends nothing: it skips evaluation (the step's records' claimant logs its own
        value)."""
        if self.linked_at is None or self.leaving is not None:
            return None
        try:
            return self.evaluation_pass(batches, self.worker.module)
        except RowBroken as err:  # a partner died after the step: no value from this row
            self._row_broke(self.next_step + 1, err)
            return None

    def eval_fields(self) -> dict:
        return {}

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        return run_summary(f"real: elastic, {self.mesh.world_size} processes at start over {self.comm}, "
                           f"one torchft quorum per stage, shaping={self.cfg.dist.shaping}", []) | {
            "uncommitted_steps": self.uncommitted, "spectated_steps": self.spectated,
            "quorum_s_total": self.quorum_s} | self.dp_axis.summary()  # this worker's: no sum over the mesh

    def barrier(self, what: str) -> None:
        """No mesh-wide barrier: membership may have changed (checkpoints agree on their shards
        through ``checkpoint_membership`` instead)."""

    def state(self) -> dict:
        return super().state() | {"batch_index": self.batch_index}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.batch_index = state["batch_index"]

    def close(self) -> None:
        self.beacon.close(self.deadlines.collective_s)  # its last step before it says it finished
        self.progress.set(f"elastic/finished/{self.me}/{self.generation}", str(self.next_step + 1))
        with contextlib.suppress(RowBroken):  # a partner died after the last step: nothing to deliver
            self.transport.drain(self.deadlines.message_s)
        self.vote.close()
        self.quorum.shutdown()
        self.health.finish()
        self.transport.close()
