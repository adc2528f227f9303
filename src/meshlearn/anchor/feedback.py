"""The fast worker's side of ``anchor.use = error_feedback``: its kept gradients, sized by the config.

One builder for every place that builds a fast worker (the trainer's assembly, which the dist
runtime shares, and the planner's cost-only workers), so that a share reaching
``SpectralCorrection.receive_correction`` always finds the feedback it feeds.
"""

from __future__ import annotations

from typing import Any

from meshlearn.anchor.settings import anchor_targets
from meshlearn.optim.error_feedback import AnchorErrorFeedback
from meshlearn.optim.spectral import SpectralCorrection


def attach_feedback(spectral: SpectralCorrection, cfg: Any) -> None:
    """Under ``anchor.use = error_feedback`` give ``spectral`` its feedback: the matrices the anchor
    sends, kept for the steps it is handed (multiples of K) for at most K + max_late steps (by
    then their share is dropped as late). Nothing otherwise."""
    if cfg.anchor.z == 0 or cfg.anchor.use != "error_feedback":
        return
    wanted = set(anchor_targets(cfg))
    params = {n: p for n, p in spectral.params.items() if n.split(".")[-2] in wanted}
    spectral.feedback = AnchorErrorFeedback(params, every=cfg.anchor.delay,
                                            horizon=cfg.anchor.delay + cfg.anchor.max_late)
