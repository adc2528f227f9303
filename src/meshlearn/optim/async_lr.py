"""The learning-rate rule of the asynchronous pipeline (``mesh.schedule = async``).

``train.lr`` is tuned for flushing schedules: one update per step on the whole batch B, with fresh
gradients. Under ``async`` stage s instead takes n = M / update_every updates per step (M =
``mesh.microbatches``), each on B / n, and applies every gradient τ_s updates late. Keeping
``train.lr`` then takes n× as many steps of the same size on noisier gradients, through stale
weights: measured on the demo model at P = 8, 3e-3 (the 1F1B optimum) ends 25.6% above 1F1B, while
1e-3 matches it (shared/reviews/fidelity-2026-12.md).

The rule (``microbatch_staleness``, the default) scales each stage's scheduled lr by

    f_s = 1 / √(n · (1 + τ_s)),   τ_s = (depth_s − 1) / update_every

* **1/√n, the microbatch term**: the square-root scaling rule for adaptive optimizers (Malladi,
  Lyu, Panigrahi & Arora, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms",
  NeurIPS 2022): Adam/RMSprop taken at batch B/n follow the same SDE as at batch B when the lr is
  divided by √n (with β's adjusted, which we leave alone). It is the whole rule for the last stage,
  which is never stale.
* **1/√(1 + τ_s), the staleness term**: delay-adaptive step sizes shrink a step by its delay
  (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016: lr/τ; PipeMare, Yang et al., MLSys 2021:
  lr/τ_s^p per pipeline stage with p annealed from 1 to 0; the method note's No-WS rule). Weight
  stashing and the look-ahead already make a stale gradient exact at the weights it was taken at,
  so this takes the square root, the midpoint of PipeMare's exponent range, rather than the full
  1/τ: the gradient is old, not wrong. τ_s is the stage's steady-state staleness in updates:
  P − 1 − s by default (``mesh.in_flight`` deepens it), divided by ``update_every``.

On the shipped configs (P = 4, M = 4) f runs from 1/4 (stage 0) to 1/2 (the last stage), at P = 8
from 0.18 to 1/2. Measured (docs/async.md): with it, async + NAdamW's best ``train.lr`` is 1F1B's
shipped 3e-3 at P = 4 and P = 8, and it ends 7.2% and 4.4% below 1F1B at 1F1B's own best lr.
``microbatch`` keeps only the first term, ``off`` neither. Under No-WS (``mesh.weight_stashing =
false``) the staleness term is left to No-WS's own PipeMare schedule (``optim/no_ws.py``), so a
delay is never compensated twice.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

AsyncLrRule = Literal["microbatch_staleness", "microbatch", "off"]
"""Values of ``mesh.async_lr_rule``."""
ASYNC_LR_RULES = get_args(AsyncLrRule)


def async_lr_scale(rule: str, microbatches: int, update_every: int, depth: int) -> float:
    """f_s, the factor on a stage's scheduled lr under ``async``.

    Args:
        rule: one of :data:`ASYNC_LR_RULES`.
        microbatches: M, microbatches per replica per step.
        update_every: microbatches per update (divides M), so n = M / update_every updates a step.
        depth: the stage's in-flight depth (``StagePlan.in_flight``; P − s by default), whose
            steady-state staleness is (depth − 1) / update_every updates.
    """
    if rule not in ASYNC_LR_RULES:
        raise ValueError(f"rule must be one of {ASYNC_LR_RULES}, got {rule!r}")
    if microbatches < 1 or update_every < 1 or microbatches % update_every or depth < 1:
        raise ValueError(f"need microbatches >= 1 divisible by update_every >= 1 and depth >= 1, got "
                         f"microbatches={microbatches}, update_every={update_every}, depth={depth}")
    if rule == "off":
        return 1.0
    updates_per_step = microbatches // update_every
    staleness = (depth - 1) / update_every if rule == "microbatch_staleness" else 0.0
    return 1.0 / math.sqrt(updates_per_step * (1.0 + staleness))
