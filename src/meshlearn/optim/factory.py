"""Build a worker's optimizer from the config, by registry name.

Every optimizer here acts parameter by parameter, so an optimizer over one pipeline stage does
exactly what the same optimizer over the unsplit model does to that stage's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshlearn.optim.muon import Muon
from meshlearn.optim.numuon import NuMuon


@dataclass(frozen=True)
class OptimConfig:
    """The per-worker optimizer. Config keys under ``optim.``; the learning rate is ``train.lr``."""

    name: str = "adamw"
    """Registry name: adamw, sgd, muon or numuon (Muon/NuMuon route embeddings, head and 1-D
    parameters to an internal AdamW group)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (not to norms)."""
    beta1: float = 0.9
    """First-moment decay (AdamW), or momentum (SGD)."""
    beta2: float = 0.95
    """Second-moment decay (AdamW)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    momentum: float = 0.95
    """Muon/NuMuon momentum (EMA form)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon's per-matrix lr scale: ``match_rms_adamw`` (reuse AdamW's lr) or ``original`` (lr in
    spectral-norm units, ~0.02)."""
    numuon_rank_fraction: float = 0.25
    """NuMuon's update rank as a fraction of min(m, n) of each matrix (the final one of a schedule)."""
    numuon_rank_schedule: str = "fixed"
    """``fixed``: ``numuon_rank_fraction`` throughout. ``cosine``: the method note's recipe — hold
    ``numuon_start_fraction`` for the first 10% of ``train.steps``, cosine-anneal to
    ``numuon_rank_fraction`` at 80%, then hold (early full-rank steps learn faster)."""
    numuon_start_fraction: float = 1.0
    """Where the ``cosine`` rank schedule starts."""
    numuon_match_muon_rms: bool = False
    """Scale each step by √(min(m, n)/k) so its RMS equals Muon's (the note's ``rms_match``; off by
    default: it enlarges each singular direction of the step)."""


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on gains: the usual GPT recipe."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor path gives bit-identical results whether a tensor sits in a
    # stage's optimizer or the unsplit model's (foreach kernels group tensors differently).
    return torch.optim.AdamW(decay_groups(module, cfg.weight_decay), lr=lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def _sgd(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    return torch.optim.SGD(decay_groups(module, cfg.weight_decay), lr=lr, momentum=cfg.beta1,
                           foreach=False)


def _muon(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    return Muon(module, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                adjust_lr_fn=cfg.muon_adjust_lr, adamw_lr=lr, adamw_betas=(cfg.beta1, cfg.beta2),
                adamw_eps=cfg.eps)


def numuon_schedule(cfg: OptimConfig, total_steps: int) -> tuple[float, str, dict]:
    """(starting rank fraction, schedule name, schedule kwargs) of NuMuon for a run of ``total_steps``."""
    if cfg.numuon_rank_schedule == "fixed":
        return cfg.numuon_rank_fraction, "fixed", {}
    end = max(1, round(0.8 * total_steps))
    kwargs = {"end_fraction": cfg.numuon_rank_fraction, "total_steps": end,
              "start_step": min(round(0.1 * total_steps), end - 1)}
    return cfg.numuon_start_fraction, "cosine", kwargs


def _numuon(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    fraction, schedule, kwargs = numuon_schedule(cfg, total_steps)
    return NuMuon(module, lr=lr, rank_fraction=fraction, rank_schedule=schedule,
                  rank_schedule_kwargs=kwargs, match_muon_rms=cfg.numuon_match_muon_rms,
                  momentum=cfg.momentum, weight_decay=cfg.weight_decay, adjust_lr_fn=cfg.muon_adjust_lr,
                  adamw_lr=lr, adamw_betas=(cfg.beta1, cfg.beta2), adamw_eps=cfg.eps)


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimConfig, float, int], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "sgd": _sgd,
    "muon": _muon,
    "numuon": _numuon,
}


def build_optimizer(module: nn.Module, cfg: OptimConfig, lr: float,
                    total_steps: int = 0) -> torch.optim.Optimizer:
    """``total_steps`` (the run's ``train.steps``) sizes NuMuon's rank schedule."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name = {cfg.name!r} is unknown; registered: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.name](module, cfg, lr, total_steps)
