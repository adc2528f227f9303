"""Fixtures for optimizer tests: a tiny LM with every parameter-routing case once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding + two hidden linears + norm + head."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.tok_emb(idx)
        x = x + self.down(torch.relu(self.up(x)))
        return self.lm_head(self.norm(x))


@pytest.fixture
def make_lm() -> Callable[[int], TinyLM]:
    """``make_lm(seed)`` builds a TinyLM with deterministic weights."""

    def make(seed: int = 0) -> TinyLM:
        torch.manual_seed(seed)
        return TinyLM()

    return make


@pytest.fixture
def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five (input, target) token batches of shape (4, 8)."""
    g = torch.Generator().manual_seed(123)
    return [
        (torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g))
        for _ in range(5)
    ]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


@pytest.fixture
def loss_fn() -> Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    return lm_loss

