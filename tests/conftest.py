"""Shared fixtures: a tiny deterministic corpus and a tiny config, so mesh tests run in seconds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from meshlearn.config import RunConfig, load_config

WORDS = [
    "the", "king", "queen", "lord", "speak", "night", "day", "love", "death", "sword", "crown",
    "heart", "blood", "honour", "fair", "foul", "sweet", "thou", "thee", "art", "hath", "doth",
    "what", "where", "when", "why", "how",
]


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(lines))
    return path


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
