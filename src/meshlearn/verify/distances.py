"""What SENTINEL measures: a message's summary statistics and their four distances to a reference.

Free functions on tensors, usable without the mesh. A boundary message is viewed as ``(b, n, c)``:
b sequences, n positions, c channels (d model values, or k subspace coefficients on a compressed
boundary). Its summary has two parts (method note, open detail 1):

- ``mean`` φ(X): option A, the batch mean per position, (n, c) — keeps position structure (early
  tokens, attention sinks); or option B, the mean over batch and positions, (c,) — blind to attacks
  confined to a few positions but robust to sequence packing.
- ``table``: the sliced-quantile table, (L, Q) — all b·n token vectors projected onto L fixed unit
  directions, Q quantiles per direction. In 1-D, averaging quantile functions is the Wasserstein
  barycenter, so an EMA of tables is a proper reference distribution and catches variance attacks
  (noise, scaling) that batch means hide.

The reference r is an exponential moving average of accepted summaries (``ema``); the distances are
those of the paper (Eq. 2): L1, normalized L2, sign-flip ratio and sliced Wasserstein.

Two more (our addition, ``PAIR_DISTANCES``) compare what a worker **sent** with what it **received**
for the same microbatch: its activation output with its activation input, or the gradient it sends
back with the gradient it got. A pipeline stage of a residual decoder changes each token's residual
vector only partly, forward and backward, so token by token (centred per position over the batch)
input and output point the same way. Measured on the demo (1 block per stage, 40 steps): mean cosine
0.97 (min 0.92) for activations, 0.92 (min 0.75) for gradients; the same messages with their
sequences permuted give −0.28, negated gradients −0.92. Every norm and the per-position batch mean
are blind to both. ``coh`` = 1 − that mean cosine (negation → ≈ 2, permutation → ≈ 1.3, zeros → 1);
``gain`` = |log(‖out‖/‖in‖) − reference|, for scaling by c > 0 (the reference is the boundary's EMA
of accepted log gains). Both blame the sender alone: its own input is the other half of the pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

EPS = 1e-12


@dataclass
class Summary:
    """The statistics of one message (or, as an EMA, the reference of a boundary)."""

    mean: torch.Tensor  # φ: (n, c) for position_mean, (c,) for global_mean
    table: torch.Tensor  # (L, Q) sliced quantiles of the token vectors


def position_mean(x: torch.Tensor) -> torch.Tensor:
    """Option A: the batch mean at every position, (b, n, c) → (n, c)."""
    return x.float().mean(dim=0)


def global_mean(x: torch.Tensor) -> torch.Tensor:
    """Option B: the mean over batch and positions, (b, n, c) → (c,)."""
    return x.float().reshape(-1, x.shape[-1]).mean(dim=0)


STATISTICS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "position_mean": position_mean,
    "global_mean": global_mean,
}


def swd_directions(channels: int, count: int, seed: int) -> torch.Tensor:
    """``count`` seeded random unit directions in R^channels, as columns (channels, count)."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(channels, count, generator=gen)
    return directions / directions.norm(dim=0, keepdim=True)


def quantile_levels(count: int) -> torch.Tensor:
    """Mid-point quantile levels (i + ½)/Q, avoiding the extreme order statistics."""
    return (torch.arange(count, dtype=torch.float32) + 0.5) / count


