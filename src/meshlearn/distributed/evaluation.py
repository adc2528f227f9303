"""Evaluation across processes: replica 0's stages forward the validation batches as a pipeline.

A mixin of ``DistDriver`` (kept apart because it is the driver's one job that is not a training
step): it reads the driver's worker, transport, collectives and capacities.
"""

from __future__ import annotations

import copy

import torch

from meshlearn.compress.codecs import MessageContext
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder

EVAL_STEP = -1
"""The step number validation activations carry (no training step has it)."""


def evaluation_passes(cfg) -> int:
    """Pipeline passes over the validation batches per evaluation: a second, masked one under the
    mask codec (``val_loss_masked``). The elastic driver evaluates its rows unmasked only
    (``elastic/driver.py``). The verifier relays this many batches' worth per evaluation."""
    return 2 if cfg.codec.name == "mask" and not cfg.elastic.enabled else 1


class PipelineEvaluation:
    """``evaluate`` and ``eval_fields`` of the distributed driver."""

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Replica 0's stages forward the validation batches as a pipeline (unshaped, uncounted:
        the simulator charges no time for evaluation either); every process gets the mean loss.
        When the DP strategy lets replicas drift: the loss of the fully averaged model (a mean
        over each stage's dp group at this drain point), replica 0's own in ``eval_fields``. Under
        a codec that masks only in training (``codec.name = mask``) also ``val_loss_masked``: the
        same model with batch i's boundaries coded as microbatch 0 of step i (the simulator's
        ``pipeline_loss(..., masked_as=i)``: both ends regenerate those masks)."""
        own = self._evaluate(batches, self.worker.module)
        self._eval_fields = {}
        if self.dp is None or not self.dp.drifts:
            self._masked_loss(batches, self.worker.module)
            return own
        averaged = copy.deepcopy(self.worker.module)
        flat = torch.cat([p.detach().reshape(-1) for p in averaged.parameters()])
        flat = self.collectives.stage_sum(flat, "the average of the replicas for evaluation")
        flat.div_(self.mesh.replicas)
        offset = 0
        for p in averaged.parameters():
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._eval_fields = {"val_loss_replica0": own}
        loss = self._evaluate(batches, averaged)
        self._masked_loss(batches, averaged)
        return loss

    def eval_fields(self) -> dict:
        return getattr(self, "_eval_fields", {})

    def _masked_loss(self, batches, module) -> None:
        if evaluation_passes(self.cfg) == 2:
            self._eval_fields["val_loss_masked"] = self._evaluate(batches, module, masked=True)

    @torch.no_grad()
    def _evaluate(self, batches, module, masked: bool = False) -> float:
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
                    while message.kind == "dp":  # a straggler of a dropped DP round: its strategy's
                        self._dp_deliver(message)
                        message = self.transport.next_message(f"validation activation {i}", self.prev)
                    ids = message.payload.tensors.get("ids")
                    ctx = _context(i, self.me.stage - 1, self.device, masked)
                    h = worker.codec.decode(message.payload, "act", ctx)
                out = module(h)
                if worker.is_last:
                    losses.append(Decoder.loss(out, y.to(self.device)).item())
                else:
                    ctx = _context(i, self.me.stage, self.device, masked)
                    message = Message("act", EVAL_STEP, i, self.me, self.next,
                                      worker.codec.encode(out, "act", ids, ctx))
                    # The verifier posts training-sized buffers: a batch goes by the oversize path.
                    capacity = self.capacity if self.relay is not None else self.eval_capacity
                    self.transport.send(message, capacity, shaped=False)
            loss = sum(losses) / len(losses) if worker.is_last else 0.0
        value = torch.tensor([loss], dtype=torch.float64, device=self.device)
        src = self.mesh.rank(WorkerId(0, self.mesh.stages - 1))
        return self.collectives.broadcast(value, src, "the broadcast of the validation loss").item()


def _context(batch: int, boundary: int, device: torch.device, masked: bool) -> MessageContext:
    """An evaluation message, or (``masked``) batch ``batch`` coded as microbatch 0 of step
    ``batch`` on replica 0, as the simulator's masked evaluation codes it."""
    if masked:
        return MessageContext(batch, 0, boundary, 0, device=device)
    return MessageContext.evaluation(boundary, device)
