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

import torch

from meshlearn.compress.codecs import Codec
from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.messages import Message, MessageMonitor
from meshlearn.mesh.network import Network, ring_allreduce_bytes_per_member, ring_allreduce_s
from meshlearn.mesh.sync import average_gradients, clip_coefficient
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork, Worker
from meshlearn.models.llama import Decoder


@dataclass
class StepReport:
    """What one synchronous optimizer step did, for metrics."""

    losses: list[float]  # every microbatch loss of every replica (last stages)
    sim_s: float | None  # virtual seconds since the previous step's end (None: a real run, no clock)
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
    writes_records = True  # one process holds every worker: it writes the records and the summary
    shard = None  # checkpoints are one file (a DistDriver names its shard; see train/checkpoint.py)

    def __init__(self, mesh: MeshShape, workers: dict[WorkerId, Worker], network: Network,
                 compute: ComputeModel):
        self.mesh = mesh
        self.workers = workers
        self.network = network
        self.compute = compute
        self.clock = SimClock({w: 0.0 for w in workers}, {w: 0.0 for w in workers})
        self._seq = itertools.count()
        self.monitor: MessageMonitor | None = None
        self.charge_monitor_time = True

    def attach_monitor(self, monitor: MessageMonitor | None, charge_time: bool = True) -> None:
        """Inspect every message on arrival; ``charge_time`` adds the inspection's measured wall time
        to the delivery on the virtual clock (False keeps the virtual clock bit-reproducible)."""
        self.monitor = monitor
        self.charge_monitor_time = charge_time

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
            elif kind == "arrive" and self.monitor is not None:
                started = time.perf_counter()
                message = self.monitor.inspect(payload)
                # The verifier sits on the path: the receiver gets the message once it is inspected.
                delay = time.perf_counter() - started if self.charge_monitor_time else 0.0
                heapq.heappush(events, (now + delay, next(self._seq), "deliver", message))
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

    # --- what the Trainer asks of any driver (the DistDriver answers the same questions) ------

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Validation loss through replica 0's stages; no virtual time is charged for it."""
        stages = [self.workers[WorkerId(0, s)] for s in range(self.mesh.stages)]
        losses = [pipeline_loss([w.module for w in stages], stages[0].codec, x, y) for x, y in batches]
        return sum(losses) / len(losses)

    def record_fields(self) -> dict:
        return {"sim_time_s": self.clock.step_end}

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        sim_s = self.clock.step_end
        busy = sum(self.clock.busy_s.values())
        links = [{"src": str(link.src), "dst": str(link.dst), "axis": link.axis,
                  "bytes": link.bytes_sent, "busy_s": link.busy_s,
                  "utilization": link.busy_s / sim_s if sim_s else 0.0}
                 for link in sorted(self.network.links.values(),
                                    key=lambda link: (link.axis, link.src, link.dst))]
        return {
            "sim_time_s": sim_s,
            "sim_tokens_per_s": tokens / sim_s if sim_s else None,
            "bubble_fraction": 1.0 - busy / (len(self.clock.busy_s) * sim_s) if sim_s else None,
            "compute_model": self.compute.cfg.describe(),
            "links": links,
        }

    def state(self) -> dict:
        return {"clock": self.clock.state(), "network": self.network.state()}

    def load_state(self, state: dict) -> None:
        self.clock.load_state(state["clock"])
        self.network.load_state(state["network"])

    def barrier(self, what: str) -> None:
        """Nothing to wait for: every worker lives in this process."""


def pipeline_loss(stages: list[Decoder], codec: Codec, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward through the stages in order, each boundary crossing the codec."""
    h = x
    for i, stage in enumerate(stages):
        if i > 0:
            h = codec.decode(codec.encode(h, "act", x), "act")
        h = stage(h)
    return Decoder.loss(h, y).item()
