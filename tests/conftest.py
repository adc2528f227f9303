"""Shared fixtures: a tiny deterministic corpus (see tiny.py for the matching tiny config)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

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