def quantile_table(x: torch.Tensor, directions: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Project every token vector of ``x`` (…, c) onto each direction; quantiles per direction, (L, Q).

    Linear interpolation between order statistics, as ``torch.quantile``. The sort runs in numpy,
    whose SIMD sort is ~50× faster than torch's on CPU; the projection stays in torch, whose thread
    settings the caller controls (numpy's BLAS threads would contend with parallel runs).
    """
    projected = directions.t() @ x.detach().float().reshape(-1, x.shape[-1]).t()  # (L, N)
    ordered = np.sort(projected.numpy(), axis=1)
    position = levels.numpy() * (ordered.shape[1] - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, ordered.shape[1] - 1)
    weight = (position - low).astype(np.float32)
    return torch.from_numpy(ordered[:, low] * (1 - weight) + ordered[:, high] * weight)


def summarize(x: torch.Tensor, statistic: str, directions: torch.Tensor,
              levels: torch.Tensor) -> Summary:
    return Summary(STATISTICS[statistic](x), quantile_table(x, directions, levels))


def ema(reference: Summary | None, summary: Summary, beta: float) -> Summary:
    """r ← β·r + (1−β)·φ; the first accepted summary initializes r."""
    if reference is None:
        return Summary(summary.mean.clone(), summary.table.clone())
    return Summary(beta * reference.mean + (1 - beta) * summary.mean,
                   beta * reference.table + (1 - beta) * summary.table)


# --- the four distances ----------------------------------------------------------------------


def l1(phi: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean absolute difference, mean |φ − r|."""
    return (phi - ref).abs().mean().item()


def normalized_l2(phi: torch.Tensor, ref: torch.Tensor) -> float:
    """‖φ − r‖ / (‖r‖ + ε): scale-free, so it survives the gradient scale drifting during training."""
    return ((phi - ref).norm() / (ref.norm() + EPS)).item()


def sign_flip_ratio(phi: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of entries whose sign differs (a zero has sign 0, so zeros differ from any r ≠ 0)."""
    return (torch.sign(phi) != torch.sign(ref)).float().mean().item()


def sliced_wasserstein(table: torch.Tensor, ref_table: torch.Tensor) -> float:
    """Mean over directions and quantile levels of |Q_msg − Q_ref|: the average 1-D W1 distance."""
    return (table - ref_table).abs().mean().item()


DISTANCES: dict[str, Callable[[Summary, Summary], float]] = {
    "l1": lambda s, r: l1(s.mean, r.mean),
    "l2n": lambda s, r: normalized_l2(s.mean, r.mean),
    "sfr": lambda s, r: sign_flip_ratio(s.mean, r.mean),
    "swd": lambda s, r: sliced_wasserstein(s.table, r.table),
}

_TERMS: dict[str, Callable[[Summary, Summary, torch.Tensor], torch.Tensor]] = {
    "l1": lambda s, r, diff: diff.abs().mean(),
    "l2n": lambda s, r, diff: diff.norm() / (r.mean.norm() + EPS),
    "sfr": lambda s, r, diff: (torch.sign(s.mean) != torch.sign(r.mean)).float().mean(),
    "swd": lambda s, r, diff: (s.table - r.table).abs().mean(),
}


def message_distances(summary: Summary, reference: Summary, metrics: list[str]) -> dict[str, float]:
    """``DISTANCES`` for several metrics at once: one φ − r and one host transfer (the verifier's
    per-message path; the single-metric functions above are the readable definitions)."""
    diff = summary.mean - reference.mean
    values = torch.stack([_TERMS[m](summary, reference, diff).float() for m in metrics]).tolist()
    return dict(zip(metrics, values, strict=True))


# --- pair distances: a worker's output against its own input for the same microbatch ---------


def coherence(received: torch.Tensor, sent: torch.Tensor) -> float:
    """Mean over tokens of cos(received, sent), both centred per position over the batch, (b, n, c).

    Keyed to sequence identity: permuting the b sequences of ``sent`` pairs each token with another
    sequence's (≈ −1/(b−1) after centring); negating it flips the sign. A zero vector counts as 0.
    With b = 1 nothing is centred (and a permutation is the identity)."""
    a, b = received.float(), sent.float()
    if a.shape[0] > 1:  # with one sequence there is nothing to centre against
        a, b = a - a.mean(0, keepdim=True), b - b.mean(0, keepdim=True)
    dot = (a * b).sum(-1)
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(norms > EPS, dot / norms.clamp_min(EPS), torch.zeros_like(dot)).mean().item()


def log_gain(received: torch.Tensor, sent: torch.Tensor) -> float:
    """log(‖sent‖ / ‖received‖): what a stage does to the message's scale (−inf/inf clamped)."""
    return float(np.log(max(sent.float().norm().item(), EPS) / max(received.float().norm().item(), EPS)))


PAIR_DISTANCES = ("coh", "gain")
"""Distances that need the sender's input too (``Sentinel`` pairs the messages of a microbatch)."""


def pair_distances(received: torch.Tensor, sent: torch.Tensor, gain_reference: float | None,
                   metrics: list[str]) -> tuple[dict[str, float], float]:
    """``coh`` and ``gain`` (those in ``metrics``) of one pair, and the pair's log gain."""
    gain = log_gain(received, sent)
    out = {}
    if "coh" in metrics:
        out["coh"] = 1.0 - coherence(received, sent)
    if "gain" in metrics and gain_reference is not None:
        out["gain"] = abs(gain - gain_reference)
    return out, gain
