"""Build a worker's optimizer from the config, by registry name.

Every optimizer here acts parameter by parameter, so an optimizer over one pipeline stage does
exactly what the same optimizer over the unsplit model does to that stage's parameters.

Every optimizer is built over the module's *trainable* parameters (``requires_grad``); frozen ones
hold no state and get no weight decay. Parameters can join later with fresh state, routed as they
would have been here: :func:`meshlearn.optim.param_sets.add_parameters` (and leave with
``remove_parameters`` before their first step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from meshlearn.optim.muon import Muon
from meshlearn.optim.nadamw import NAdamW
from meshlearn.optim.numuon import NuMuon
from meshlearn.optim.spectral import SpectralConfig, validate_spectral

OWN_DEFAULT = 0.0
"""Value of ``optim.beta1`` / ``optim.beta2`` meaning "the chosen optimizer's own default"."""
ADAMW_BETAS = (0.9, 0.95)
"""AdamW's (β1, β2), also the AdamW part of Muon/NuMuon; β1 is SGD's momentum."""
NADAMW_BETAS = (0.99, 0.999)
"""NAdamW's (β1, β2), the official AsyncPP code's: β1 = 0.99 is the look-ahead's delay correction."""


@dataclass(frozen=True)
class OptimConfig:
    """The per-worker optimizer. Config keys under ``optim.``; the learning rate is ``train.lr``."""

    name: str = "adamw"
    """Registry name: adamw, nadamw, sgd, muon or numuon (Muon/NuMuon route embeddings, head and
    1-D parameters to an internal AdamW group). nadamw is NAdam with decoupled weight decay, the
    look-ahead optimizer of asynchronous pipelines."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (not to norms)."""
    beta1: float = OWN_DEFAULT
    """First-moment decay (AdamW, NAdamW, the AdamW part of Muon/NuMuon), or momentum (SGD), in
    (0, 1). 0 = the optimizer's own default: 0.9 (AdamW, SGD, Muon/NuMuon), 0.99 (NAdamW)."""
    beta2: float = OWN_DEFAULT
    """Second-moment decay, in (0, 1). 0 = the optimizer's own default: 0.95 (AdamW, Muon/NuMuon),
    0.999 (NAdamW). Unused by SGD."""
    eps: float = 1e-8
    """AdamW's and NAdamW's denominator epsilon."""
    momentum: float = 0.95
    """Muon/NuMuon momentum (EMA form)."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon's per-matrix lr scale: ``match_rms_adamw`` (reuse AdamW's lr) or ``original`` (lr in
    spectral-norm units, ~0.02)."""
    numuon_rank_fraction: float = 0.25
    """NuMuon's update rank as a fraction of min(m, n) of each matrix (the final one of a schedule)."""
    numuon_rank_schedule: Literal["fixed", "cosine"] = "fixed"
    """``fixed``: ``numuon_rank_fraction`` throughout. ``cosine``: the method note's recipe — hold
    ``numuon_start_fraction`` for the first 10% of ``train.steps``, cosine-anneal to
    ``numuon_rank_fraction`` at 80%, then hold (early full-rank steps learn faster)."""
    numuon_start_fraction: float = 1.0
    """Where the ``cosine`` rank schedule starts."""
    numuon_match_muon_rms: bool = False
    """Scale each step by √(min(m, n)/k) so its RMS equals Muon's (the note's ``rms_match``; off by
    default: it enlarges each singular direction of the step)."""
    numuon_nesterov: bool = False
    """NuMuon's momentum input: ``true`` = Nesterov (the step follows G + μ(M − G), as Muon always
    does), ``false`` = the momentum buffer M itself. Off by default, the reimplementations' "paper
    recipe" in the method note; turn it on to compare NuMuon with Muon like for like (at rank
    fraction 1.0 it is then Muon exactly; docs/compressibility.md measures both settings)."""
    no_ws_lr_anneal: float = 0.12
    """No-WS asynchronous pipelines (no weight stashing): E, the fraction of ``train.steps`` over
    which an earlier stage's reduced lr, lr / max(τ_s, 1)^(1 − min(progress/E, 1)), returns to the
    full lr (see :func:`~meshlearn.optim.no_ws.no_ws_stage_hparams`). 0 = no reduction. 0.12 is the
    (commented-out) setting of the AsyncPP run script, 6 of 50 epochs; raise it if the first stages
    diverge early, lower it if they lag the last stage's loss long after warm-up."""
    spectral: SpectralConfig = field(default_factory=SpectralConfig)
    """The spectral correction before the optimizer step (anchor priors; optim/spectral.py)."""


