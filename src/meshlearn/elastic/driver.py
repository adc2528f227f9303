"""ElasticDriver: the DistDriver's pipeline, with the DP axis on one torchft quorum per stage.

What changes against the fixed-membership DistDriver (the pipeline, its messages and shaping
are the same code):

- each step starts with the stage's quorum (``StageQuorum.begin``); the gradient mean runs over
  its participants (torchft's all-reduce), not over a fixed ``dp`` group;
- no collective spans the mesh: clipping is per stage at ``train.grad_clip / √P`` (as under
  ``async``), and the step's report is built from this worker's own numbers; the last stages put
  their loss sum and count beside the gradients, so the run's writer, ``r0s{P-1}``, logs the mean
  train loss over every live last stage;
- a step commits in every stage or in none (``CommitVote``); a step that does not commit leaves
  every worker's weights and optimizer state as they were (``Worker.discard_update``);
- a worker whose pipeline partner is gone leaves the run (exit code 4); the other replicas go on.
"""

from __future__ import annotations

import os
import time

import torch

from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.shaping import allreduce_release_at, hold_until
from meshlearn.elastic.binding import check_bound
from meshlearn.elastic.quorum import CommitVote, QuorumStep, StageQuorum
from meshlearn.mesh.messages import Message
from meshlearn.mesh.sim import StepReport
from meshlearn.mesh.sync import clip_coefficient, stage_clip_norm
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import StepStats
from meshlearn.models.llama import Decoder


