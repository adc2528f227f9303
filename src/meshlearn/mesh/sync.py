"""The data-parallel axis's arithmetic shared by the drivers: the stage's reduce of gradients (the
update's decisions, the clip among them, are ``mesh/update.py``'s; the step's reported norm is
``mesh/report.py``'s)."""

from __future__ import annotations

import torch

from meshlearn.dp.robust import Robust
from meshlearn.mesh.worker import Worker


def average_gradients(group: list[Worker]) -> int:
    """All-reduce the gradients of one stage's replicas in place by the stage's rule
    (``dp.robust``; by default the mean); return the fp32 bytes of one contribution.

    Each replica's contribution is its flattened gradients (``Worker.flat_gradients``, where
    ``attack.target = dp`` corrupts), stacked in replica order and reduced with the dist driver's
    own expression, so the result is identical on every replica and in both drivers. Under a
    robust rule every replica notes the stage's outlier scores (all of them, as each process
    of dist does) with its update's step (attribution).
    """
    if len(group) == 1:
        return sum(g.numel() * g.element_size() for g in group[0].grads())
    aggregate, scores = stage_rule(group[0]).reduce_scored(torch.stack([w.flat_gradients() for w in group]))
    for w in group:
        w.set_flat_gradients(aggregate)
        if scores is not None:
            w.note_dp_score(w.next_action().microbatch // w.microbatches, scores)
    return aggregate.numel() * aggregate.element_size()


def stage_rule(worker: Worker) -> Robust:
    """The aggregation rule of the built-in all-reduce of ``worker``'s stage."""
    return worker.dp.robust if worker.dp is not None else Robust()
