"""Robust aggregation of one stage's D contributions (``dp.robust``; docs/dp_robust.md).

Why: every DP strategy averages whatever each replica sends, so one replica that sends c·g with
c = −4, or a slowly growing bias, steers its whole stage (issue 32). A robust rule replaces the
mean by an estimate that a minority of arbitrary contributions cannot move far:

- ``none``: the mean, Σ in replica order then ÷ D (the exact expression of every strategy before).
- ``trimmed_mean``: per coordinate, drop the ``b = dp.trim`` largest and ``b`` smallest values and
  average the D − 2b left (Yin et al. 2018); it tolerates up to b outliers and needs D > 2b
  (b = 1: D = 3 keeps the middle value, D = 4 the middle two).
- ``median``: per coordinate, the median (the mean of the two middle values for even D; Yin et al.
  2018). D = 3, 4 give the same values as ``trimmed_mean``.
- ``centered_clip``: start from the coordinate median v, then ``CLIP_ITERS`` times
  v ← v + (1/D)·Σ clip_τ(x_i − v) with clip_τ(z) = z·min(1, τ/‖z‖) (Karimireddy et al. 2021).
  τ is the median of the D distances ‖x_i − v₀‖ from the starting point, so no gradient scale has
  to be configured: honest contributions near the middle pass whole, an outlier moves v by at most
  τ/D per iteration. Stateless (the paper centers on the previous aggregate; a stage has none that
  every strategy shares), so one round's result depends on that round's contributions only.

Every rule is computed from the same stacked (D, N) tensor in replica order with the same torch
expressions, so each replica of a stage gets the same bits (and the simulator the dist driver's).
With D = 2 there is no majority: every rule is the mean of the two (a median of two is their mean;
nothing can be attributed), which ``validate_robust`` says by refusing a robust rule at D < 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlearn.dp.settings import ROBUST_RULES as RULES

CLIP_ITERS = 3
"""centered_clip's iterations; Karimireddy et al. show one already suffices from a good start."""


@dataclass(frozen=True)
class Robust:
    """A stage's aggregation rule (``dp.robust``, ``dp.trim``), held by its DP strategy."""

    rule: str = "none"
    trim: int = 1

    @property
    def gathers(self) -> bool:
        """Whether the rule needs every contribution whole: no ring all-reduce can compute it, so
        each member sends its tensor to the D − 1 others (an all-gather)."""
        return self.rule != "none"

    def reduce(self, parts: torch.Tensor) -> torch.Tensor:
        """The aggregate of ``parts`` (D × N, rows in replica order)."""
        return aggregate(parts, self.rule, self.trim)

    def reduce_scored(self, parts: torch.Tensor) -> tuple[torch.Tensor, list[float] | None]:
        """The aggregate of ``parts`` and, under a robust rule, each row's ``outlier_scores``
        (None under the mean: nothing is attributed without a majority rule)."""
        out = self.reduce(parts)
        return out, outlier_scores(parts, out).tolist() if self.gathers else None


def aggregate(parts: torch.Tensor, rule: str, trim: int = 1) -> torch.Tensor:
    """The rule's aggregate of ``parts`` (D × N, rows in replica order) as an N-vector; ``trim``:
    trimmed_mean's b."""
    d = parts.shape[0]
    if rule == "none" or d == 1:
        return parts.sum(0) / d
    if rule == "trimmed_mean":
        b = min(trim, (d - 1) // 2)  # config keeps 2·trim < D; D = 2 leaves the mean
        return parts.sort(0).values[b:d - b].sum(0) / (d - 2 * b)
    if rule == "median":
        return coordinate_median(parts)
    if rule == "centered_clip":
        return centered_clip(parts)
    raise ValueError(f"dp.robust = {rule!r}: allowed: {list(RULES)}")


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the middle value (even D: the mean of the two middle values)."""
    d = parts.shape[0]
    ordered = parts.sort(0).values
    if d % 2:
        return ordered[d // 2].clone()
    return (ordered[d // 2 - 1] + ordered[d // 2]) / 2


def centered_clip(parts: torch.Tensor) -> torch.Tensor:
    """Centered clipping from the coordinate median with τ = the median distance to it.

    A contribution with a non-finite value has no distance to clip by (∞·0 and NaN would spread
    to every replica's aggregate): its row is replaced by the median, so it pulls the aggregate
    nowhere, and it counts as the farthest for τ."""
    v = coordinate_median(parts)
    finite = parts.isfinite().all(dim=1, keepdim=True)
    parts = torch.where(finite, parts, v)
    tau = torch.where(finite.squeeze(1), (parts - v).norm(dim=1), torch.inf).median()
    if tau == 0:
        return v  # a majority agrees exactly with the start: it is the aggregate
    for _ in range(CLIP_ITERS):
        diff = parts - v
        norms = diff.norm(dim=1, keepdim=True)
        scale = torch.where(norms > tau, tau / norms.clamp_min(torch.finfo(parts.dtype).tiny),
                            torch.ones_like(norms))
        v = v + (diff * scale).sum(0) / parts.shape[0]
    return v



def outlier_scores(parts: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """Each row's distance to ``center`` (the stage's aggregate) divided by the median of the D
    distances (even D: the mean of the two middle ones), as float64.

    Why this score: it is scale-free. A stage's gradient norm changes by orders of magnitude
    between stages, over warm-up and as the loss falls, so no absolute distance can be one
    threshold for a whole run; honest replicas draw from the same distribution, so each is about
    as far from the aggregate as the median replica (score ≈ 1), while a minority's contribution
    (×−4, a bias) lies several times farther. The median, not the mean, of the distances is the
    unit so that the outlier cannot inflate it (a strict minority never reaches the middle).
    A row with a non-finite value scores ∞; rows with distance 0 score 0 (also when the median
    distance is 0: a majority agrees exactly, and any other row is then ∞ away)."""
    finite = parts.isfinite().all(dim=1)
    center = center.to(torch.float64)
    dist = torch.where(finite, (parts.to(torch.float64) - center).norm(dim=1), torch.inf)
    unit = coordinate_median(dist.unsqueeze(1)).squeeze(0)
    score = torch.where(dist == 0, 0.0, dist / unit)
    return torch.where(score.isnan(), torch.inf, score)  # ∞/∞: a majority non-finite
