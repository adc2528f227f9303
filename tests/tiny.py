"""A tiny deterministic config for mesh tests: every shape up to P=4, D=2 fits, steps take ms."""

from __future__ import annotations

from pathlib import Path

import torch

from meshlearn.config import RunConfig, load_config
from meshlearn.data import global_batch
from meshlearn.models import Decoder, init_model
from meshlearn.optim import build_optimizer
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.train import Trainer


def tiny_config(corpus: Path, *overrides: str) -> RunConfig:
    """4 layers of width 32: every mesh shape up to P=4, D=2 fits, and a step takes milliseconds."""
    base = [
        f"data.corpus={corpus}", "model.n_layer=4", "model.d_model=32", "model.n_head=2",
        "model.seq_len=16", "mesh.stages=1", "mesh.replicas=1", "mesh.microbatches=2",
        "train.batch_size=8", "train.steps=3", "train.warmup_steps=1", "train.eval_every=1000",
        "train.eval_batches=1", "train.checkpoint_every=0", "link.bandwidth_mbit=100",
        "link.latency_ms=10",
    ]
    return load_config(None, base + list(overrides))


def reference_run(trainer: Trainer, steps: int) -> tuple[list[float], Decoder]:
    """Plain single-process training on the same global batches."""
    cfg = trainer.cfg
    model = init_model(cfg.model, cfg.seed)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, cfg.train.steps)
    losses = []
    for t in range(steps):
        x, y = global_batch(trainer.corpus.splits.train, t, cfg.train.batch_size,
                            cfg.model.seq_len, cfg.seed)
        loss = Decoder.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=False)
        factor = lr_factor(t, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model
