"""SimDriver: runs every worker in one process on a virtual clock (a discrete-event simulation).

Compute really happens (losses and weights are real); only time is virtual. Events are processed in
time order: a compute finishing hands its messages to links, whose FIFO queues decide arrival times;
an arrival wakes the receiving worker. Each worker keeps its own clock, so bubbles and link stalls
show up exactly where a real pipeline would have them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Network, ring_allreduce_bytes_per_member, ring_allreduce_s
from meshlearn.mesh.sync import average_gradients, clip_coefficient
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork, Worker


@dataclass
class StepReport:
    """What one synchronous optimizer step did, for metrics."""

    losses: list[float]  # every microbatch loss of every replica (last stages)
    sim_s: float  # virtual seconds from the end of the previous step to the end of this one
    bytes_pp: int
    bytes_dp: int
    grad_norm: float


@dataclass
class SimClock:
    """Per-worker virtual clocks and busy time, carried across steps (and checkpoints)."""

    now: dict[WorkerId, float] = field(default_factory=dict)
    busy_s: dict[WorkerId, float] = field(default_factory=dict)
    step_end: float = 0.0

    def state(self) -> dict:
        return {"now": {str(w): t for w, t in self.now.items()},
                "busy_s": {str(w): t for w, t in self.busy_s.items()}, "step_end": self.step_end}

    def load_state(self, state: dict) -> None:
        self.now = {WorkerId.parse(w): t for w, t in state["now"].items()}
        self.busy_s = {WorkerId.parse(w): t for w, t in state["busy_s"].items()}
        self.step_end = state["step_end"]


class SimDriver:
    def __init__(self, mesh: MeshShape, workers: dict[WorkerId, Worker], network: Network,
                 compute: ComputeModel):
        self.mesh = mesh
        self.workers = workers
        self.network = network
        self.compute = compute
        self.clock = SimClock({w: 0.0 for w in workers}, {w: 0.0 for w in workers})
        self._seq = itertools.count()

    def run_step(self, works: dict[WorkerId, StepWork], lr_factor: float,
                 grad_clip: float) -> StepReport:
        pp_before = self.network.bytes_on_axis("pp")
        dp_before = self.network.bytes_on_axis("dp")
        for wid, work in works.items():
            self.workers[wid].begin_step(work)
        self._run_pipeline()
        losses = [loss for w in self.mesh.workers()
                  for _, loss in sorted(self.workers[w].end_step().items())]
        self._sync_data_parallel()
        grad_norm = self._update(lr_factor, grad_clip)
        end = max(self.clock.now.values())
        report = StepReport(
            losses=losses,
            sim_s=end - self.clock.step_end,
            bytes_pp=self.network.bytes_on_axis("pp") - pp_before,
            bytes_dp=self.network.bytes_on_axis("dp") - dp_before,
            grad_norm=grad_norm,
        )
        self.clock.step_end = end
        return report

    # --- the pipeline: a discrete-event loop -------------------------------------------------

    def _run_pipeline(self) -> None:
        events: list[tuple[float, int, str, object]] = []
        busy: set[WorkerId] = set()

        def try_start(wid: WorkerId, now: float) -> None:
            worker = self.workers[wid]
            if wid in busy:
                return
            action = worker.next_action()
            if action is None:
                return
            batch = worker.work.microbatch_size
            started = time.perf_counter()
            outgoing = worker.run(action)
            measured = time.perf_counter() - started
            duration = self.compute.compute_s(worker.shape, action.kind, batch, measured)
            start = max(now, self.clock.now[wid])
            self.clock.busy_s[wid] += duration
            busy.add(wid)
            heapq.heappush(events, (start + duration, next(self._seq), "done", (wid, outgoing)))

        for wid in self.workers:
            try_start(wid, self.clock.now[wid])
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "done":
                wid, outgoing = payload
                self.clock.now[wid] = now
                busy.discard(wid)
                for message in outgoing:
                    arrival = self.network.link(message.src, message.dst).transmit(now, message.wire_bytes)
                    heapq.heappush(events, (arrival, next(self._seq), "arrive", message))
                try_start(wid, now)
            else:
                message: Message = payload
                self.workers[message.dst].receive(message)
                try_start(message.dst, now)
        stuck = [str(w) for w, worker in self.workers.items() if not worker.finished]
        if stuck:
            raise RuntimeError(f"pipeline deadlock: workers {stuck} wait for messages that never come")

    # --- data-parallel sync and the optimizer step -------------------------------------------

    def _sync_data_parallel(self) -> None:
        for stage in range(self.mesh.stages):
            group_ids = self.mesh.stage_replicas(stage)
            nbytes = average_gradients([self.workers[w] for w in group_ids])
            if len(group_ids) == 1:
                continue
            start = max(self.clock.now[w] for w in group_ids)
            ring = list(zip(group_ids, group_ids[1:] + group_ids[:1], strict=True))
            profile = self.network.link(*ring[0]).profile
            seconds = ring_allreduce_s(nbytes, len(group_ids), profile)
            sent = ring_allreduce_bytes_per_member(nbytes, len(group_ids))
            for src, dst in ring:
                link = self.network.link(src, dst)
                link.occupy(start, profile.serialization_s(sent), sent)
            for w in group_ids:
                self.clock.now[w] = start + seconds

    def _update(self, lr_factor: float, grad_clip: float) -> float:
        """Global-norm clipping needs every stage's norm: a scalar exchange, modeled as one latency."""
        sq_norm = sum(self.workers[w].grad_sq_norm() for w in self.mesh.workers() if w.replica == 0)
        coef = clip_coefficient(sq_norm, grad_clip)
        if grad_clip > 0:
            barrier = max(self.clock.now.values()) + self.network.default.latency_s
            for w in self.clock.now:
                self.clock.now[w] = barrier
        for wid, worker in self.workers.items():
            started = time.perf_counter()
            worker.apply_update(lr_factor, coef)
            measured = time.perf_counter() - started
            seconds = self.compute.update_s(worker.n_params, measured)
            self.clock.now[wid] += seconds
            self.clock.busy_s[wid] += seconds
        return sq_norm**0.5
