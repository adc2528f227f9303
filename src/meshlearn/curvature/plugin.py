"""The curvature tracker as a trainer plugin: every ``curvature.every`` steps, at a drain point it asks
for (weights settled), warm-started Lanczos on a fixed probe batch.

It runs on replica 0's stages chained in this process (the simulator holds them all), through the
true model: boundary codecs are left out, so it measures the model's curvature, not the codec's.
Estimates: the full model (``lambda_max``), and with P > 1 each stage's diagonal Hessian block
(``lambda_max_stage``), whose HVP flows through the whole pipeline but moves only that stage's
parameters. A diagonal block's top eigenvalue is a lower bound on the full one (a Rayleigh quotient
restricted to the block), so per-stage values understate it; both are logged. Every value carries a
convergence flag (``<key>_converged``, a list for per-stage keys): an unconverged value is the top
Ritz value, a lower bound on its λ_max, not the value itself. The smallest Ritz value of the full
estimate is logged too (``lambda_min``): when |λ_min| > λ_max, power iteration would find λ_min. The
preconditioned values use each stage's Adam state and cover the parameters that have one
(``precond_fraction`` of the parameters tracked): not a block unlocked at this very drain point (no
step yet), nor Muon's hidden matrices (no diagonal preconditioner); that too is a diagonal block.
The cost is the tracker's wall time, reported per estimate and in summary.json; it is not charged to
the virtual clock.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from meshlearn.basis import BasisTensor
from meshlearn.curvature.power import (
    Eigen,
    HessianOperator,
    adam_preconditioner,
    adam_threshold,
    gd_threshold,
    stability_ratio,
)
from meshlearn.curvature.tracker import CurvatureTracker
from meshlearn.data.run_data import RunData
from meshlearn.hooks import Callback, PluginContext
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder

PROBE_STEP = -1
"""The probe batch is ``global_batch(train, PROBE_STEP, ...)``: fixed, and no training step's."""


