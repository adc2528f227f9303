"""Adaptive fences: flag a value far above the bulk of the last W accepted values.

The window slides, so the fence follows slow, honest drift (gradients shrink as the loss falls and
the learning rate decays) while a sudden jump stands out. Only accepted values enter the window: a
flagged message never moves the fence (flags are inert). What keeps that from locking a boundary
(every value flagged, so the window never moves again) is the verifier's re-warm-up, not the fence.

Two rules, both parametrized by Tukey's k (1.5 "outside", 3.0 "far out"):

- ``tukey`` (the paper's): Q3 + k·(Q3 − Q1). **Breakdown point 25%**: a sender that supplies a
  quarter of the window can put Q3, and with it the fence, wherever it likes.
- ``mad`` (default): median + (1 + 2k)·MAD, MAD the median absolute deviation from the median. On a
  symmetric distribution Q3 = median + MAD and IQR = 2·MAD, so this is Tukey's fence with the same k;
  but median and MAD both have a **breakdown point of 50%**: an attacker owning a share ε < ½ of the
  window moves them at most to the honest values' quantiles ½/(1−ε) (⅔ at ε = 25%), whatever values
  it supplies. When more than half the window holds one value (MAD = 0, e.g. a sign-flip ratio
  that is mostly 0), the mean absolute deviation stands in, so the fence does not sit on that value.

``calibrate`` is the method note's recipe (open detail 3): at the end of warm-up, raise k until at
most a target share of the window's own (clean) values lies above the fence. Two guards keep an
attacker who supplies part of the warm-up window from choosing the fence: the target quantile is
interpolated (never "the window maximum" because int(target·W) rounded to 0), and k is capped at
``k_max``. So a calibrated fence is at most median + (1 + 2·k_max)·MAD: its breakdown point stays
that of the median and MAD (50% for ``mad``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_VALUES = 8
"""Below this many values the quantiles mean nothing and the fence stays open (threshold = inf)."""
FENCES = ("mad", "tukey")


def _centre_spread(values, rule: str) -> tuple[float, float]:
    """(Q3, IQR) for ``tukey``; (median + MAD, 2·MAD) for ``mad``: the fence is centre + k·spread."""
    data = np.asarray(values, dtype=np.float64)
    if rule == "tukey":
        q1, q3 = np.quantile(data, [0.25, 0.75]).tolist()
        return q3, q3 - q1
    median = float(np.median(data))
    deviations = np.abs(data - median)
    mad = float(np.median(deviations))
    if mad == 0:  # more than half the window on one value (a discrete metric such as the sign-flip
        mad = float(deviations.mean())  # ratio at 0): the mean deviation, so the fence stays open
    return median + mad, 2 * mad


def tukey_threshold(values: list[float], k: float, rule: str = "tukey") -> float:
    """centre + k·spread of ``values`` (Q3 + k·IQR for ``tukey``); inf with too few values."""
    if len(values) < MIN_VALUES:
        return float("inf")
    centre, spread = _centre_spread(values, rule)
    return centre + k * spread


def calibrated_k(values: list[float], k: float, exceedance: float, rule: str = "tukey",
                 k_max: float = float("inf")) -> float:
    """The smallest k' in [k, k_max] with at most ``exceedance`` of ``values`` above the fence.

    The quantile 1 − exceedance is interpolated between order statistics, so a window of 256 and a
    target of 0.25% puts the fence between the two largest values rather than at the maximum."""
    if len(values) < MIN_VALUES:
        return k
    centre, spread = _centre_spread(values, rule)
    if spread <= 0:
        return k
    target = float(np.quantile(np.asarray(values, dtype=np.float64), 1 - exceedance))
    return min(max(k, (target - centre) / spread), max(k, k_max))


class TukeyFence:
    """The sliding window of one metric at one boundary and direction (``rule``: mad or tukey)."""

    def __init__(self, k: float, window: int, rule: str = "tukey", k_max: float = float("inf")):
        self.k = self.k0 = k
        self.rule = rule
        self.k_max = k_max
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)

    def threshold(self) -> float:
        return tukey_threshold(list(self.values), self.k, self.rule)

    def centre(self) -> float:
        """The window's median (what "a typical honest distance" is, for scores relative to the fence)."""
        return float(np.median(np.asarray(self.values))) if self.values else float("nan")

    def calibrate(self, exceedance: float) -> None:
        """Raise k (within [k, k_max]) so that at most ``exceedance`` of the window lies above the fence."""
        self.k = calibrated_k(list(self.values), self.k, exceedance, self.rule, self.k_max)

    def reset(self) -> None:
        """Forget the window and the calibrated k (a re-warm-up refills and recalibrates them)."""
        self.values.clear()
        self.k = self.k0

    def state_dict(self) -> dict:
        return {"values": list(self.values), "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(state["values"])
        self.k = state.get("k", self.k)
