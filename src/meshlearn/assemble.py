"""Turn a validated RunConfig into the pieces a run needs: the resolved config and the workers."""

from __future__ import annotations

import copy
import dataclasses

from meshlearn.anchor.feedback import attach_feedback
from meshlearn.compress.registry import build_codec
from meshlearn.compress.wire_checks import WireGuard
from meshlearn.config import RunConfig
from meshlearn.dp.registry import build_strategy
from meshlearn.mesh.network import build_run_network
from meshlearn.mesh.schedule import build_plan, stage_in_flight
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.llama import Decoder
from meshlearn.models.split import init_model, split_model
from meshlearn.optim.async_lr import async_lr_scale
from meshlearn.optim.factory import build_optimizer
from meshlearn.optim.no_ws import no_ws_stage_hparams
from meshlearn.optim.spectral import SpectralCorrection
from meshlearn.protocol.model import stage_modules


def resolve(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """The one place derived values are filled in: the vocabulary comes from the tokenizer."""
    if cfg.model.vocab_size not in (0, vocab_size):
        raise ValueError(f"model.vocab_size = {cfg.model.vocab_size} but the tokenizer has "
                         f"{vocab_size} tokens; leave it at 0 to take the tokenizer's")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def build_workers(cfg: RunConfig) -> dict[WorkerId, Worker]:
    """Every replica of every stage starts from the same seeded unsplit model."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    stages = stage_modules(cfg, split_model(init_model(cfg.model, cfg.seed), cfg.mesh.stages))
    return {wid: build_worker(cfg, wid, copy.deepcopy(stages[wid.stage])) for wid in mesh.workers()}


def build_worker(cfg: RunConfig, wid: WorkerId, module: Decoder) -> Worker:
    """One worker around its stage module (the dist runtime builds just its own)."""
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    optimizer = build_optimizer(module, cfg.optim, cfg.train.lr, cfg.train.steps)
    plan = build_plan(cfg.mesh.schedule, wid.stage, mesh.stages, cfg.mesh.microbatches,
                      stage_in_flight(cfg, wid.stage), cfg.mesh.update_every)
    codec = build_codec(cfg.codec, cfg.model)
    worker = Worker(wid, mesh, module, optimizer, codec, plan, cfg.mesh.microbatches,
                    cfg.mesh.weight_stashing)
    worker.guard = WireGuard(codec, cfg.model.seq_len, cfg.model.d_model, cfg.model.vocab_size)
    worker.dp = build_strategy(cfg.dp, worker, dp_link_profile(cfg, wid))
    if cfg.optim.spectral.enabled:
        worker.spectral = SpectralCorrection(module.named_parameters(), cfg.optim.spectral)
        worker.spectral.attach(optimizer)
        attach_feedback(worker.spectral, cfg)
    if cfg.mesh.schedule == "async" and not cfg.mesh.weight_stashing:
        use_no_ws_hparams(worker, cfg)
    if cfg.mesh.schedule == "async":
        use_async_lr_rule(worker, cfg)
    return worker


def use_async_lr_rule(worker: Worker, cfg: RunConfig) -> None:
    """``mesh.async_lr_rule``: the stage's lr factor for per-microbatch, stale updates
    (:func:`~meshlearn.optim.async_lr.async_lr_scale`), on top of any No-WS scale. No-WS already
    compensates staleness, so it gets only the microbatch term."""
    rule = cfg.mesh.async_lr_rule
    if rule == "microbatch_staleness" and not cfg.mesh.weight_stashing:
        rule = "microbatch"
    scale = async_lr_scale(rule, cfg.mesh.microbatches, cfg.mesh.update_every, worker.plan.in_flight)
    inner = worker.stage_lr_scale
    if scale != 1.0:
        worker.stage_lr_scale = (lambda step: scale) if inner is None else (lambda step: scale * inner(step))


def use_no_ws_hparams(worker: Worker, cfg: RunConfig) -> None:
    """No-WS (method note): β1 grows with the stage's delay and early stages start at a smaller
    learning rate. β1 applies to every Adam-style group (those with ``betas``); Muon's own
    momentum is left as configured."""
    stage, stages, steps = worker.id.stage, cfg.mesh.stages, cfg.train.steps
    delay = worker.plan.in_flight - 1  # the stage's real staleness under mesh.in_flight
    beta1 = no_ws_stage_hparams(stage, stages, 0.0, cfg.optim.no_ws_lr_anneal, delay=delay).beta1
    for group in worker.optimizer.param_groups:
        if "betas" in group:
            group["betas"] = (beta1, group["betas"][1])
    worker.stage_lr_scale = lambda step: no_ws_stage_hparams(
        stage, stages, (step + 1) / steps, cfg.optim.no_ws_lr_anneal, delay=delay).lr_scale


def dp_link_profile(cfg: RunConfig, wid: WorkerId):
    """The slowest profile of ``wid``'s links to the other replicas of its stage (default deadlines
    of DP rounds derive from it)."""
    network = build_run_network(cfg)
    peers = [WorkerId(r, wid.stage) for r in range(cfg.mesh.replicas) if r != wid.replica]
    profiles = [network.link(wid, p).profile for p in peers] or [network.link(wid, wid).profile]
    return max(profiles, key=lambda p: (p.serialization_s(1 << 20) + p.latency_s))