class ElasticDriver(DistDriver):
    """This process's worker; ``quorum`` and ``vote`` are built by ``distributed.worker``."""

    def __init__(self, cfg, worker, health, device, comm, link_groups, quorum: StageQuorum,
                 vote: CommitVote, progress):
        super().__init__(cfg, worker, health, device, comm, None, link_groups)
        self.quorum = quorum
        self.vote = vote
        self.progress = progress  # the run store: this worker's last step, for workers.json
        self.writes_records = self.me == WorkerId(0, self.mesh.stages - 1)
        self.current: QuorumStep | None = None
        self.report: StepReport | None = None
        self.uncommitted = 0  # steps this worker trained whose update was dropped everywhere
        self.quorum_s = 0.0
        self.next_step = 0  # the step this worker is about to run (what a joiner is healed to)
        self.joined_at: int | None = None  # set when healed from a peer: the step to train from
        self.formed = False  # a quorum is already formed for the coming step (a joiner's first)

    # --- joining: what a live peer hands a new replica of its stage (torchft's healing) ---------

    def heal_state(self) -> dict:
        """Called by torchft in a live replica, at the quorum of step ``next_step``."""
        return {"worker": self.worker.state_dict(), "step": self.next_step, "busy_s": self.busy_s}

    def load_heal_state(self, state: dict) -> None:
        self.worker.load_state_dict(state["worker"])
        self.joined_at = state["step"]

    def join(self) -> None:
        """A new replica: take part in the stage's next quorum, which heals it from a live peer;
        ``joined_at`` is then the step it trains from (the Trainer starts there)."""
        self.current = self.quorum.begin()
        self.formed = True
        check_bound(os.getpid(), self.cfg.elastic.host, f"worker {self.me}")
        if self.joined_at is None:
            raise RuntimeError(f"{self.me} joined a quorum of {self.current.participants} replicas "
                               "but was not healed: nobody in it had trained yet")
        self.progress.set(f"elastic/joined/{self.me}", str(self.joined_at))
        print(f"meshlearn worker {self.me}: joined at step {self.joined_at + 1}, healed from a live "
              f"replica of stage {self.me.stage} ({self.current.participants} in the quorum)", flush=True)

    def run_step(self, step: int, source) -> list[StepReport]:
        self.next_step = step
        first = self.current is None
        if self.formed:  # a joiner's first step: its quorum is the one it healed in
            self.formed = False
        else:
            self.current = self.quorum.begin()
        if first:  # every socket of torchft's exists now: prove none is on another address
            check_bound(os.getpid(), self.cfg.elastic.host, f"worker {self.me}")
        self.quorum_s += self.current.quorum_s
        reports = super().run_step(step, source)
        self.progress.set(f"progress/{self.me}", str(step + 1))
        return reports

    def _flush_update(self, action, pp_before: int, dp_before: int) -> None:
        """Mean over the quorum (loss sum and count ride along), stage clip, the vote, the update."""
        worker, current = self.worker, self.current
        step = action.microbatch // self.cfg.mesh.microbatches
        stats = worker.stats.get(step, StepStats())
        grads = worker.grads()
        losses = list(stats.losses.values())
        flat = torch.cat([g.reshape(-1) for g in grads] +
                         [torch.tensor([sum(losses), len(losses)], dtype=grads[0].dtype)])
        started = time.monotonic()
        current.mean_ok = self.quorum.mean(flat)
        nbytes = flat.numel() * flat.element_size()
        if self.ring_next is not None:  # the ring model's time, as the fixed driver holds it
            hold_until(allreduce_release_at(self.network.link(self.me, self.ring_next), self.epoch,
                                            time.monotonic(), nbytes, current.participants, self.shaped))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        loss_sum, loss_count = flat[-2].item(), flat[-1].item()
        self.dp_wait_s += time.monotonic() - started
        sq_norm = worker.grad_sq_norm()
        current.stage_commit = self.quorum.should_commit() and current.mean_ok
        current.committed = self.vote.decide(step, self.me, current.participants, current.stage_commit)
        began = time.perf_counter()
        if current.committed:
            coef = clip_coefficient(sq_norm, stage_clip_norm(self.cfg.train.grad_clip, self.mesh.stages))
            worker.apply_update(action, coef, sq_norm)
        else:
            self.uncommitted += 1
            worker.discard_update(action)
        self.busy_s += time.perf_counter() - began
        mean_loss = loss_sum / loss_count if current.mean_ok and loss_count > 0 else None
        self.report = StepReport(step=step, losses=[mean_loss] if mean_loss is not None else [],
                                 sim_s=None, bytes_pp=self._bytes("pp") - pp_before,
                                 bytes_dp=self._bytes("dp") - dp_before + nbytes,
                                 grad_norm=sq_norm**0.5, staleness=[])
        return None

    def _report(self, step: int, rows) -> StepReport:
        return self.report

    def record_fields(self) -> dict:
        current = self.current
        if current is None:
            return {}
        return {"participants": current.participants, "committed": current.committed,
                "quorum_s": current.quorum_s}

    @torch.no_grad()
    def evaluate(self, batches) -> float | None:
        """Through this worker's own pipeline row (the rows are identical replicas at a committed
        step); the last stage has the loss, the others return None."""
        worker = self.worker
        if self.prev:
            self.transport.expect(self.prev, len(batches), self.eval_capacity)
        losses = []
        for i, (x, y) in enumerate(batches):
            if worker.is_first:
                h = ids = x.to(self.device)
            else:
                message = self.transport.next_message(f"validation activation {i}", self.prev)
                ids = message.payload.tensors.get("ids")
                h = worker.codec.decode(message.payload, "act")
            out = worker.module(h)
            if worker.is_last:
                losses.append(Decoder.loss(out, y.to(self.device)).item())
            else:
                self.transport.send(Message("act", -1, i, self.me, self.next,
                                            worker.codec.encode(out, "act", ids)),
                                    self.eval_capacity, shaped=False)
        return sum(losses) / len(losses) if worker.is_last else None

    def eval_fields(self) -> dict:
        return {}

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        return {"sim_time_s": None, "sim_tokens_per_s": None, "idle_fraction": None,
                "compute_model": f"real: elastic, {self.mesh.world_size} processes at start over "
                                 f"{self.comm}, one torchft quorum per stage, "
                                 f"shaping={self.cfg.dist.shaping}",
                "uncommitted_steps": self.uncommitted, "quorum_s_total": self.quorum_s,
                "links": []}

    def barrier(self, what: str) -> None:
        """No mesh-wide barrier: membership may have changed. (A checkpoint's manifest may thus
        name a shard that a departed worker never writes: that checkpoint stays incomplete.)"""

    def close(self) -> None:
        self.progress.set(f"elastic/finished/{self.me}", str(self.next_step + 1))
        self.transport.drain(self.deadlines.message_s)
        self.quorum.shutdown()
        self.health.finish()
        self.transport.close()
