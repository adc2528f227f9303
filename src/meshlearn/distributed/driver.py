"""DistDriver: the simulator's step, executed by one real process per worker.

The Worker is the very object the SimDriver drives: this driver hands it the messages that arrive
(``receive``), asks it for work (``next_action``), runs it (``run``) and sends what it returns. The
step ends as the simulator's does, in the same order and with the same arithmetic: the pipeline,
the data-parallel mean of gradients (a sum over the stage's replicas: a process group's all-reduce,
or with untrusted links the framed collectives of ``collectives.py``), the global norm for
clipping, the update. A gather over all processes at the end of each step gives
every process the microbatch losses (only last stages compute them), the stages' squared gradient
norms and byte counters, so whichever process writes metrics logs real losses, never a placeholder.

With SENTINEL (``relay``: the verifier's rank) the pipeline links lead to the verifier process,
which relays them (``distributed/verifier.py``); the workers' collectives then run on a group of
the workers alone, and the trust plugin reaches the verifier's verdicts through ``remote_sentinel``,
the attackers' ground truth through ``exchange_truth`` and a ban's donor through ``copy_worker_state``.
"""

from __future__ import annotations

import os
import time

import torch

from meshlearn.cluster.role import role_of
from meshlearn.distributed.collectives import FramedCollectives, RunCollectives
from meshlearn.distributed.dp_axis import DPAxis, DPLinks
from meshlearn.distributed.evaluation import PipelineEvaluation
from meshlearn.distributed.groups import GroupCollectives
from meshlearn.distributed.health import Health, RowBroken, WorkerFailure, store_client
from meshlearn.distributed.pipeline_refusals import PipelineRefusals, sender_of
from meshlearn.distributed.process_rows import ProcessRows
from meshlearn.distributed.settings import derive_deadlines
from meshlearn.distributed.shaping import Pacer
from meshlearn.distributed.transport import Forged, Transport
from meshlearn.distributed.verdict_board import VerdictBoard, blob_state, state_blob
from meshlearn.distributed.wire import HEADER_ROOM, PREFIX_BYTES, buffer_capacities, message_bound
from meshlearn.mesh.feeding import Feeding, LearnVerdicts, Report, Settle, feed_policy
from meshlearn.mesh.messages import Message, carried_kind, charged_step
from meshlearn.mesh.network import build_network
from meshlearn.mesh.report import AxisBytes, ProcessRow, StepBytes, StepReport, run_summary
from meshlearn.mesh.schedule import AsyncPlan, pipeline_in_flight
from meshlearn.mesh.standin import slot_microbatch, stand_in
from meshlearn.mesh.timeline import TimelineRecorder, computed, transfer
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.update import (
    GatherNorms,
    ReduceGradients,
    Wait,
    find,
)
from meshlearn.mesh.update_run import Apply, Send, UpdateRun, drive
from meshlearn.mesh.wall_clock import WallClock
from meshlearn.mesh.worker import StepStats, StepWork, Worker
from meshlearn.net.counters import Counters
from meshlearn.verify.verdicts import RemoteSentinel


