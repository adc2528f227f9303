"""Drives the optional Grassmann updates of the subspace basis during a run (a trainer plugin).

Receivers of boundary gradients see ∂L/∂X at full width before encoding it; they feed S = Σ g gᵀ to
this updater. Every ``every`` steps — at a drain point the plugin requests, so nothing is in flight —
the coordinator takes one retraction step and every worker remaps its coefficients, first moments and
codec to the new U together, so no message encoded with the old basis is ever decoded with the new.
"""

from __future__ import annotations

import torch

from meshlearn.compress.subspace import SubspaceCodec
from meshlearn.hooks import Callback, PluginContext
from meshlearn.mesh.basis_update_settings import BasisUpdateConfig
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.grassmann import grassmann_step, remap_module, remap_optimizer_state, set_basis
from meshlearn.models.subspace import subspace_basis


class BasisUpdater:
    def __init__(self, cfg: BasisUpdateConfig, workers: dict[WorkerId, Worker], d_model: int, rank: int,
                 seed: int):
        self.cfg = cfg
        self.workers = workers
        self.basis = subspace_basis(d_model, rank, seed)
        self.second_moment = torch.zeros(d_model, d_model)
        self.updates = 0
        for worker in workers.values():
            worker.input_grad_observer = self.observe

    def observe(self, grad: torch.Tensor) -> None:
        rows = grad.detach().reshape(-1, grad.shape[-1]).float()
        self.second_moment += rows.t() @ rows

    def after_step(self, step: int) -> bool:
        """Update U if ``step`` (completed steps) is on the period and gradients were seen."""
        if step % self.cfg.every or not self.second_moment.any():
            return False
        new_basis = grassmann_step(self.basis, self.second_moment, self.cfg.lr)
        for worker in self.workers.values():
            maps = remap_module(worker.module, new_basis)
            remap_optimizer_state(worker.optimizer, maps)
            if isinstance(worker.codec, SubspaceCodec):
                worker.codec.set_basis(new_basis)
        self.basis = new_basis
        self.second_moment.zero_()
        self.updates += 1
        return True

    def state(self) -> dict:
        return {"basis": self.basis, "second_moment": self.second_moment, "updates": self.updates}

    def load_state(self, state: dict) -> None:
        self.basis = state["basis"]
        self.second_moment = state["second_moment"]
        self.updates = state["updates"]
        for worker in self.workers.values():
            set_basis(worker.module, self.basis)
            if isinstance(worker.codec, SubspaceCodec):
                worker.codec.set_basis(self.basis)


class BasisUpdateCallback(Callback):
    """Grassmann updates of U as a trainer plugin: each one at a drain point it asks for."""

    def __init__(self, updater: BasisUpdater):
        self.updater = updater

    def drains_after(self, done: int) -> bool:
        return done % self.updater.cfg.every == 0

    def on_drain(self, done: int) -> list[dict]:
        if not self.updater.after_step(done):
            return []
        return [{"kind": "event", "step": done, "event": "subspace_basis_update",
                 "updates": self.updater.updates}]

    def state_dict(self) -> dict:
        return self.updater.state()

    def load_state_dict(self, state: dict) -> None:
        self.updater.load_state(state)


def basis_update_plugin(ctx: PluginContext) -> BasisUpdateCallback | None:
    cfg = ctx.cfg
    if not cfg.subspace_update.every:
        return None
    m = cfg.model
    return BasisUpdateCallback(BasisUpdater(cfg.subspace_update, ctx.workers, m.d_model,
                                            m.subspace_rank, m.subspace_seed))
