"""Shared fixtures: a tiny deterministic corpus (see tiny.py for the matching tiny config), and one
intra-op thread for every test."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from meshlearn.entry.plugins import register_builtin_plugins

register_builtin_plugins()  # tests build Trainers directly, with the methods the entry points register

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


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tests use small tensors, where intra-op threads only add overhead: on a busy 2-core machine
    OpenMP spin-waiting made one 128×48 SVD take 0.8 s instead of 50 µs. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
