"""Per-stage β1 and learning-rate scale for the No-WS asynchronous pipeline (no weight stashing).

Without stashing, stage s runs its backward pass at whatever weights are current, so its gradient
is τ_s = P−1−s updates stale *and* taken at the wrong point. The AsyncPP code (its SWARM
experiments, and ``--adaptive_momentum`` / ``--lr_correction`` of the official runtime) compensates
per stage, with two pure rules computed here:

* **Momentum grows with the delay**: β1,s = β1_min + τ_s(β1_max − β1_min)/P, so the last stage
  (τ = 0) gets 0.9 and the first stage 0.9 + 0.09(P−1)/P (0.9675 at P = 4), nearing 0.99 — the
  look-ahead value that corrects staleness — in deep pipelines.
* **Earlier stages take smaller steps at first** (PipeMare's learning-rate rescheduling):
  lr_s = lr / max(τ_s, 1)^(1 − min(progress/E, 1)). The division fades out linearly in the exponent
  and is gone once ``progress`` reaches E. ``max(τ_s, 1)`` guards the last stage, whose τ = 0 would
  otherwise divide by zero (the reference code skips the correction when τ = 0, the same thing).

The method paper's own No-WS rate ("Eq. 13") is unknown; this is the PipeMare-style form its code
offers (method note, open detail 6). The scale multiplies the scheduled lr (warm-up, cosine) as in
the reference, where ``adjust_learning_rate`` applies it after the schedule.
"""

from __future__ import annotations

from typing import NamedTuple


class StageHparams(NamedTuple):
    """What :func:`no_ws_stage_hparams` returns: unpack as ``beta1, lr_scale = ...``."""

    beta1: float
    """The stage's first-moment decay (NAdamW's β1)."""
    lr_scale: float
    """Factor in (0, 1] on the scheduled learning rate."""


def stage_delay(stage: int, stages: int) -> int:
    """τ_s = P−1−s: stage s runs P−1−s warm-up forwards before its first backward, so its gradients
    are that many updates old; the last stage is never stale."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) for stages = {stages}, got {stage}")
    return stages - 1 - stage


def no_ws_stage_hparams(
    stage: int,
    stages: int,
    progress: float,
    anneal: float,
    *,
    beta1_min: float = 0.9,
    beta1_max: float = 0.99,
    delay: int | None = None,
) -> StageHparams:
    """β1 and lr scale of pipeline stage ``stage`` of ``stages`` in the No-WS variant.

    Args:
        stage: s, from 0 (the first stage, most stale) to ``stages − 1`` (never stale).
        stages: P, the pipeline depth.
        progress: how far training is, in the same unit as ``anneal``. With the config key
            ``optim.no_ws_lr_anneal`` (a fraction of ``train.steps``) pass
            ``step / train.steps``, where ``step`` counts optimizer steps taken including this one
            (1 for the first), as the reference does.
        anneal: E, where the lr reduction ends; 0 turns it off (scale 1 throughout).
        beta1_min, beta1_max: β1 of a stage with τ = 0, and the value β1 approaches as τ/P → 1
            (0.9 and 0.99 in the reference); β1 never exceeds ``beta1_max``.
        delay: the stage's actual delay τ_s when its in-flight depth is not 1F1B's (``mesh.in_flight``:
            depth − 1); None = P − 1 − s.
    """
    if progress < 0 or anneal < 0:
        raise ValueError(f"progress and anneal must be >= 0, got progress={progress}, anneal={anneal}")
    tau = stage_delay(stage, stages) if delay is None else delay
    if tau < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    beta1 = min(beta1_max, beta1_min + tau * (beta1_max - beta1_min) / stages)
    exponent = 1.0 - min(progress / anneal, 1.0) if anneal > 0 else 0.0
    return StageHparams(beta1=beta1, lr_scale=max(tau, 1) ** -exponent)