class CurvatureCallback(Callback):
    def __init__(self, cfg: Any, workers: dict, data: RunData):
        self.cfg, self.c, self.data = cfg, cfg.curvature, data
        stages = cfg.mesh.stages
        self.workers = [workers[WorkerId(0, s)] for s in range(stages)]
        self.tracker = CurvatureTracker(self.c.iters, cfg.seed * 7919 + 17, self.c.tol)
        self.probe: tuple[torch.Tensor, torch.Tensor] | None = None
        self.evals, self.hvps, self.wall_s = 0, 0, 0.0

    def _probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.probe is None:
            self.probe = self.data.batch(PROBE_STEP, self.c.batch_size)
        return self.probe

    def _loss(self) -> torch.Tensor:
        x, y = self._probe()
        for worker in self.workers:
            x = worker.module(x)
        return Decoder.loss(x, y)

    def _lr_beta1(self, done: int) -> tuple[float, float]:
        from meshlearn.optim.schedule_lr import lr_factor

        t = self.cfg.train
        lr = t.lr * lr_factor(min(done, t.steps - 1), t.warmup_steps, t.steps, t.min_lr_ratio)
        betas = [g["betas"] for w in self.workers for g in w.optimizer.param_groups if "betas" in g]
        return lr, betas[0][0] if betas else 0.9

    def tracked(self) -> tuple[list[tuple[str, torch.Tensor]], list[int], list[torch.Tensor | None]]:
        """What the estimates cover: the trainable (name, parameter) pairs of replica 0's stages in
        order, the stage of each, and Adam's P for each (None without state, or when
        ``curvature.preconditioned`` is off)."""
        named, stage_of = [], []
        for s, worker in enumerate(self.workers):
            for name, p in worker.module.named_parameters():
                if p.requires_grad:
                    named.append((name, p))
                    stage_of.append(s)
        pre: list[torch.Tensor | None] = [None] * len(named)
        if self.c.preconditioned:
            for s, w in enumerate(self.workers):
                idx = [i for i in range(len(named)) if stage_of[i] == s]
                for i, p in zip(idx, adam_preconditioner(w.optimizer, [named[i][1] for i in idx]),
                                strict=True):
                    pre[i] = p
        return named, stage_of, pre

    def measure(self, done: int) -> dict:
        """One round of estimates; returns the metrics record."""
        started = time.perf_counter()
        self._probe()
        named, stage_of, pre = self.tracked()
        names = [n for n, _ in named]
        operator = HessianOperator(self._loss, [p for _, p in named])
        everything = list(range(len(named)))
        with_state = [i for i in everything if pre[i] is not None]
        record: dict = {"kind": "curvature", "step": done}
        full = self.tracker.estimate("full", operator, everything, names)
        full_pre = self._estimate("full_precond", operator, with_state, names, pre)
        if self.c.per_stage and len(self.workers) > 1:
            stages = range(len(self.workers))
            blocks = {f"stage{s}": self._estimate(f"stage{s}", operator,
                                                  [i for i in everything if stage_of[i] == s], names)
                      for s in stages}
            full, record["lambda_max_restarted"] = self.tracker.reconcile(
                "full", operator, everything, names, full, blocks)
            record |= flagged_list("lambda_max_stage", list(blocks.values()))
            if with_state:
                blocks = {f"stage{s}_precond": self._estimate(
                    f"stage{s}_precond", operator, [i for i in with_state if stage_of[i] == s], names, pre)
                    for s in stages}
                full_pre, record["lambda_max_precond_restarted"] = self.tracker.reconcile(
                    "full_precond", operator, with_state, [names[i] for i in with_state], full_pre,
                    blocks, [pre[i] for i in with_state])
                record |= flagged_list("lambda_max_precond_stage", list(blocks.values()))
        record |= flagged("lambda_max", full)
        record |= {"lambda_min": full.bottom, "lambda_min_converged": full.bottom_residual <= self.c.tol}
        if with_state:
            record |= flagged("lambda_max_precond", full_pre)
            record["precond_fraction"] = (sum(named[i][1].numel() for i in with_state)
                                          / sum(p.numel() for _, p in named))
        lr, beta1 = self._lr_beta1(done)
        record |= {"lr": lr, "gd_threshold": gd_threshold(lr), "gd_ratio": lr * record["lambda_max"] / 2}
        # the ratios inherit their estimate's flag (lambda_max_converged, lambda_max_precond_converged)
        if with_state:
            record |= {"adam_threshold": adam_threshold(lr, beta1),
                       "stability_ratio": stability_ratio(record["lambda_max_precond"], lr, beta1)}
        seconds = time.perf_counter() - started
        record |= {"probe_loss": operator.loss, "curvature_hvps": operator.products, "curvature_s": seconds}
        self.evals += 1
        self.hvps += operator.products
        self.wall_s += seconds
        return record

    def _estimate(self, key: str, operator: HessianOperator, idx: list[int], names: list[str],
                  pre: list | None = None) -> Eigen | None:
        if not idx:
            return None
        precond = None if pre is None else [pre[i] for i in idx]
        return self.tracker.estimate(key, operator, idx, [names[i] for i in idx], precond)

    # --- the hooks ---------------------------------------------------------------------------

    def drains_after(self, done: int) -> bool:
        return done % self.c.every == 0

    def on_drain(self, done: int) -> list[dict]:
        return [self.measure(done)] if done % self.c.every == 0 else []

    def basis_state(self, worker: WorkerId) -> dict[str, BasisTensor]:
        """The warm-start vectors of replica 0's stage ``worker.stage`` (tangent vectors: they move
        as weights), so that a protocol model's morph carries them into the new basis; a vector
        left in the old one would start the next estimate from a different direction. (The
        preconditioned estimates' previous P is Adam's and elementwise; morphs refuse Adam on the
        matrices they multiply, so it never covers one.)"""
        if worker.replica != 0:
            return {}
        names = {name for name, _ in self.workers[worker.stage].module.named_parameters()}
        return {f"{key}/{name}": BasisTensor(name, "weight", vector)
                for key, vectors in self.tracker.vectors.items()
                for name, vector in vectors.items() if name in names}

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "evals": self.evals, "hvps": self.hvps,
                "wall_s": self.wall_s}

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            self.tracker.load_state_dict(state["tracker"])
            self.evals, self.hvps, self.wall_s = state["evals"], state["hvps"], state["wall_s"]

    def summary(self) -> dict:
        return {"curvature_evals": self.evals, "curvature_hvps": self.hvps, "curvature_wall_s": self.wall_s,
                "curvature_s_per_eval": self.wall_s / self.evals if self.evals else None}


def flagged(key: str, eig: Eigen | None) -> dict:
    """``key`` (the top Ritz value), ``key_converged``, ``key_residual`` and ``key_iters``."""
    if eig is None:
        return {key: None}
    return {key: eig.value, f"{key}_converged": eig.converged, f"{key}_residual": eig.residual,
            f"{key}_iters": eig.iterations}


def flagged_list(key: str, eigs: list[Eigen | None]) -> dict:
    """The per-stage form of :func:`flagged`: one entry per stage in each list."""
    return {key: [None if e is None else e.value for e in eigs],
            f"{key}_converged": [None if e is None else e.converged for e in eigs]}


def curvature_plugin(ctx: PluginContext) -> CurvatureCallback | None:
    if not ctx.cfg.curvature.every:
        return None
    return CurvatureCallback(ctx.cfg, ctx.workers, ctx.data)
