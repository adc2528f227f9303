"""An adaptive Tukey fence: flag a value above Q3 + k·IQR of the last W accepted values.

The window slides, so the fence follows slow, honest drift (gradients shrink as the loss falls and
the learning rate decays) while a sudden jump stands out. Only accepted values enter the window: a
flagged message never moves the fence (flags are inert).

Tuning: k = 1.5 is Tukey's "outside" fence, 3.0 his "far out" one. SENTINEL ORs four metrics, each
with a right-skewed distribution, so k = 3 keeps the joint false-positive rate low; if a clean run
flags more than ~1% of its messages, raise k (or the window, if the flags cluster right after
warm-up). A larger window reacts more slowly to drift but estimates the quartiles better.

``calibrate`` is the method note's recipe for that (open detail 3): at the end of warm-up, raise k
until the share of the window's own (clean) values above the fence is at most a target. With a
window of 256 and a target of 1% shared by four metrics that means "no warm-up value above the
fence": k = (max − Q3) / IQR when that exceeds the configured k.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_VALUES = 8
"""Below this many values the quartiles mean nothing and the fence stays open (threshold = inf)."""


def tukey_threshold(values: list[float], k: float) -> float:
    """Q3 + k·(Q3 − Q1) of ``values``; inf when there are too few to estimate quartiles."""
    if len(values) < MIN_VALUES:
        return float("inf")
    q1, q3 = np.quantile(np.asarray(values, dtype=np.float64), [0.25, 0.75]).tolist()
    return q3 + k * (q3 - q1)


def calibrated_k(values: list[float], k: float, exceedance: float) -> float:
    """The smallest k' ≥ k with at most ``exceedance`` of ``values`` above Q3 + k'·IQR."""
    if len(values) < MIN_VALUES:
        return k
    data = np.asarray(values, dtype=np.float64)
    q1, q3 = np.quantile(data, [0.25, 0.75]).tolist()
    if q3 <= q1:
        return k
    allowed = int(exceedance * len(data))  # values that may stay above the fence
    kth_largest = np.sort(data)[len(data) - 1 - allowed]
    return max(k, (kth_largest - q3) / (q3 - q1))


class TukeyFence:
    """The sliding window of one metric at one boundary and direction."""

    def __init__(self, k: float, window: int):
        self.k = k
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)

    def threshold(self) -> float:
        return tukey_threshold(list(self.values), self.k)

    def calibrate(self, exceedance: float) -> None:
        """Raise k (never lower it) so that at most ``exceedance`` of the window lies above the fence."""
        self.k = calibrated_k(list(self.values), self.k, exceedance)

    def state_dict(self) -> dict:
        return {"values": list(self.values), "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(state["values"])
        self.k = state.get("k", self.k)
