"""Evaluation across processes: the evaluation plan (mesh/evaluation.py) executed by a row of stage
processes, each stage's part (``StageEval``) sent and received over the pipeline links.

A mixin of ``DistDriver`` (kept apart because it is the driver's one job that is not a training
step): it reads the driver's worker, transport, collectives and capacities. The elastic driver runs
``evaluation_pass`` through its own row and shares no loss (docs/elastic.md).
"""

from __future__ import annotations

import copy

import torch

from meshlearn.mesh.evaluation import EVAL_STEP, StageEval, run_evaluation
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder


def evaluation_passes(cfg) -> int:
    """Pipeline passes over the validation batches per evaluation: a second, masked one under the
    mask codec (``val_loss_masked``). The elastic driver evaluates its rows unmasked only
    (``elastic/driver.py``). The verifier relays this many batches' worth per evaluation."""
    return 2 if cfg.codec.name == "mask" and not cfg.elastic.enabled else 1


class PipelineEvaluation:
    """``evaluate`` and ``eval_fields`` of the distributed driver."""

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The evaluation plan through replica 0's stages (unshaped, uncounted: the simulator
        charges no time for evaluation either); every process gets each pass's mean loss. The
        replicas' mean, where they drift, is a mean over each stage's dp group at this drain
        point."""
        loss, self._eval_fields = run_evaluation(
            self.dp_axis.strategy, self.mesh.replicas, evaluation_passes(self.cfg) == 2, self.worker.module,
            self._averaged, lambda module, masked: self._evaluate(batches, module, masked))
        return loss

    def eval_fields(self) -> dict:
        return getattr(self, "_eval_fields", {})

    def _averaged(self) -> torch.nn.Module:
        """This stage's module with the mean of its replicas' weights (a collective of the stage)."""
        averaged = copy.deepcopy(self.worker.module)
        flat = torch.cat([p.detach().reshape(-1) for p in averaged.parameters()])
        flat = self.collectives.stage_sum(flat, "the average of the replicas for evaluation")
        flat.div_(self.mesh.replicas)
        offset = 0
        for p in averaged.parameters():
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return averaged

    def _evaluate(self, batches, module, masked: bool) -> float:
        """One pass through replica 0's row; the last stage's mean loss, broadcast to everyone."""
        loss = self.evaluation_pass(batches, module, masked) if self.me.replica == 0 else None
        value = torch.tensor([loss or 0.0], dtype=torch.float64, device=self.device)
        src = self.mesh.rank(WorkerId(0, self.mesh.stages - 1))
        return self.collectives.broadcast(value, src, "the broadcast of the validation loss").item()

    @torch.no_grad()
    def evaluation_pass(self, batches, module, masked: bool = False) -> float | None:
        """This stage's part of one pass through its row: receive from the stage below, forward,
        send above; the last stage's mean loss (the others: None)."""
        part = StageEval(self.me.stage, self.mesh.stages, self.worker.codec, masked, self.device)
        if self.prev:
            self.transport.expect(self.prev, len(batches), self.eval_capacity)
        losses = []
        for i, (x, y) in enumerate(batches):
            if part.is_first:
                h = ids = x.to(self.device)
            else:
                message = self.transport.next_message(f"validation activation {i}", self.prev)
                while message.kind == "dp":  # a straggler of a dropped DP round: its strategy's
                    self.dp_axis.deliver(message)
                    message = self.transport.next_message(f"validation activation {i}", self.prev)
                ids = message.payload.tensors.get("ids")
                h = part.arrive(message.payload, i)
            out = module(h)
            if part.is_last:
                losses.append(Decoder.loss(out, y.to(self.device)).item())
            else:
                # The verifier posts training-sized buffers: a batch goes by the oversize path.
                capacity = self.capacity if self.verdicts is not None else self.eval_capacity
                self.transport.send(Message("act", EVAL_STEP, i, self.me, self.next, part.leave(out, ids, i)),
                                    capacity, shaped=False)
        return sum(losses) / len(losses) if part.is_last else None
