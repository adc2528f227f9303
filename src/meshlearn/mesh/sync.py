"""The data-parallel axis and the end of a synchronous step, shared by both drivers."""

from __future__ import annotations

import math

import torch

from meshlearn.mesh.worker import Worker


def average_gradients(group: list[Worker]) -> int:
    """All-reduce (mean) the gradients of one stage's replicas in place; return the fp32 bytes.

    Summed in replica order then divided, so the result is identical on every replica.
    """
    if len(group) == 1:
        return sum(g.numel() * g.element_size() for g in group[0].grads())
    params = [list(w.module.parameters()) for w in group]
    nbytes = 0
    for replica_params in zip(*params, strict=True):
        grads = [p.grad for p in replica_params]
        mean = torch.stack(grads).sum(0) / len(grads)
        for g in grads:
            g.copy_(mean)
        nbytes += mean.numel() * mean.element_size()
    return nbytes


def clip_coefficient(sq_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient; 1.0 when clipping is off (max_norm ≤ 0)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(sq_norm) + 1e-6))
