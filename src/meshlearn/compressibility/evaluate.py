"""Validation loss of an (optionally compressed) unsplit model."""

from __future__ import annotations

import torch
from torch import nn

from meshlearn.data.batches import Batch
from meshlearn.models.llama import Decoder


@torch.no_grad()
def validation_loss(model: nn.Module, batches: list[Batch]) -> float:
    """Mean over batches of the mean next-token cross-entropy (nats/token), as ``Trainer.evaluate``
    averages it, but through the unsplit model with no boundary codec in between."""
    was_training = model.training
    model.eval()
    try:
        losses = [Decoder.loss(model(x), y).item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