def resolve_betas(cfg: OptimConfig, own: tuple[float, float]) -> tuple[float, float]:
    """``(optim.beta1, optim.beta2)``, each replaced by the optimizer's ``own`` default where unset."""
    return (own[0] if cfg.beta1 == OWN_DEFAULT else cfg.beta1,
            own[1] if cfg.beta2 == OWN_DEFAULT else cfg.beta2)


def validate_optim(cfg: OptimConfig, require: Callable[[bool, str, Any, str], None]) -> None:
    """Checks of ``optim.*`` run by ``config.validate``; ``require(ok, key, value, allowed)`` raises
    the ConfigError naming the field, the value and what is allowed."""
    require(cfg.name in OPTIMIZERS, "optim.name", cfg.name, f"allowed: {sorted(OPTIMIZERS)}")
    for key, value in [("optim.beta1", cfg.beta1), ("optim.beta2", cfg.beta2)]:
        require(value == OWN_DEFAULT or 0 < value < 1, key, value,
                "in (0, 1), or 0 for the optimizer's own default")
    require(0 < cfg.numuon_rank_fraction <= 1, "optim.numuon_rank_fraction",
            cfg.numuon_rank_fraction, "in (0, 1]")
    require(0 < cfg.numuon_start_fraction <= 1, "optim.numuon_start_fraction",
            cfg.numuon_start_fraction, "in (0, 1]")
    require(cfg.no_ws_lr_anneal >= 0 and math.isfinite(cfg.no_ws_lr_anneal), "optim.no_ws_lr_anneal",
            cfg.no_ws_lr_anneal, "a finite fraction of train.steps >= 0 (0 = no lr reduction)")
    validate_spectral(cfg.spectral, require)


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
                             betas=resolve_betas(cfg, ADAMW_BETAS), eps=cfg.eps, foreach=False)


def _nadamw(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    # Elementwise like AdamW, so routed like AdamW: decay on matrices (embedding and head
    # included), none on gains.
    return NAdamW(decay_groups(module, cfg.weight_decay), lr=lr,
                  betas=resolve_betas(cfg, NADAMW_BETAS), eps=cfg.eps)


def _sgd(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    momentum = resolve_betas(cfg, ADAMW_BETAS)[0]
    return torch.optim.SGD(decay_groups(module, cfg.weight_decay), lr=lr, momentum=momentum,
                           foreach=False)


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the parameters that train now, by name (Muon routes by name)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _muon(module: nn.Module, cfg: OptimConfig, lr: float, total_steps: int) -> torch.optim.Optimizer:
    return Muon(trainable(module), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                adjust_lr_fn=cfg.muon_adjust_lr, adamw_lr=lr,
                adamw_betas=resolve_betas(cfg, ADAMW_BETAS), adamw_eps=cfg.eps)


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
    return NuMuon(trainable(module), lr=lr, rank_fraction=fraction, rank_schedule=schedule,
                  rank_schedule_kwargs=kwargs, match_muon_rms=cfg.numuon_match_muon_rms,
                  momentum=cfg.momentum, nesterov=cfg.numuon_nesterov, weight_decay=cfg.weight_decay,
                  adjust_lr_fn=cfg.muon_adjust_lr,
                  adamw_lr=lr, adamw_betas=resolve_betas(cfg, ADAMW_BETAS), adamw_eps=cfg.eps)


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimConfig, float, int], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "nadamw": _nadamw,
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
