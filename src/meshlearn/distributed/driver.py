"""DistDriver: the simulator's step, executed by one real process per worker.

The Worker is the very object the SimDriver drives: this driver hands it the messages that arrive
(``receive``), asks it for work (``next_action``), runs it (``run``) and sends what it returns. The
step ends as the simulator's does, in the same order and with the same arithmetic: the pipeline,
the data-parallel mean of gradients (all-reduce over the stage's ``dp`` sub-group of a DeviceMesh),
the global norm for clipping, the update. A gather over all processes at the end of each step gives
every process the microbatch losses (only last stages compute them), the stages' squared gradient
norms and byte counters, so whichever process writes metrics logs real losses, never a placeholder.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshlearn.distributed.health import Health, WorkerFailure
from meshlearn.distributed.settings import derive_deadlines
from meshlearn.distributed.shaping import Pacer, allreduce_release_at, hold_until
from meshlearn.distributed.transport import Transport
from meshlearn.distributed.wire import PREFIX_BYTES
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import Network
from meshlearn.mesh.sim import StepReport
from meshlearn.mesh.sync import clip_coefficient
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork, Worker
from meshlearn.models.llama import Decoder

EVAL_STEP = -1  # the step number evaluation messages carry
HEADER_ROOM = 64 * 1024  # bytes for a message's JSON header in the receive buffers
# A row of the per-step gather: M losses, M flags (1 = loss present; a microbatch a verifier
# quarantined has none), then these stats, then 3 link slots × (bytes sent, busy seconds).
_SQ, _BUSY, _PP, _DP, _LINKS = 0, 1, 2, 3, 4


class DistDriver:
    """Drives this process's one worker; ``workers`` holds just it (the Trainer's view of "local")."""

    def __init__(self, cfg, worker: Worker, health: Health, device: torch.device, comm: str,
                 dp_group, link_groups: dict[tuple[WorkerId, WorkerId], object]):
        self.cfg = cfg
        self.mesh: MeshShape = worker.mesh
        self.me = worker.id
        self.worker = worker
        self.workers = {self.me: worker}
        self.rank = self.mesh.rank(self.me)
        self.writes_records = self.rank == 0
        self.shard = str(self.me)
        self.health = health
        self.device = device
        self.comm = comm
        self.dp_group = dp_group
        self.shaped = cfg.dist.shaping == "sender"
        self.epoch = time.monotonic()
        self.network = Network(cfg.link, seed=cfg.seed)
        self.prev = self.mesh.prev_stage(self.me)
        self.next = self.mesh.next_stage(self.me)
        replicas = self.mesh.replicas
        self.ring_next = WorkerId((self.me.replica + 1) % replicas, self.me.stage) if replicas > 1 else None
        # Link slots of the gather, in order: to the next stage, to the previous, to the ring's next.
        self.slots = [(self.me, peer) for peer in (self.next, self.prev, self.ring_next)]
        pacers = {peer: Pacer(self.network.link(self.me, peer), self.epoch, self.shaped)
                  for peer in (self.prev, self.next) if peer is not None}
        micro = cfg.train.batch_size // replicas // cfg.mesh.microbatches
        self.deadlines = derive_deadlines(
            cfg.dist, cfg.link, message_bytes=micro * cfg.model.seq_len * cfg.model.d_model * 4,
            messages_per_step=2 * cfg.mesh.microbatches, grad_bytes=4 * worker.n_params,
            replicas=replicas)
        self.transport = Transport(self.me, self.mesh, link_groups, pacers, device, health,
                                   self.deadlines.message_s)
        # Receive buffers, derived from the config on both ends of a link: an fp32 activation plus
        # int64 token ids per position (codecs only shrink the former) and room for the header.
        per_sequence = cfg.model.seq_len * (4 * cfg.model.d_model + 8)
        self.capacity = PREFIX_BYTES + HEADER_ROOM + micro * per_sequence
        self.eval_capacity = PREFIX_BYTES + HEADER_ROOM + cfg.train.batch_size * per_sequence
        self.busy_s = 0.0
        self.rows: torch.Tensor | None = None  # the last step's gather, for the summary
        self.stats = 2 * cfg.mesh.microbatches  # where the stats start in a row

    # --- one synchronous step ----------------------------------------------------------------

    def run_step(self, works: dict[WorkerId, StepWork], lr_factor: float, grad_clip: float) -> StepReport:
        work = works[self.me]
        if self.device.type != "cpu":
            work.tokens = [t.to(self.device) for t in work.tokens] if work.tokens else work.tokens
            work.targets = [t.to(self.device) for t in work.targets] if work.targets else work.targets
        pp_before, dp_before = self._bytes("pp"), self._bytes("dp")
        self._run_pipeline(work)
        losses = self.worker.end_step()
        self._sync_data_parallel()
        rows = self._gather(losses, self._bytes("pp") - pp_before, self._bytes("dp") - dp_before)
        # Summed in stage order from 0, exactly as the simulator sums the stages' squared norms.
        stats = self.stats
        sq_norm = sum(rows[self.mesh.rank(WorkerId(0, s)), stats + _SQ].item()
                      for s in range(self.mesh.stages))
        coef = clip_coefficient(sq_norm, grad_clip)
        if grad_clip > 0 and self.shaped:
            time.sleep(self.network.default.latency_s)  # the scalar exchange, as the simulator models it
        started = time.perf_counter()
        self.worker.apply_update(lr_factor, coef)
        self.busy_s += time.perf_counter() - started
        M = self.cfg.mesh.microbatches
        last = [self.mesh.rank(WorkerId(r, self.mesh.stages - 1)) for r in range(self.mesh.replicas)]
        return StepReport(
            losses=[rows[rank, m].item() for rank in last for m in range(M) if rows[rank, M + m] > 0],
            sim_s=None,
            bytes_pp=int(rows[:, stats + _PP].sum().item()),
            bytes_dp=int(rows[:, stats + _DP].sum().item()),
            grad_norm=sq_norm**0.5,
        )

    def _run_pipeline(self, work: StepWork) -> None:
        worker = self.worker
        if self.prev:  # post every receive of the step now: they complete in the background
            self.transport.expect(self.prev, sum(a.kind == "F" for a in work.plan), self.capacity)
        if self.next:
            self.transport.expect(self.next, sum(a.kind == "B" for a in work.plan), self.capacity)
        worker.begin_step(work)
        while not worker.finished:
            action = worker.next_action()
            if action is None:  # its input has not arrived yet
                planned = work.plan[work.position]
                peer, what = ((self.prev, "activation") if planned.kind == "F" else (self.next, "gradient"))
                message = self.transport.next_message(
                    f"{what} of microbatch {planned.microbatch} (step {work.step + 1})", peer)
                if message.step != work.step:
                    raise WorkerFailure(self.health.abort(
                        f"worker {message.src} sent a message of step {message.step + 1} to {self.me} "
                        f"during step {work.step + 1}"))
                worker.receive(message)
                continue
            started = time.perf_counter()
            outgoing = worker.run(action)
            self.busy_s += time.perf_counter() - started
            for message in outgoing:
                self.transport.send(message, self.capacity)

    def _sync_data_parallel(self) -> None:
        """Mean of the stage's gradients over its replicas: (Σ over replicas) / D, as the simulator."""
        replicas = self.mesh.replicas
        if replicas == 1:
            return
        grads = self.worker.grads()
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self.health.wait_work(work, f"the data-parallel all-reduce of stage {self.me.stage}",
                              self.deadlines.collective_s)
        # Done at loopback speed once the last replica joined: the ring model starts from here,
        # as the simulator starts it when the group's last member is ready.
        joined = time.monotonic()
        flat.div_(replicas)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        nbytes = flat.numel() * flat.element_size()
        link = self.network.link(self.me, self.ring_next)
        hold_until(allreduce_release_at(link, self.epoch, joined, nbytes, replicas, self.shaped))

    def _gather(self, losses: dict[int, float], bytes_pp: int, bytes_dp: int) -> torch.Tensor:
        """Every process's row → every process: losses, squared norm, busy time, bytes, links."""
        M, stats = self.cfg.mesh.microbatches, self.stats
        row = torch.zeros(stats + _LINKS + 2 * len(self.slots), dtype=torch.float64)
        for m, loss in losses.items():
            row[m], row[M + m] = loss, 1.0
        row[stats + _SQ] = self.worker.grad_sq_norm()
        row[stats + _BUSY] = self.busy_s
        row[stats + _PP] = bytes_pp
        row[stats + _DP] = bytes_dp
        for i, (src, dst) in enumerate(self.slots):
            if dst is not None:
                link = self.network.link(src, dst)
                row[stats + _LINKS + 2 * i], row[stats + _LINKS + 1 + 2 * i] = link.bytes_sent, link.busy_s
        row = row.to(self.device)
        rows = [torch.zeros_like(row) for _ in range(self.mesh.world_size)]
        work = dist.all_gather(rows, row, async_op=True)
        self.health.wait_work(work, "the end-of-step gather of losses and norms", self.deadlines.collective_s)
        self.rows = torch.stack(rows).cpu()
        return self.rows

    def _bytes(self, axis: str) -> int:
        return self.network.bytes_on_axis(axis)

    # --- evaluation, records, checkpoints ----------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Replica 0's stages forward the validation batches as a pipeline (unshaped, uncounted:
        the simulator charges no time for evaluation either); every process gets the mean loss."""
        worker, loss = self.worker, 0.0
        if self.me.replica == 0:
            if self.prev:
                self.transport.expect(self.prev, len(batches), self.eval_capacity)
            losses = []
            for i, (x, y) in enumerate(batches):
                if worker.is_first:
                    h = ids = x.to(self.device)
                else:  # the stage math of the simulator's pipeline_loss, one stage per process
                    message = self.transport.next_message(f"validation activation {i}", self.prev)
                    ids = message.payload.tensors.get("ids")
                    h = worker.codec.decode(message.payload, "act")
                out = worker.module(h)
                if worker.is_last:
                    losses.append(Decoder.loss(out, y.to(self.device)).item())
                else:
                    message = Message("act", EVAL_STEP, i, self.me, self.next,
                                      worker.codec.encode(out, "act", ids))
                    self.transport.send(message, self.eval_capacity, shaped=False)
            loss = sum(losses) / len(losses) if worker.is_last else 0.0
        value = torch.tensor([loss], dtype=torch.float64, device=self.device)
        src = self.mesh.rank(WorkerId(0, self.mesh.stages - 1))
        work = dist.broadcast(value, src=src, async_op=True)
        self.health.wait_work(work, "the broadcast of the validation loss", self.deadlines.collective_s)
        return value.item()

    def record_fields(self) -> dict:
        return {}  # no virtual clock: records carry wall time only

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        rows = self.rows
        links = []
        if rows is not None:
            for rank in range(self.mesh.world_size):
                wid = self.mesh.worker(rank)
                replicas = self.mesh.replicas
                peers = (self.mesh.next_stage(wid), self.mesh.prev_stage(wid),
                         WorkerId((wid.replica + 1) % replicas, wid.stage) if replicas > 1 else None)
                for i, peer in enumerate(peers):
                    if peer is None:
                        continue
                    at = self.stats + _LINKS + 2 * i
                    nbytes, busy = rows[rank, at].item(), rows[rank, at + 1].item()
                    links.append({"src": str(wid), "dst": str(peer), "axis": "pp" if i < 2 else "dp",
                                  "bytes": int(nbytes), "busy_s": busy,
                                  "utilization": busy / wall_s if wall_s else 0.0})
            links.sort(key=lambda ln: (ln["axis"], WorkerId.parse(ln["src"]), WorkerId.parse(ln["dst"])))
        busy = rows[:, self.stats + _BUSY].sum().item() if rows is not None else None
        return {
            "sim_time_s": None,
            "sim_tokens_per_s": None,
            "bubble_fraction": (1.0 - busy / (self.mesh.world_size * wall_s)
                                if busy is not None and wall_s else None),
            "compute_model": f"real: {self.mesh.world_size} processes over {self.comm}, "
                             f"shaping={self.cfg.dist.shaping}",
            "links": links,
        }

    def state(self) -> dict:
        return {"network": self.network.state(), "busy_s": self.busy_s}

    def load_state(self, state: dict) -> None:
        self.network.load_state(state["network"])
        for link in self.network.links.values():
            link.free_at = link.last_arrival = 0.0  # queue times of the old process's clock
        self.busy_s = state["busy_s"]

    def barrier(self, what: str) -> None:
        work = dist.barrier(async_op=True)
        self.health.wait_work(work, f"the barrier after the {what}", self.deadlines.collective_s)

    def close(self) -> None:
        """Clean shutdown: deliver what is queued, meet everyone, stop the threads."""
        self.transport.drain(self.deadlines.message_s)
        self.barrier("last step")
        self.health.finish()
        self.transport.close()
