"""Optimizers, usable without the mesh, and the registry the mesh builds them from."""

from meshlearn.optim.factory import (
    OPTIMIZERS,
    OptimConfig,
    build_optimizer,
    decay_groups,
    resolve_betas,
    validate_optim,
)
from meshlearn.optim.muon import Muon
from meshlearn.optim.nadamw import NAdamW, nadamw_update
from meshlearn.optim.no_ws import StageHparams, no_ws_stage_hparams, stage_delay
from meshlearn.optim.numuon import NuMuon
from meshlearn.optim.orthogonalize import block_krylov_topk, newton_schulz, topk_lmo
from meshlearn.optim.param_sets import add_parameters, remove_parameters
from meshlearn.optim.routing import is_embedding_or_head, split_params
from meshlearn.optim.spectral import SpectralConfig, SpectralCorrection, filter_gradient

__all__ = [
    "OPTIMIZERS",
    "Muon",
    "NAdamW",
    "NuMuon",
    "OptimConfig",
    "SpectralConfig",
    "SpectralCorrection",
    "StageHparams",
    "add_parameters",
    "block_krylov_topk",
    "build_optimizer",
    "decay_groups",
    "filter_gradient",
    "is_embedding_or_head",
    "nadamw_update",
    "newton_schulz",
    "no_ws_stage_hparams",
    "remove_parameters",
    "resolve_betas",
    "split_params",
    "stage_delay",
    "topk_lmo",
    "validate_optim",
]
