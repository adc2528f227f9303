"""Loss spikes, defined once so that the bench, the docs and a reader of metrics.jsonl count the same.

A step t is *above* when its train loss exceeds the exponential moving average of the losses before
it by more than ``delta`` nats: ℓ_t > m_{t−1} + δ, with m_1 = ℓ_1 and m_t = β·m_{t−1} + (1 − β)·ℓ_t.
A **spike** is a maximal run of consecutive above steps (counted once, at its first step). Why this
form: early in training the loss falls fast and the EMA lags *above* it, so the fall never counts; a
per-batch loss is noisy, so δ must sit well above that noise (the bench reports the largest excursion
of every run, so the margin is visible); and an absolute margin in nats reads the same at any loss
level. A run whose loss turns non-finite is *diverged*, reported apart from its spikes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SPIKE_DELTA_NATS = 0.3
"""δ: the margin over the running EMA that makes a step a spike (see the bench's noise numbers)."""
SPIKE_EMA_BETA = 0.9
"""β of the running EMA (a memory of about 10 steps)."""


@dataclass(frozen=True)
class Spikes:
    onsets: list[int]  # 1-based step of each spike's first step
    max_excursion: float  # max over t of ℓ_t − m_{t−1} (nats; can be negative only for 1 step)
    above_steps: int  # steps above the margin, over all spikes

    @property
    def count(self) -> int:
        return len(self.onsets)


def find_spikes(losses: Sequence[float], delta: float = SPIKE_DELTA_NATS,
                beta: float = SPIKE_EMA_BETA) -> Spikes:
    """Spikes of a train-loss curve, ``losses[i]`` being step i + 1's (see the module docstring)."""
    onsets: list[int] = []
    excursion, above, was_above = float("-inf"), 0, False
    ema: float | None = None
    for i, loss in enumerate(losses):
        if ema is not None:
            excursion = max(excursion, loss - ema)
            is_above = loss > ema + delta
            if is_above and not was_above:
                onsets.append(i + 1)
            above += is_above
            was_above = is_above
        ema = loss if ema is None else beta * ema + (1 - beta) * loss
    return Spikes(onsets, excursion if len(losses) > 1 else 0.0, above)
