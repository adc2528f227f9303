"""Optimizers, usable without the mesh, and the registry the mesh builds them from."""

from meshlearn.optim.factory import OPTIMIZERS, OptimConfig, build_optimizer, decay_groups

__all__ = ["OPTIMIZERS", "OptimConfig", "build_optimizer", "decay_groups"]
