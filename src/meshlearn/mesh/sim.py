"""SimDriver: runs every worker in one process on a virtual clock (a discrete-event simulation).

Compute really happens (losses and weights are real); only time is virtual. Events are processed in
time order: a compute finishing hands its messages to links, whose FIFO queues decide arrival times;
an arrival is checked by the receiver's guard, inspected by any monitors (verifiers), then wakes
the receiving worker; an update waits for the peers its collective needs. Each
worker keeps its own clock, so bubbles and link stalls show up exactly where a real pipeline would
have them. The event queue persists across steps: under the async schedule a step ends while the
next one's microbatches are already in flight, and only a drain point empties it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.evaluation import average_modules, mean_loss, run_evaluation
from meshlearn.mesh.events import Arrival, ComputeDone, Delivery, RoundDeadline, SimEvent, UpdateComputed
from meshlearn.mesh.feeding import Feeding, Settle, feed_policy
from meshlearn.mesh.messages import Message, MessageMonitor, charged_step
from meshlearn.mesh.network import (
    UPLINK,
    Network,
    build_run_network,
    ring_allreduce_bytes_per_member,
    ring_allreduce_s,
)
from meshlearn.mesh.report import (
    StepBytes,
    StepReport,
    dp_counters,
    idle_fraction,
    link_table,
    mesh_report,
    run_summary,
    stats_row,
)
from meshlearn.mesh.schedule import Action, AsyncPlan
from meshlearn.mesh.sync import average_gradients
from meshlearn.mesh.timeline import TimelineRecorder, all_gather, computed, transfer
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.update import (
    GatherNorms,
    ReduceGradients,
    RoundStarts,
    Wait,
    receive_round,
    waits_for,
)
from meshlearn.mesh.update_run import Apply, Request, Send, UpdateRun
from meshlearn.mesh.worker import Worker


@dataclass
class SimClock:
    """Per-worker virtual clocks and busy time, carried across steps (and checkpoints); the run's
    ``Clock`` (mesh/driver.py)."""

    now: dict[WorkerId, float] = field(default_factory=dict)
    busy_s: dict[WorkerId, float] = field(default_factory=dict)
    step_end: float = 0.0
    virtual: ClassVar[bool] = True

    def worker_s(self, worker: WorkerId) -> float:
        return self.now[worker]

    def elapsed_s(self) -> float:
        return self.step_end

    def state(self) -> dict:
        return {"now": {str(w): t for w, t in self.now.items()},
                "busy_s": {str(w): t for w, t in self.busy_s.items()}, "step_end": self.step_end}

    def load_state(self, state: dict) -> None:
        self.now = {WorkerId.parse(w): t for w, t in state["now"].items()}
        self.busy_s = {WorkerId.parse(w): t for w, t in state["busy_s"].items()}
        self.step_end = state["step_end"]


class Collectives(Protocol):
    """How the simulated DP axis computes, beside its time: the built-in all-reduce's arithmetic
    and ring, and what arrives of a ``dp`` message. A training run computes values
    (``VALUES``); the planner's cost-only runs count bytes, over every replica or over one row of
    mirror images (``plan/collectives.py``)."""

    def average_gradients(self, replicas: list[Worker]) -> int:
        """Average the stage's gradients over ``replicas`` in place; return their fp32 bytes."""
        ...

    def stage_ring(self, replicas: list[WorkerId]) -> list[WorkerId]:
        """The members of the stage's ring all-reduce, given its simulated ``replicas``."""
        ...

    def arriving(self, message: Message) -> Message:
        """What arrives of a ``dp`` message sent."""
        ...


class ValueCollectives:
    """The training run's: gradients averaged in replica order, a ring over the replicas, every
    message arrives as sent."""

    def average_gradients(self, replicas: list[Worker]) -> int:
        return average_gradients(replicas)

    def stage_ring(self, replicas: list[WorkerId]) -> list[WorkerId]:
        return replicas

    def arriving(self, message: Message) -> Message:
        return message


VALUES = ValueCollectives()


