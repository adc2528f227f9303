"""A tiny deterministic config for mesh tests: every shape up to P=4, D=2 fits, steps take ms."""

from __future__ import annotations

from pathlib import Path

from meshlearn.config import RunConfig, load_config


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
