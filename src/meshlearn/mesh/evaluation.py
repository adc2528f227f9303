"""Pipeline evaluation, written once, sans-IO: which passes an evaluation runs and each stage's part
of a pass.

Every runtime evaluates the same way: the validation batches go forward through a row of stages,
each boundary crossing the codec as an evaluation message (codecs that drop information for
training send it all), the last stage takes the loss. Which passes run, and which record field each
fills, is decided here (``evaluation_plan``): the model's loss (``val_loss``), through the mean of
the replicas when the DP strategy lets them drift (replica 0's own beside it,
``val_loss_replica0``), and under a codec that masks only in training also ``val_loss_masked``
(each boundary coded as in training: batch i as microbatch 0 of step i on replica 0, the masks the
same at every evaluation). A stage's part of a pass (``StageEval``: decode what arrives, forward,
encode what leaves, or the loss) is the same object in every runtime; the simulator chains the
stages in one process (``pipeline_loss``), dist and elastic send and receive its messages
(``distributed/evaluation.py``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from meshlearn.compress.codecs import Codec, MessageContext
from meshlearn.models.llama import Decoder

EVAL_STEP = -1
"""The step number validation activations carry (no training step has it)."""


@dataclass(frozen=True)
class EvalPass:
    """One pass over the validation batches: the record ``field`` it fills, through the replicas'
    mean (``averaged``) or replica 0's own model, with each boundary coded as in training
    (``masked``) or as an evaluation message."""

    field: str
    averaged: bool = False
    masked: bool = False


def evaluation_plan(drifts: bool, masks: bool) -> list[EvalPass]:
    """The passes of one evaluation, in the order a pipeline runs them. ``drifts``: the DP strategy
    lets replicas drift and there are several (the averaged model is evaluated, replica 0's own
    beside it); ``masks``: the codec masks only in training (``codec.name = mask``)."""
    own = [EvalPass("val_loss_replica0")] if drifts else []
    masked = [EvalPass("val_loss_masked", averaged=drifts, masked=True)] if masks else []
    return [*own, EvalPass("val_loss", averaged=drifts), *masked]


def run_plan(plan: list[EvalPass], loss: Callable[[EvalPass], float]) -> tuple[float, dict]:
    """Execute ``plan`` with a runtime's ``loss(pass)``: (``val_loss``, the other fields)."""
    values = {p.field: loss(p) for p in plan}
    return values.pop("val_loss"), values


Weights = TypeVar("Weights")


def run_evaluation(strategy, replicas: int, masks: bool, own: Weights, averaged: Callable[[], Weights],
             loss: Callable[[Weights, bool], float]) -> tuple[float, dict]:
    """One evaluation as every runtime runs it: the plan (the replicas' mean where ``strategy``, a
    ``DPStrategy`` or None, lets several drift; ``masks``: the codec masks only in training), each
    pass through the ``own`` weights or the mean (``averaged()``, built once, when a pass needs
    it) by the runtime's ``loss(weights, masked)``; returns (``val_loss``, the other fields)."""
    drifts = strategy is not None and strategy.drifts and replicas > 1
    mean = functools.cache(averaged)
    return run_plan(evaluation_plan(drifts, masks), lambda p: loss(mean() if p.averaged else own, p.masked))


def eval_context(batch: int, boundary: int, masked: bool,
                 device: torch.device | None = None) -> MessageContext:
    """Batch ``batch``'s message across ``boundary``: an evaluation message, or (``masked``) coded
    as microbatch 0 of step ``batch`` on replica 0, so a mask codec masks it with that training
    message's mask (both ends regenerate it)."""
    if masked:
        return MessageContext(batch, 0, boundary, 0, device=device)
    return MessageContext.evaluation(boundary, device)


@dataclass(frozen=True)
class StageEval:
    """Stage ``stage``'s part of a pass: what it decodes, computes and encodes for batch i."""

    stage: int
    stages: int
    codec: Codec
    masked: bool = False
    device: torch.device | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def arrive(self, payload, batch: int) -> torch.Tensor:
        """The activation batch ``batch`` brings from the stage below."""
        ctx = eval_context(batch, self.stage - 1, self.masked, self.device)
        return self.codec.decode(payload, "act", ctx)

    def leave(self, out: torch.Tensor, ids: torch.Tensor | None, batch: int):
        """The payload that carries ``out`` (of tokens ``ids``) to the stage above."""
        return self.codec.encode(out, "act", ids, eval_context(batch, self.stage, self.masked, self.device))


def pipeline_loss(stages: list[Decoder], codec: Codec, x: torch.Tensor, y: torch.Tensor,
                  masked_as: int | None = None) -> float:
    """Forward through the stages in order, each boundary crossing the codec as an evaluation
    message. ``masked_as``: as a training message instead, microbatch 0 of step ``masked_as`` on
    replica 0 (so a mask codec masks it with that message's mask)."""
    masked, batch = masked_as is not None, masked_as or 0
    parts = [StageEval(s, len(stages), codec, masked) for s in range(len(stages))]
    h = x
    for part, stage in zip(parts, stages, strict=True):
        if not part.is_first:
            h = part.arrive(parts[part.stage - 1].leave(h, x, batch), batch)
        h = stage(h)
    return Decoder.loss(h, y).item()


def mean_loss(stages: list[Decoder], codec: Codec, batches: list[tuple[torch.Tensor, torch.Tensor]],
              masked: bool = False) -> float:
    """Mean ``pipeline_loss`` over the batches; ``masked``: batch i coded as step i's training
    message (the same masks at every evaluation, so masked losses compare across steps)."""
    losses = [pipeline_loss(stages, codec, x, y, i if masked else None) for i, (x, y) in enumerate(batches)]
    return sum(losses) / len(losses)


def average_modules(modules: list[Decoder]) -> Decoder:
    """A copy of the first module holding the mean of the replicas' weights (summed in replica
    order, then divided, as the all-reduce does)."""
    out = copy.deepcopy(modules[0])
    named = [dict(m.named_parameters()) for m in modules]
    for name, param in out.named_parameters():
        param.data.copy_(torch.stack([n[name].detach() for n in named]).sum(0) / len(modules))
    return out