class SimDriver:
    """A ``Driver`` (mesh/driver.py) with the capabilities ``ControlChannel``, ``MessageMonitors``
    and ``TimeModels``."""

    writes_records = True  # one process holds every worker: it writes the records and the summary
    writes_run_files = True
    monitor_release = True  # asks monitors for their own delivery time (release_s), see attach_monitor
    shard = None  # checkpoints are one file (a DistDriver names its shard; see train/checkpoint.py)
    checkpoint_store = None  # the trainer's single file

    def __init__(self, mesh: MeshShape, workers: dict[WorkerId, Worker], network: Network,
                 compute: ComputeModel, grad_clip: float, collectives: Collectives = VALUES):
        """``collectives``: how the DP axis computes (``VALUES``; the planner's cost-only runs
        pass their own, over cost-only workers: ``Worker(cost_only=...)``)."""
        self.mesh = mesh
        self.collectives = collectives
        self.everyone = mesh.workers()  # a flushing update's group (asked at every worker's update)
        self.workers = workers
        self.network = network
        self.compute = compute
        self.grad_clip = grad_clip
        self.clock = SimClock({w: 0.0 for w in workers}, {w: 0.0 for w in workers})
        self._seq = itertools.count()
        self.monitors: list[tuple[MessageMonitor, bool]] = []
        self.events: list[tuple[float, int, SimEvent]] = []
        self.busy: set[WorkerId] = set()
        # Workers inside an update (mesh/update_run.py), from its start to its end; those of them
        # at a collective whose group has not all arrived wait in ``waiting``.
        self.updates: dict[WorkerId, _Update] = {}
        self.waiting: dict[WorkerId, Action] = {}
        self.dp_started = {w: RoundStarts() for w in workers}  # round starts, per worker
        self._dp_alarms: set[RoundDeadline] = set()  # deadline events queued
        self.dp_wait_s = 0.0
        # Steps whose every update has finished on the virtual clock, per worker (a worker applies an
        # update when its collective completes, but the update's compute ends later).
        self.steps_done = {w: worker.steps_done for w, worker in workers.items()}
        self._target, self._lagging = -1, set()  # the step run_step runs, and who has not done it
        self.now = 0.0
        self.flushes = next(iter(workers.values())).plan.flushes
        in_flight = max((w.plan.in_flight for w in workers.values() if isinstance(w.plan, AsyncPlan)),
                        default=1)
        microbatches = next(iter(workers.values())).microbatches
        self.feeding = Feeding(feed_policy(microbatches, self.flushes, in_flight))
        self.lookahead = self.feeding.policy.lookahead
        self.step_bytes = StepBytes(network)
        self.timeline: TimelineRecorder | None = None  # set by the timeline plugin (report.timeline_steps)
        self.control_mail: list[Message] = []  # control messages sent, not yet received
        self._stage_sq: dict[WorkerId, float] = {}  # a flushing step's stage norms before the clip

    def attach_monitor(self, monitor: MessageMonitor, charge_time: bool = True) -> None:
        """Add a subscriber that inspects every message on arrival, in the order attached. With
        ``charge_time``, a monitor that has ``release_s(message, arrival_s)`` decides when the
        message leaves it on the virtual clock (its CPU time on its own resource); False keeps the
        virtual clock bit-reproducible."""
        self.monitors.append((monitor, charge_time))

    def send_control(self, message: Message) -> None:
        """Carry a control message between two workers at a drain point (a protocol model's
        boundary transform): its bytes cross the link like any message's (counted in the next
        step's report) and the receiver's clock waits for its arrival; its receiver takes it with
        ``receive_control``."""
        assert self.drained, "control messages travel at drain points"
        link = self.network.link(message.src, message.dst)
        arrival = link.transmit(self.clock.now[message.src], message.wire_bytes)
        self.clock.now[message.dst] = max(self.clock.now[message.dst], arrival)
        self.control_mail.append(message)

    def receive_control(self, src: WorkerId, kind: str, what: str) -> Message:
        """The oldest control message of ``kind`` from ``src`` sent at this drain point."""
        for i, message in enumerate(self.control_mail):
            if message.src == src and message.kind == kind:
                return self.control_mail.pop(i)
        raise RuntimeError(f"waited for {what} from {src} at a drain point, but {src} sent none")

    @property
    def drained(self) -> bool:
        """Nothing in flight anywhere: a point where checkpoints and evaluation see settled weights."""
        return (not self.events and not self.updates
                and all(w.idle for w in self.workers.values()))

    def run_step(self, step: int, source) -> list[StepReport]:
        """Run until every worker has applied step ``step``'s updates (``source``: a WorkSource)."""
        # Counted from the previous step's end, so control messages sent at the drain point in
        # between (send_control) are in this step's bytes.
        start = self.step_bytes.begin()
        wait_before = self.dp_wait_s
        self.feeding.hand_over(step, source, self.workers, lambda wid, work: self.workers[wid].feed(work))
        # Workers that have not finished ``step``: kept as a set (a min over every worker per
        # event made large meshes' event loops slow).
        self._target = step
        self._lagging = {w for w, done in self.steps_done.items() if done <= step}
        for wid in self.workers:
            self._try_start(wid, self.clock.now[wid])
        while self._lagging:
            if not self.events:
                stuck = [str(w) for w, done in self.steps_done.items() if done <= step]
                raise RuntimeError(f"pipeline deadlock: workers {stuck} wait for messages that never come")
            self._process(*heapq.heappop(self.events))
        end = self.now
        if Settle() in self.feeding.end(step, source, background=bool(self.events)):
            while self.events:  # the DP rounds run in the background land, in no step's time
                self._process(*heapq.heappop(self.events))
        self.now = end
        rows = {w: stats_row(worker.pop_stats(step), worker.microbatches, self._stage_sq.get(w))
                for w, worker in self.workers.items()}
        report = mesh_report(step, self.mesh, rows, self.now - self.clock.step_end,
                             *self.step_bytes.since(start), self.dp_wait_s - wait_before)
        self.clock.step_end = self.now
        self.step_bytes.end()
        return [report]

    @property
    def fed(self) -> int:
        return self.feeding.fed

    # --- the event loop ----------------------------------------------------------------------

    def _process(self, now: float, _seq: int, event: SimEvent) -> None:
        self.now = now
        if isinstance(event, ComputeDone):
            wid = event.worker
            self.clock.now[wid] = now
            self.busy.discard(wid)
            self._set_done(wid)
            for message in event.outgoing:
                self._push(self._transmit(wid, message, now), Arrival(message))
            self._try_start(wid, now)
        elif isinstance(event, UpdateComputed):  # the optimizer step's compute ended
            self.clock.now[event.worker] = now
            self.busy.discard(event.worker)
            self._proceed(event.worker, self.updates[event.worker].run.resume(), now)
        elif isinstance(event, RoundDeadline):
            self._dp_alarms.discard(event)
            self._resume_wait(event.worker, now)
        elif isinstance(event, Arrival):
            message, at = event.message, now
            if message.kind != "dp":  # a dp message is checked by the strategy's exchange, no verifier
                message = self.workers[message.dst].admit(message)
                for monitor, charge_time in self.monitors:
                    message = monitor.inspect(message)
                    # A verifier sits on the path: the receiver gets the message once it leaves the
                    # verifier, whose CPU time is its own resource (``release_s``: queued on that
                    # verifier's CPU), never this machine's wall time added to the device model.
                    release = getattr(monitor, "release_s", None)
                    if charge_time and release is not None:
                        at = release(message, at)
            if at == now and (not self.events or self.events[0][0] > now):
                # The delivery would be the very next event (pushed now, it would follow every
                # event already queued, and none is due by ``now``): run it without the queue.
                self._deliver(message, now)
            else:
                self._push(at, Delivery(message))
        else:
            self._deliver(event.message, now)

    def _deliver(self, message: Message, now: float) -> None:
        """A message leaves the network (and any verifier) for its receiver."""
        if message.kind == "dp":
            self._dp_deliver(message, now)
        else:
            self.workers[message.dst].receive(message)
            self._try_start(message.dst, now)

    def _set_done(self, wid: WorkerId) -> None:
        done = self.steps_done[wid] = self.workers[wid].steps_done
        if done > self._target:
            self._lagging.discard(wid)

    def _transmit(self, sender: WorkerId, message: Message, now: float) -> float:
        """Queue ``message`` on the link from ``sender`` at ``now``; return its arrival time. The
        sender is the worker that sent it, never the header's ``src`` (a forger's claim: its bytes
        still cross its own link, and its receiver reads sender and kind off ``message.link``)."""
        message.link = (sender, message.dst)
        step = charged_step(message, self.workers[sender].steps_done)
        return transfer(self.timeline, step, sender, message.dst, self.network.link(sender, message.dst),
                        message.kind, message.wire_bytes, now)

    def _push(self, at: float, event: SimEvent) -> None:
        heapq.heappush(self.events, (at, next(self._seq), event))

    def _try_start(self, wid: WorkerId, now: float) -> None:
        if wid in self.busy or wid in self.updates:
            return
        worker = self.workers[wid]
        action = worker.next_action()
        if action is None:
            return
        if action.kind == "U":
            self._begin_update(wid, action, max(now, self.clock.now[wid]))
            return
        batch = worker.microbatch_size(action.microbatch)
        started = time.perf_counter()
        outgoing = worker.run(action)
        measured = time.perf_counter() - started
        duration = self.compute.compute_s(worker.shape, action.kind, batch, measured)
        start = max(now, self.clock.now[wid])
        self.clock.busy_s[wid] += duration
        self.busy.add(wid)
        computed(self.timeline, wid, action, worker.microbatches, start, start + duration)
        self._push(start + duration, ComputeDone(wid, tuple(outgoing)))

    # --- updates: the update protocol's requests (mesh/update_run.py), executed in simulated time --

    def _begin_update(self, wid: WorkerId, action: Action, now: float) -> None:
        """Start ``wid``'s update ``action``: its run waits for whom its actions need
        (``waits_for``): the whole mesh when norms are gathered (a flushing schedule), the stage's
        replicas for their reduce, else nobody."""
        run = UpdateRun.of(self.workers[wid], self.grad_clip, self.dp_started[wid])
        who = waits_for(run.actions)
        group = (self.everyone if who == "mesh" else
                 self.mesh.stage_replicas(wid.stage) if who == "stage" else [wid])
        self.updates[wid] = _Update(run, action, group, None)
        self._proceed(wid, run.start(), now)

    def _proceed(self, wid: WorkerId, request, now: float) -> None:
        """Execute ``wid``'s update from ``request`` on until it waits: for a round (a deadline
        event, or the next arrival), for its group's collective, or for its optimizer step."""
        update = self.updates[wid]
        phased = isinstance(request, Send)
        while isinstance(request, Send):
            self._dp_send(wid, request.messages, now)
            request = update.run.resume(now)
        self._parked(wid, update, request, now, phased)

    def _resume_wait(self, wid: WorkerId, now: float) -> None:
        """An arrival or a deadline for ``wid``: if it waits in a round, its phase polls again."""
        update = self.updates.get(wid)
        if update is not None and isinstance(update.request, Wait):
            self._parked(wid, update, update.run.resume(now), now, phased=True)

    def _parked(self, wid: WorkerId, update: _Update, request: Request | None, now: float,
                phased: bool) -> None:
        """``wid``'s run stopped at ``request``: a round's ``Wait`` (its deadline queued as an
        event), the end of the update, or a collective or step its group executes together."""
        update.request = request
        self.dp_wait_s += update.run.pop_waited()
        if isinstance(request, Wait):
            alarm = RoundDeadline(wid, request.until)
            if request.until is not None and alarm not in self._dp_alarms:
                self._dp_alarms.add(alarm)
                self._push(request.until, alarm)
            return
        if phased:  # the worker stood in a phase until now
            self.clock.now[wid] = max(self.clock.now[wid], now)
        if request is None:
            del self.updates[wid]
            self._set_done(wid)
            self._try_start(wid, now)
            return
        self.waiting[wid] = update.action
        if all(self.waiting.get(w) == update.action for w in update.group):
            self._update(update.group)

    def _update(self, group: list[WorkerId]) -> None:
        """Execute the group's collective requests and optimizer steps: each stage's reduce (values
        in process, time on its ring), the norms' exchange (the slowest pair's latency, when the
        clip waits on it), then every worker's ``Apply``; what follows it (a strategy's "post"
        phase, or the end) comes when the step's compute ends."""
        updates = [self.updates[w] for w in group]
        reduce = updates[0].request if isinstance(updates[0].request, ReduceGradients) else None
        ready = {w: self.clock.now[w] for w in group}
        arrived = dict(ready)
        for stage in sorted({w.stage for w in group} if reduce is not None else ()):
            replicas = self.mesh.stage_replicas(stage)
            nbytes = self.collectives.average_gradients([self.workers[w] for w in replicas])
            ready |= self._allreduce(replicas, ready, nbytes, reduce)
        if reduce is not None:
            for update in updates:
                update.request = update.run.resume()
        sq: dict[WorkerId, float] = {}  # each worker's norm once, whoever asks

        def sq_of(w: WorkerId) -> float:
            if w not in sq:
                sq[w] = self.workers[w].grad_sq_norm()
            return sq[w]

        gather = updates[0].request if isinstance(updates[0].request, GatherNorms) else None
        self._stage_sq = sq if gather is not None else {}  # a flushing step's rows report them
        if gather is not None:
            if gather.latency:
                barrier = max(ready.values()) + self.network.exchange_latency_s(group)
                ready = {w: barrier for w in group}
            for update in updates:
                update.request = update.run.resume(sq_of)
        for wid, update in zip(group, updates, strict=True):
            worker, action, apply = self.workers[wid], self.waiting.pop(wid), update.request
            assert isinstance(apply, Apply), apply
            started = time.perf_counter()
            worker.apply_update(action, apply.coefficient, apply.sq_norm)
            seconds = self.compute.update_s(worker.n_params, time.perf_counter() - started)
            self.clock.busy_s[wid] += seconds
            self.busy.add(wid)
            computed(self.timeline, wid, action, worker.microbatches, ready[wid], ready[wid] + seconds)
            if reduce is not None and worker.mesh.replicas > 1:
                self.dp_wait_s += ready[wid] - arrived[wid]
            self._push(ready[wid] + seconds, UpdateComputed(wid))

    # --- a message-based DP strategy's messages (meshlearn.dp.base) ----------------------------

    def _dp_send(self, wid: WorkerId, messages: list[Message], now: float) -> None:
        self.dp_started[wid].mark(messages, now)
        for message in messages:
            self._push(self._transmit(wid, message, now), Arrival(self.collectives.arriving(message)))

    def _dp_deliver(self, message: Message, now: float) -> None:
        wid = message.dst
        self._dp_send(wid, receive_round(self.workers[wid].dp, self.dp_started[wid], message, now), now)
        self._resume_wait(wid, now)

    def _allreduce(self, replicas: list[WorkerId], ready: dict[WorkerId, float],
                   nbytes: int, reduce: ReduceGradients) -> dict[WorkerId, float]:
        """One stage's ring all-reduce of ``nbytes`` (over ``collectives.stage_ring``: members not
        simulated are ready when the simulated ``replicas`` are): it starts once every replica is
        ready, is charged to the ring's links, and returns when each replica has the average
        (nothing for a ring of one). A robust rule (``reduce.rule``) runs an all-gather instead."""
        ring = self.collectives.stage_ring(replicas)
        if len(ring) == 1:
            return {}
        start = max(ready[w] for w in replicas)
        step = self.waiting[replicas[0]].microbatch // self.workers[replicas[0]].microbatches
        if reduce.gathers:  # a robust rule's (``dp.robust``)
            done = all_gather(self.timeline, step, self.network, ring, ring, nbytes, start)
            return {w: done[w] for w in replicas}
        if self.network.access == UPLINK:  # the ring's sends queue behind what each uplink holds
            start = max(start, *(self.network.link(a, b).queue_free_at for a, b in _ring(ring)))
        self._charge_allreduce(ring, start, nbytes, step)
        seconds = ring_allreduce_s(nbytes, len(ring), self.network.link(*ring[:2]).profile)
        return {w: start + seconds for w in replicas}

    def _charge_allreduce(self, replicas: list[WorkerId], start: float, nbytes: int, step: int) -> None:
        ring = _ring(replicas)
        profile = self.network.link(*ring[0]).profile
        sent = ring_allreduce_bytes_per_member(nbytes, len(replicas))
        for src, dst in ring:
            link = self.network.link(src, dst)
            if self.timeline is not None and self.timeline.wants(step):  # the ring's rounds, as one bar
                self.timeline.send(str(src), str(dst), "dp", "allreduce", step, sent, start,
                                   start + profile.serialization_s(sent),
                                   start + ring_allreduce_s(nbytes, len(replicas), profile))
            link.occupy(start, profile.serialization_s(sent), sent)

    # --- what the Trainer asks of any driver (the DistDriver answers the same questions) ------

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The evaluation plan (mesh/evaluation.py) through replica 0's stages, or the replicas'
        mean where they drift; no virtual time is charged for it."""
        assert self.drained, "evaluation runs at a drain point"
        stages = [self.workers[WorkerId(0, s)] for s in range(self.mesh.stages)]
        codec = stages[0].codec
        masks = getattr(codec, "name", "") == "mask"
        loss, self._eval_fields = run_evaluation(
            stages[0].dp, self.mesh.replicas, masks, [w.module for w in stages],
            lambda: [average_modules([self.workers[w].module for w in self.mesh.stage_replicas(s)])
                     for s in range(self.mesh.stages)],
            lambda modules, masked: mean_loss(modules, codec, batches, masked))
        return loss

    def eval_fields(self) -> dict:
        """Fields of the last evaluation's record beyond val_loss (replica 0's loss when drifting)."""
        return getattr(self, "_eval_fields", {})

    def record_fields(self) -> dict:
        return {"sim_time_s": self.clock.step_end}

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        sim_s, busy = self.clock.step_end, self.clock.busy_s
        links = link_table(((link.src, link.dst, link.axis, link.bytes_sent, link.busy_s)
                            for link in self.network.links.values()), sim_s)
        idle = idle_fraction(sum(busy.values()), len(busy), sim_s)
        return run_summary(self.compute.cfg.describe(), links, idle, sim_s, tokens) | {
            "worker_utilization": {str(w): b / sim_s if sim_s else None for w, b in sorted(busy.items())},
            "stash_bytes_peak": max(w.stash_bytes for w in self.workers.values()),
        } | dp_counters(self.dp_wait_s, [w.dp.summary() for w in self.workers.values() if not _collective(w)])

    def state(self) -> dict:
        assert self.drained, "driver state is saved at drain points only"
        return {"clock": self.clock.state(), "network": self.network.state(), "fed": self.fed}

    def load_state(self, state: dict) -> None:
        self.clock.load_state(state["clock"])
        self.network.load_state(state["network"])
        self.feeding.resume(state["fed"])
        self.step_bytes.mark = None  # the link counters were restored
        self.steps_done = {w: worker.steps_done for w, worker in self.workers.items()}

    def barrier(self, what: str) -> None:
        """Nothing to wait for: every worker lives in this process."""


@dataclass
class _Update:
    """A worker's update in the simulator: its run, its U, the group its collective waits for, and
    the request it is parked at (a ``Wait``, a collective, an ``Apply`` computing; None: started)."""

    run: UpdateRun
    action: Action
    group: list[WorkerId]
    request: Request | None


def _ring(replicas: list[WorkerId]) -> list[tuple[WorkerId, WorkerId]]:
    """The ring all-reduce's links: each replica to the next, the last to the first."""
    return list(zip(replicas, replicas[1:] + replicas[:1], strict=True))


def _collective(worker: Worker) -> bool:
    """Whether the worker's update runs the built-in all-reduce (no strategy, or ``allreduce``)."""
    return worker.dp is None or worker.dp.collective


def build_sim_driver(cfg, workers: dict[WorkerId, Worker]) -> SimDriver:
    """The simulator over run ``cfg``'s (a RunConfig's) links and compute model."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    network = build_run_network(cfg)
    return SimDriver(mesh, workers, network, ComputeModel(cfg.sim, cfg.model), cfg.train.grad_clip)
