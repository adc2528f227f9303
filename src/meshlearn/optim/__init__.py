"""Optimizers, usable without the mesh, and the registry the mesh builds them from."""

from meshlearn.optim.factory import OPTIMIZERS, OptimConfig, build_optimizer, decay_groups
from meshlearn.optim.muon import Muon
from meshlearn.optim.numuon import NuMuon
from meshlearn.optim.orthogonalize import block_krylov_topk, newton_schulz, topk_lmo
from meshlearn.optim.routing import is_embedding_or_head, split_params

__all__ = [
    "OPTIMIZERS",
    "Muon",
    "NuMuon",
    "OptimConfig",
    "block_krylov_topk",
    "build_optimizer",
    "decay_groups",
    "is_embedding_or_head",
    "newton_schulz",
    "split_params",
    "topk_lmo",
]