class DistDriver(PipelineEvaluation):
    """Drives this process's one worker; ``workers`` holds just it (the Trainer's view of "local").
    A ``Driver`` (mesh/driver.py) with the capabilities ``ControlChannel`` and ``RemoteVerdicts``
    (verify/capabilities.py; its ``remote_sentinel`` is None without a verifier process)."""

    def __init__(self, cfg, worker: Worker, health: Health, device: torch.device, comm: str,
                 dp_group, link_groups: dict[tuple[WorkerId, WorkerId], object], workers_group=None,
                 relay: int | None = None, framed: FramedCollectives | None = None,
                 counters: Counters | None = None):
        self.cfg = cfg
        self.mesh: MeshShape = worker.mesh
        self.me = worker.id
        self.worker = worker
        self.workers = {self.me: worker}
        self.rank = self.mesh.rank(self.me)
        self.cluster = role_of(cfg, self.me)  # None unless a cluster host's launcher started us
        self.writes_records = self.cluster.writes_records if self.cluster else self.rank == 0
        self.shard = str(self.me)
        self.health = health
        self.device = device
        self.comm = comm
        self.relay = relay  # the verifier's rank when it relays the pipeline links
        self.shaped = cfg.dist.shaping == "sender"
        self.epoch = time.monotonic()
        self.clock = WallClock(self.epoch)
        self.network = build_network(cfg.link, cfg.links, self.mesh, cfg.seed)
        self.prev = self.mesh.prev_stage(self.me)
        self.next = self.mesh.next_stage(self.me)
        replicas = self.mesh.replicas
        self.ring_next = WorkerId((self.me.replica + 1) % replicas, self.me.stage) if replicas > 1 else None
        # Link slots of the gather, in order: to the next stage, to the previous, to the ring's next.
        self.slots = [(self.me, peer) for peer in (self.next, self.prev, self.ring_next)]
        micro = cfg.train.batch_size // replicas // cfg.mesh.microbatches
        self.deadlines = derive_deadlines(
            cfg.dist, cfg.link, message_bytes=micro * cfg.model.seq_len * cfg.model.d_model * 4,
            messages_per_step=2 * cfg.mesh.microbatches, grad_bytes=4 * worker.n_params,
            replicas=replicas, allgather=framed is not None)
        # The DP sum, the per-step gather, barriers and broadcasts: process groups, or framed
        # streams where links are not trusted (dist.trusted_links).
        self.collectives = (
            RunCollectives(framed, health, {r: str(self.mesh.worker(r)) for r in range(self.mesh.world_size)},
                           [self.mesh.rank(w) for w in self.mesh.stage_replicas(self.me.stage)],
                           self.deadlines.collective_s) if framed is not None
            else GroupCollectives(dp_group, workers_group, health, self.mesh.world_size, device,
                                  self.deadlines.collective_s))
        # The DP axis: the stage's collective, or a message-based strategy's rounds (dp_axis.py).
        self.dp_axis = DPAxis(worker, self.network, self.epoch, self.shaped, self.collectives, self.ring_next,
                              DPLinks(self._send, lambda *a: self.transport.expect(*a),
                                      lambda *a: self.transport.next_message(*a), self._deliver),
                              lambda: self.timeline)
        pacers = {peer: Pacer(self.network.link(self.me, peer), self.epoch, self.shaped)
                  for peer in (self.prev, self.next, *self.dp_axis.peers) if peer is not None}
        # A cluster run's checkpoints: each host's own shards, complete by agreement (cluster/).
        self.checkpoint_store = None if self.cluster is None else lambda run_dir: self.cluster.checkpoints(
            run_dir, store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  cfg.dist.init_timeout_s),
            health, self.deadlines.collective_s, cfg.dist.init_timeout_s, cfg.dist.keep_checkpoints)
        self.max_message_bytes = message_bound(cfg, worker.n_params)  # its stage's peers: the same size
        self.transport = Transport(self.me, self.mesh, link_groups, pacers, device, health,
                                   self.deadlines.message_s, self.max_message_bytes, relay=relay)
        if worker.guard is not None:  # a refused training message takes its slot as a stand-in
            self.transport.stand_in = self._stand_in
        # Refused pipeline messages: logged, counted under their sender (``counters``: this
        # process's record, ``groups.Groups.counters``), and bounded (distributed/pipeline_refusals.py).
        self.refusals = PipelineRefusals(str(self.me), health, Counters() if counters is None else counters,
                                         {link: sender_of(end) for link, end in link_groups.items()})
        self.capacity, self.eval_capacity = buffer_capacities(cfg)
        # A control message at a drain point (a protocol model's boundary transform: d×d fp64).
        self.control_capacity = PREFIX_BYTES + HEADER_ROOM + 8 * cfg.model.d_model ** 2
        self.step_bytes = StepBytes(self.network)
        # With a verifier: its verdicts (verify/verdicts.py) and the attackers' ground truth travel
        # through the rendezvous store, on a client of the main thread's own.
        flushes = worker.plan.flushes
        self.verdicts = (VerdictBoard(health, self.deadlines.collective_s,
                                      cleanup=self.writes_records and flushes)
                         if relay is not None else None)
        self.busy_s = 0.0
        # The step's report: this process's row, every process's once gathered (process_rows.py).
        self.process_rows = ProcessRows(self.mesh, self.network, self.slots, cfg.mesh.microbatches,
                                        self._gather)
        # The simulator's feeding rule (mesh/feeding.py), from the deepest stage of the mesh (not
        # this worker's own depth), so every process feeds equally far ahead; verified async: only
        # what this stage's plan can reach before the running step ends.
        verified = relay is not None and cfg.verify.name == "sentinel"
        own = worker.plan.in_flight if isinstance(worker.plan, AsyncPlan) else None
        deepest = pipeline_in_flight(cfg)[0] if own is not None else 1
        self.feeding = Feeding(feed_policy(cfg.mesh.microbatches, flushes, deepest, own, verdicts=verified,
                                           gathers_per_step=False))
        self.lookahead = self.feeding.policy.lookahead
        self.remote_sentinel = None
        if verified:
            board = self.verdicts
            self.remote_sentinel = RemoteSentinel(
                board.verdict, 0 if flushes else self.lookahead,
                snapshot=board.verifier_state if self.writes_records else None,
                restore=board.post_resume_state if self.writes_records else None)
        self.timeline: TimelineRecorder | None = None  # set by the timeline plugin (report.timeline_steps)
        self.anchor = None  # an AnchorClient (distributed/anchor.py) with anchor.z > 0

    @property
    def writes_run_files(self) -> bool:
        """config.toml and run.json: the records' writer; in a cluster run, each machine's first
        worker, in its own folder."""
        return self.cluster.writes_run_files if self.cluster else self.writes_records

    # --- one step ----------------------------------------------------------------------------

    def run_step(self, step: int, source) -> list[StepReport]:
        """Run this worker until it has applied step ``step``'s updates (``source``: the trainer).

        Flushing schedules end each step with the mesh-wide update, whose gather gives every
        process the step's report. Under ``async`` nothing waits for the mesh: this worker's rows
        (losses, norms, staleness, bytes) are kept and gathered at the next drain point, where
        every pending step's report comes back at once.
        """
        worker = self.worker
        if self.anchor is not None:
            self.anchor.step_start(step)
        self.feed(step, source)
        # From the previous step's end, so control messages sent at the drain point in between
        # (send_control) are in this step's bytes, as in the simulator.
        start = self.step_bytes.begin()
        report = None
        while worker.steps_done <= step:
            action = worker.next_action()
            if action is None:  # its input has not arrived yet
                self._receive_one()
            elif action.kind == "U":
                report = self.update(action, start)
            else:
                started, begun = time.perf_counter(), time.monotonic()
                outgoing = worker.run(action)
                self.busy_s += time.perf_counter() - started
                self._record(action, begun)
                for message in outgoing:
                    self._send(message, self.capacity)
        self._learn(self.feeding.before_end(step))  # a ban at step − L asks for a drain after this one
        strategy = self.dp_axis.strategy
        end = self.feeding.end(step, source, background=strategy is not None)
        if strategy is not None and Settle() in end:
            self.dp_axis.settle()
        if self.anchor is not None:  # what has arrived is used from the next update on; no wait
            self.anchor.step_end(step)
        self.step_bytes.end()
        stats = worker.pop_stats(step)
        if worker.plan.flushes:
            return [report]
        rows = self.process_rows
        rows.pending.append(self._row(stats, start))
        complete = find(end, Report)
        if complete is None:
            return []
        if self.remote_sentinel is not None and self.writes_records:
            self.verdicts.post_drained(step)  # before the gather: ahead of any next-step message
        gathered = rows.gather_steps(rows.pending)  # per step: every process's row
        rows.pending = []
        return [rows.report(complete.first + i, step_rows) for i, step_rows in enumerate(gathered)]

    @property
    def drained(self) -> bool:
        """This process's worker has nothing in flight (the other workers are other processes')."""
        return self.worker.idle

    def send_control(self, message: Message) -> None:
        """Send a control message at a drain point (a protocol model's boundary transform) on its
        pipeline link: shaped and counted like any message (in the next step's bytes); returns at
        once."""
        self.transport.send(message, self.control_capacity)

    def receive_control(self, src: WorkerId, kind: str, what: str) -> Message:
        """The next control message from ``src`` at a drain point, waited for like any message
        (``what`` names it in a timeout); DP stragglers that arrive first go to their strategy."""
        self.transport.expect(src, 1, self.control_capacity)
        while True:
            message = self.transport.next_message(what, src)
            if message.kind == "dp":
                self.dp_axis.deliver(message)
                continue
            if message.kind != kind or message.src != src:
                raise RuntimeError(f"worker {self.me}: waited for {what} from {src} at a drain point, "
                                   f"got a {message.kind!r} message from {message.src}")
            return message

    @property
    def fed(self) -> int:
        return self.feeding.fed

    def feed(self, step: int, source) -> None:
        """The feeding policy's actions (mesh/feeding.py), for this worker: the verdicts a drain
        depends on, then data up to the next drain point (or the lookahead), each step's work
        handed over by ``take``; no forward past the horizon."""
        self._learn(self.feeding.before_feed(step))
        self.feeding.hand_over(step, source, self.workers, lambda _wid, work: self.take(work))

    def _learn(self, actions: list[LearnVerdicts]) -> None:
        for action in actions:
            self.remote_sentinel.learn_through(action.through)

    # --- the extension points of a runtime built on this pipeline (elastic/driver.py) ----------
    # It overrides these four, nothing else of the step: what a step's work posts, how an update
    # reduces and what the step reports, where a message goes, and what a partner's loss means.

    def update(self, action, start: AxisBytes) -> StepReport | None:
        """Apply update ``action`` (a U) and, under a flushing schedule, return the step's report
        (under ``async`` the reports come from the drain point's gather: None). ``start``: the
        link counters at the step's start, for its bytes. Here: the mesh's collectives (the
        stage's all-reduce, or a DP strategy's rounds, and the gather)."""
        rows = self._execute(action, start)
        if rows is None:  # async: the reports come from the drain point's gather
            return None
        return self.process_rows.report(action.microbatch // self.cfg.mesh.microbatches, rows)

    def route(self, message: Message) -> Message | None:
        """Where this worker's outgoing ``message`` goes (None: nowhere, it is dropped). Here: to
        the worker it names."""
        return message

    def lost_partner(self, err: RowBroken) -> None:
        """A receive or send found a pipeline partner gone. Here no partner may go: the run ends."""
        raise err

    def take(self, work: StepWork) -> None:
        """Hand one step's work to the worker and post every receive of the step now (they
        complete in the background)."""
        self.worker.feed(work)
        M = self.cfg.mesh.microbatches
        if self.prev:  # the step names a refused message's slot (``Forged``)
            self.transport.expect(self.prev, M, self.capacity, work.step)
        if self.next:
            self.transport.expect(self.next, M, self.capacity, work.step)

    # --- the pipeline ------------------------------------------------------------------------

    def _receive_one(self) -> None:
        kind, j = self.worker.plan.peek(self.worker.horizon)
        peer, what = (self.prev, "activation") if kind == "F" else (self.next, "gradient")
        step, m = divmod(j, self.cfg.mesh.microbatches)
        try:
            self._deliver(self.transport.next_message(f"{what} of microbatch {m} (step {step + 1})", peer))
        except RowBroken as err:
            self.lost_partner(err)

    def _deliver(self, message: Message) -> None:
        """Hand an arrival to its consumer by the link it came on: a DP link's to the strategy, a
        pipeline link's to the worker."""
        # A pipeline kind on a DP link has no stand-in (nobody waits for it there); a kind lie on a
        # pipeline link, "dp" included, is the guard's: ``Worker.admit`` takes the kind from the link.
        src = message.link[0]
        if carried_kind(src, self.me) == "dp":
            if message.kind == "dp":
                self.dp_axis.deliver(message)
                return
            raise WorkerFailure(self.health.abort(
                f"worker {src} sent a {message.kind!r} message on its link to {self.me}, which carries "
                f"'dp' messages (noticed by {self.me})"))
        # Where it arrived says which (step, microbatch) it must be: a replayed or misnumbered one
        # is refused, and its stand-in fills the slot it took.
        slot = None if message.arrival is None else self._slot(src, *message.arrival)
        message = self.worker.admit(message, slot)  # a forged message is quarantined, never decoded
        rejections = self.worker.guard.pop_rejections() if self.worker.guard else []
        for rejection in rejections:
            self.refusals.refused((src, self.me), rejection)
        if not rejections:
            self.refusals.accepted((src, self.me))
        self.worker.receive(message)

    def _stand_in(self, forged: Forged) -> Message:
        """The transport refused a training message unread (``forged``): its slot (the link's
        arrival count, ``forged.index`` of its step) gets the quarantined stand-in the guard would
        have put there, and its record waits in the guard for ``_deliver``."""
        src, dst = link = forged.link
        step, microbatch = self._slot(src, forged.step, forged.index)
        j = step * self.cfg.mesh.microbatches + microbatch
        return stand_in(self.worker.guard, link, step, microbatch, self.worker.microbatch_size(j),
                        self.worker.context(carried_kind(src, dst), j, True), forged.reason)

    def _slot(self, src: WorkerId, step: int, n: int) -> tuple[int, int]:
        """The (step, microbatch) of the ``n``-th message from ``src`` in the receive posted for
        ``step``: every schedule sends a link's messages in its plan's order (``send_order``)."""
        return step, slot_microbatch(self.cfg.mesh.schedule, (src, self.me), self.mesh.stages,
                                     self.cfg.mesh.microbatches, n)

    def _apply(self, action, coef: float, sq_norm: float) -> None:
        """The optimizer step itself (busy time, and the timeline's U when recording)."""
        started, begun = time.perf_counter(), time.monotonic()
        self.worker.apply_update(action, coef, sq_norm)
        self.busy_s += time.perf_counter() - started
        self._record(action, begun)

    def _record(self, action, t0: float) -> None:
        """A compute on the monotonic clock (shared by the processes of a host)."""
        computed(self.timeline, self.me, action, self.cfg.mesh.microbatches, t0, time.monotonic())

    def _send(self, message: Message, capacity: int) -> None:
        """Hand ``message`` to the transport where ``route`` sends it."""
        routed = self.route(message)
        if routed is None:
            return
        try:
            self._transmit(routed, capacity)
        except RowBroken as err:
            self.lost_partner(err)

    def _transmit(self, message: Message, capacity: int) -> None:
        """Hand ``message`` to the transport; when its step is recorded, the link model's times for
        it (queued start, end of serialization, delivery; known only with sender-side shaping)."""
        transfer(self.timeline, charged_step(message, self.worker.steps_done), self.me, message.dst,
                 self.network.link(self.me, message.dst), message.kind, message.wire_bytes,
                 time.monotonic() - self.epoch, lambda: self.transport.send(message, capacity), self.epoch,
                 known=self.shaped)

    # --- the update protocol's actions (mesh/update.py), executed with this runtime's collectives --

    def _execute(self, action, start: AxisBytes) -> list[ProcessRow] | None:
        """Run update ``action`` (mesh/update_run.py); under a flushing schedule
        return every process's row of the step. Without a strategy the norms ride on the step's
        rows (one gather); with one, the rows are gathered after its rounds have left, so that
        their DP bytes are the step's, and the norms are a scalar gather of their own."""
        worker, axis, step = self.worker, self.dp_axis, action.microbatch // self.cfg.mesh.microbatches
        rows: list[list[ProcessRow]] = []  # the step's rows, once gathered
        stage_sq: list[float] = []  # this worker's norm as its row reports it (before the clip)

        def gather_norms(act: GatherNorms):
            stage_sq.append(worker.grad_sq_norm())
            if axis.strategy is None:
                rows.append(self._step_rows(step, start, stage_sq[0]))
                values = [row.sq_norm for row in rows[0]]
            else:
                values = self._gather(torch.tensor([stage_sq], dtype=torch.float64))[:, 0, 0].tolist()
            if act.latency and self.shaped:
                time.sleep(self.network.default.latency_s)  # the scalar exchange, as the simulator's
            return {self.mesh.worker(rank): value for rank, value in enumerate(values)}.__getitem__

        run = UpdateRun.of(worker, self.cfg.train.grad_clip, axis.started,
                           collective_deadline_s=self.deadlines.collective_s)
        drive(run, {ReduceGradients: lambda act: axis.reduce_gradients(step, act), Send: axis.send_phase,
                    Wait: axis.wait_round, GatherNorms: gather_norms,
                    Apply: lambda act: self._apply(action, act.coefficient, act.sq_norm)})
        axis.wait_s += run.pop_waited()
        if not rows and stage_sq:
            rows.append(self._step_rows(step, start, stage_sq[0]))
        return rows[0] if rows else None

    def _step_rows(self, step: int, start: AxisBytes, sq_norm: float) -> list[ProcessRow]:
        """Every process's row of ``step``, this one's with ``sq_norm`` (a gather)."""
        row = self._row(self.worker.stats.get(step, StepStats()), start, sq_norm)
        [rows] = self.process_rows.gather_steps([row])
        return rows

    def _row(self, stats: StepStats, start: AxisBytes, sq_norm: float | None = None) -> ProcessRow:
        """This process's row of a step whose link counters stood at ``start``."""
        return self.process_rows.own(stats, *self.step_bytes.since(start), self.busy_s, self.dp_axis.wait_s,
                                     sq_norm)

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's ``values`` (steps × n) → every process: (world, steps, n)."""
        return self.collectives.gather(values, "the gather of losses and norms")

    # --- evaluation, records, checkpoints ----------------------------------------------------

    def record_fields(self) -> dict:
        return {}  # no virtual clock: records carry wall time only

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        over = "framed TCP streams" if self.collectives.framed else self.comm
        return run_summary(f"real: {self.mesh.world_size} processes over {over}, "
                           f"shaping={self.cfg.dist.shaping}", **self.process_rows.usage(wall_s)
                           ) | self.dp_axis.summary(self.sum_over_workers)

    def sum_over_workers(self, values: list[float]) -> list[float]:
        """Each value summed over every worker process (a collective: all of them call it)."""
        return self._gather(torch.tensor(values, dtype=torch.float64)[None])[:, 0].sum(0).tolist()

    def state(self) -> dict:
        return {"network": self.network.state(), "busy_s": self.busy_s}

    def load_state(self, state: dict) -> None:
        self.network.load_state(state["network"])
        self.network.idle()  # its queue times are on the old process's clock
        self.busy_s = state["busy_s"]
        # A checkpoint is a drain point: the worker (loaded first) was fed exactly the steps it has
        # applied. Without this the first feed would feed, and post the receives of, every step
        # from 0 again: receives sized for training that the first evaluation's batches then meet.
        self.feeding.resume(self.worker.steps_done - 1)

    # --- with a verifier: what crosses processes for the trust layer (verify/trust.py) ----------

    def exchange_truth(self, step: int, local: dict[WorkerId, set], attackers: list[WorkerId]
                       ) -> dict[WorkerId, set]:
        """Publish this worker's attack ground truth of ``step``; the records' writer also gets every
        other attacker's (the others score nothing they write)."""
        for wid, keys in local.items():
            self.verdicts.publish_truth(step, wid, keys)
        if not self.writes_records:
            return local
        return local | {wid: self.verdicts.truth(step, wid) for wid in attackers if wid not in local}

    def post_bans(self, step: int, bans: list[dict]) -> None:
        """DP evictions of ``step`` (every process decided them alike): the writer tells the
        verifier, whose ledger counts them against the stage's budget (verify/capabilities.py)."""
        if self.writes_records and self.remote_sentinel is not None:
            self.verdicts.post_bans(step, bans)

    def copy_worker_state(self, donor: WorkerId, target: WorkerId) -> None:
        """A banned worker's replacement loads ``donor``'s state (weights, optimizer, plan): a
        broadcast over the stage's DP group, the same bytes a new peer would download. Every
        replica of the stage calls it (the verdict told all of them); the others pass."""
        if self.me.stage != donor.stage:
            return
        own = state_blob(self.worker.state_dict())
        # The donor's state has this worker's shapes: twice its own size is room to spare.
        blob = self.collectives.broadcast_state(own if self.me == donor else None, self.mesh.rank(donor),
                                                2 * own.numel(),
                                                f"the transfer of {donor}'s state to {target}")
        if self.me == target:
            self.worker.load_state_dict(blob_state(blob, f"{donor}'s state", 2 * own.numel()))

    def barrier(self, what: str) -> None:
        self.collectives.barrier(f"the barrier after the {what}")

    def close(self) -> None:
        """Clean shutdown: deliver what is queued, meet everyone, stop the threads."""
        self.transport.drain(self.deadlines.message_s)
        self.barrier("last step")
        self.health.finish()
        self.transport.close()
        self.collectives.close()
        if self.anchor is not None:
            self.anchor.close()
