"""Calibration inputs for activation-aware compression (ASVD, SVD-LLM), collected with hooks.

Windows are drawn from the corpus's *train* split with their own seed, never from the validation
split the compressed model is scored on. Each hooked linear layer accumulates only sufficient
statistics of its input x (one row per token): the Gram matrix ``Σ x xᵀ`` for SVD-LLM and the sum
of ``|x|`` per channel for ASVD, both in fp64. Memory is then ``n²`` per layer whatever the number
of calibration tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

DEFAULT_SEQUENCES = 64
"""Calibration windows of the model's seq_len; the literature uses 256 on billion-parameter models,
64 × 128 tokens is already 20× the widest input (352 channels) of the demo model."""


def calibration_windows(tokens: np.ndarray, n_sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """``n_sequences`` token windows (n, seq_len) at seeded random offsets of ``tokens``."""
    if n_sequences < 1:
        raise ValueError(f"calibration needs at least one sequence, got {n_sequences}")
    if len(tokens) < seq_len:
        raise ValueError(f"calibration needs {seq_len} tokens per window, the split has {len(tokens)}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, len(tokens) - seq_len + 1, (n_sequences,), generator=gen).numpy()
    idx = offsets[:, None] + np.arange(seq_len)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


@dataclass
class InputStats:
    """Sufficient statistics of one layer's inputs X ∈ R^{n×N} (N = tokens seen)."""

    gram: torch.Tensor
    """X Xᵀ, (n, n) fp64."""
    abs_sum: torch.Tensor
    """Σ_t |X_jt| per input channel j, (n,) fp64."""
    count: int = 0

    @classmethod
    def empty(cls, n: int) -> InputStats:
        return cls(torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64))

    def add(self, x: torch.Tensor) -> None:
        """Accumulate a batch of inputs (..., n)."""
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        self.gram.addmm_(rows.T, rows)
        self.abs_sum.add_(rows.abs().sum(0))
        self.count += rows.shape[0]

    @property
    def abs_mean(self) -> torch.Tensor:
        """mean_t |X_jt|, ASVD's per-channel activation scale."""
        return self.abs_sum / max(self.count, 1)


@torch.no_grad()
def collect_input_stats(model: nn.Module, layers: dict[str, nn.Module], inputs: torch.Tensor,
                        batch_size: int = 16) -> dict[str, InputStats]:
    """Run ``inputs`` (token ids, (N, T)) through ``model`` and gather the input statistics of each
    module in ``layers`` (name → module; each must have an ``in_features``-wide last input dim).

    Hooks are removed on every exit path, and the model's train/eval mode is restored."""
    stats = {name: InputStats.empty(_in_features(module)) for name, module in layers.items()}
    handles = [module.register_forward_hook(_recorder(stats[name])) for name, module in layers.items()]
    was_training = model.training
    model.eval()
    try:
        for batch in _batches(inputs, batch_size):
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return stats


def _in_features(module: nn.Module) -> int:
    return module.weight.shape[1]


def _recorder(stats: InputStats):
    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        stats.add(args[0])
    return hook


def _batches(inputs: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    for start in range(0, inputs.shape[0], batch_size):
        yield inputs[start:start + batch_size]
