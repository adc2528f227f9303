"""Build a worker's optimizer from the config, by registry name.

Every optimizer here acts parameter by parameter, so an optimizer over one pipeline stage does
exactly what the same optimizer over the unsplit model does to that stage's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    """The per-worker optimizer. Config keys under ``optim.``; the learning rate is ``train.lr``."""

    name: str = "adamw"
    """Registry name: adamw or sgd."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (not to norms)."""
    beta1: float = 0.9
    """First-moment decay (AdamW), or momentum (SGD)."""
    beta2: float = 0.95
    """Second-moment decay (AdamW)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on gains: the usual GPT recipe."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw(module: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor path gives bit-identical results whether a tensor sits in a
    # stage's optimizer or the unsplit model's (foreach kernels group tensors differently).
    return torch.optim.AdamW(decay_groups(module, cfg.weight_decay), lr=lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def _sgd(module: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(decay_groups(module, cfg.weight_decay), lr=lr, momentum=cfg.beta1,
                           foreach=False)


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimConfig, float], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "sgd": _sgd,
}


def build_optimizer(module: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name = {cfg.name!r} is unknown; registered: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.name](module, cfg, lr)
