"""One boundary, one direction: the reference, the fences, the sanity state and their recovery.

``check`` scores a message against the state frozen at the start of the step; ``accept`` queues
an accepted message; ``commit`` (at the step's end) folds the queue into the EMA and windows.
A flagged message is never queued, so flags are inert. What keeps inert flags from locking the
boundary is ``rebase`` (the reference restarts from a step's messages) and ``rewarm`` (the fences
of the metrics that flagged most senders forget their windows, refill them for ``rewarm_steps``
steps with those fences open, and recalibrate): ``Sentinel`` calls them when a strict majority
of senders is flagged in one step, and again in the next (``verify.lock_steps``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from meshlearn.verify.distances import (
    PAIR_DISTANCES,
    Summary,
    ema,
    message_distances,
    pair_distances,
    quantile_levels,
    summarize,
    swd_directions,
)
from meshlearn.verify.fence import TukeyFence
from meshlearn.verify.settings import VerifyConfig

ROBUST_GROUP = 3
"""Summaries of one microbatch needed for the median: with fewer, one bad sender is a "majority"."""
SANITY = ("shape", "nonfinite", "norm")


def combine(summaries: list[Summary], how: str) -> Summary:
    """The element-wise mean or median of several summaries (``median``: robust to a minority)."""
    means, tables = torch.stack([s.mean for s in summaries]), torch.stack([s.table for s in summaries])
    if how == "median":
        return Summary(torch.quantile(means, 0.5, dim=0), torch.quantile(tables, 0.5, dim=0))
    return Summary(means.mean(0), tables.mean(0))


@dataclass
class Verdict:
    distances: dict[str, float]
    fired: list[str]
    sanity: str  # "" when the sanity checks pass
    norm: float
    gain: float | None = None  # log(‖out‖/‖in‖) when the sender's input was available

    def flagged(self, min_metrics: int) -> bool:
        return bool(self.sanity) or len(self.fired) >= min_metrics

    def reason(self, thresholds: dict[str, float]) -> str:
        """The sanity failure, or the fired metrics, the strongest (distance / fence) first."""
        if self.sanity:
            return self.sanity
        ratio = {m: self.distances[m] / max(thresholds[m], 1e-30) for m in self.fired}
        return ",".join(sorted(self.fired, key=lambda m: -ratio[m]))


class BoundaryVerifier:
    """The reference EMA, one fence per metric and the sanity state of one boundary and direction."""

    def __init__(self, cfg: VerifyConfig, beta: float):
        self.cfg = cfg
        self.beta = beta
        self.metrics = cfg.metric_names()
        self.levels = quantile_levels(cfg.swd_quantiles)
        self.directions: torch.Tensor | None = None  # (c, L), made when the channel count is known
        self.reference: Summary | None = None
        self.gain_reference: float | None = None  # EMA of accepted log gains (the ``gain`` metric)
        self.fences = {m: TukeyFence(cfg.fence_k, cfg.window, cfg.fence, cfg.fence_k_max)
                       for m in self.metrics}
        self.thresholds = {m: float("inf") for m in self.metrics}
        self.medians = {m: float("nan") for m in self.metrics}
        self.rewarming: dict[str, int] = {}  # metric → first step its fence applies again
        self.locked = 0  # consecutive steps with a strict majority of senders flagged
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.median_norm: float | None = None
        self.shape: tuple[int, ...] | None = None
        self.pending: list[tuple[tuple[int, int], Summary, dict[str, float], float]] = []
        self.rejected: list[tuple[tuple[int, int], Summary]] = []  # flagged this step, for a rebase
        self.gains: list[tuple[bool, float]] = []  # (accepted, log gain) of this step's messages

    def summarize(self, values: torch.Tensor) -> Summary:
        if self.directions is None:
            self.directions = swd_directions(values.shape[-1], self.cfg.swd_directions, self.cfg.seed)
        return summarize(values, self.cfg.statistic, self.directions, self.levels)

    def sanity(self, values: torch.Tensor, norm: float) -> str:
        """A shape other than the boundary's, non-finite values, or a norm far off the median."""
        if self.shape is not None and tuple(values.shape) != self.shape:
            return "shape"
        if not math.isfinite(norm):  # one NaN or inf entry (or an overflowing one) makes the norm so
            return "nonfinite"
        if self.median_norm is not None:
            ratio = self.cfg.norm_ratio
            if not self.median_norm / ratio <= norm <= self.median_norm * ratio:
                return "norm"
        return ""

    def distances(self, summary: Summary) -> dict[str, float]:
        """The reference distances (not the pair distances, which need the sender's input)."""
        if self.reference is None:
            return {}
        return message_distances(summary, self.reference,
                                 [m for m in self.metrics if m not in PAIR_DISTANCES])

    def check(self, values: torch.Tensor, fences_on: bool,
              received: torch.Tensor | None = None) -> tuple[Verdict, Summary | None]:
        """Score a message (``received``: what its sender got for the same microbatch, for the pair
        distances); the summary is None when a sanity check failed before it was computed."""
        norm = values.norm().item()
        sanity = self.sanity(values, norm)
        if sanity:
            return Verdict({}, [], sanity, norm), None
        summary = self.summarize(values)
        distances = self.distances(summary)
        gain = None
        if received is not None and received.shape == values.shape:
            pairs, gain = pair_distances(received, values, self.gain_reference, self.metrics)
            distances |= pairs
        fired = [m for m, d in distances.items()
                 if fences_on and m not in self.rewarming and d > self.thresholds[m]]
        return Verdict(distances, fired, "", norm, gain), summary

    def score(self, distances: dict[str, float]) -> float:
        """How far a message sits from its windows' medians towards the fences (0: median, 1: fence),
        the largest over its metrics: what attribution calls "suspect", and what a strike is
        compared with the sender's peers on."""
        scores = [(d - self.medians[m]) / (self.thresholds[m] - self.medians[m])
                  for m, d in distances.items()
                  if math.isfinite(self.thresholds[m]) and self.thresholds[m] > self.medians[m]]
        return max(scores, default=0.0)

    def accept(self, order: tuple[int, int], shape: tuple[int, ...], summary: Summary,
               distances: dict[str, float], norm: float, gain: float | None = None) -> None:
        if self.shape is None:
            self.shape = shape
        self.pending.append((order, summary, distances, norm))
        if gain is not None:
            self.gains.append((True, gain))

    def reject(self, order: tuple[int, int], summary: Summary | None, gain: float | None = None) -> None:
        """A flagged message: kept aside only in case this step's reference turns out stale."""
        if summary is not None:
            self.rejected.append((order, summary))
        if gain is not None:
            self.gains.append((False, gain))

    def commit(self) -> None:
        """Fold the step's accepted messages into the reference, windows and norm median."""
        accepted = sorted(self.pending, key=lambda p: p[0])
        for _, _, distances, norm in accepted:
            for m, d in distances.items():
                self.fences[m].add(d)
            self.norms.append(norm)
        by_microbatch: dict[int, list[Summary]] = {}
        for (microbatch, _), summary, _, _ in accepted:
            by_microbatch.setdefault(microbatch, []).append(summary)
        for summaries in by_microbatch.values():
            if self.cfg.reference_update == "median" and len(summaries) >= ROBUST_GROUP:
                median = combine(summaries, "median")
                self.reference = ema(self.reference, median, self.beta ** len(summaries))
            else:
                for summary in summaries:
                    self.reference = ema(self.reference, summary, self.beta)
        accepted_gains = [g for ok, g in self.gains if ok]
        if accepted_gains:  # the median of the step's gains, one EMA step of weight β^count
            gain, weight = statistics.median(accepted_gains), self.beta ** len(accepted_gains)
            self.gain_reference = gain if self.gain_reference is None else \
                weight * self.gain_reference + (1 - weight) * gain
        self._close_step()

    def rebase(self) -> None:
        """Restart the reference from this step's messages, accepted or flagged, combined as in
        ``reference_update`` (an EMA started afresh would lean on the first one and flag the next
        step again); the windows keep their history (this step's distances were measured against a
        stale reference; if the next step is flagged again, ``rewarm`` renews them)."""
        groups: dict[int, list[Summary]] = {}
        for (microbatch, _), summary in [(o, s) for o, s, _, _ in self.pending] + self.rejected:
            groups.setdefault(microbatch, []).append(summary)
        robust = any(len(g) >= ROBUST_GROUP for g in groups.values())
        if self.cfg.reference_update == "median" and robust:  # per microbatch, then averaged
            self.reference = combine([combine(g, "median" if len(g) >= ROBUST_GROUP else "mean")
                                      for g in groups.values()], "mean")
        elif groups:
            self.reference = combine([s for g in groups.values() for s in g], "mean")
        if self.gains:
            self.gain_reference = statistics.median(g for _, g in self.gains)
        self.norms.extend(norm for _, _, _, norm in self.pending)
        self._close_step()

    def rewarm(self, metrics: list[str], until: int) -> None:
        """Forget the windows (and calibrated k) of ``metrics``; their fences stay open until step
        ``until``, while the step's traffic refills them. Called after ``rebase``."""
        for m in metrics:
            self.fences[m].reset()
            self.rewarming[m] = until
        self._close_step()

    def end_rewarm(self, step: int, fpr_target: float) -> list[str]:
        """Close re-warm-ups that end after step ``step``: calibrate and reopen those fences."""
        done = [m for m, until in self.rewarming.items() if until <= step + 1]
        for m in done:
            del self.rewarming[m]
            if fpr_target > 0:
                self.fences[m].calibrate(fpr_target / len(self.fences))
        self._close_step()
        return done

    def calibrate(self, fpr_target: float) -> None:
        """End of warm-up: raise each fence's k so its metric's share of false flags fits the target."""
        for fence in self.fences.values():
            fence.calibrate(fpr_target / len(self.fences))
        self.thresholds = {m: self._threshold(m) for m in self.fences}

    def _threshold(self, metric: str) -> float:
        """The fence; a pair metric's never below ``pair_floor`` (its honest values are tiny and
        heavy-tailed, the attacks it exists for land near 1)."""
        threshold = self.fences[metric].threshold()
        return max(threshold, self.cfg.pair_floor) if metric in PAIR_DISTANCES else threshold

    def _close_step(self) -> None:
        self.pending.clear()
        self.rejected.clear()
        self.gains.clear()
        self.thresholds = {m: self._threshold(m) for m in self.fences}
        self.medians = {m: f.centre() for m, f in self.fences.items()}
        self.median_norm = statistics.median(self.norms) if self.norms else None

    def placeholder(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The reference broadcast to a message's (b, n, c) shape: what replaces a quarantined one."""
        if self.reference is None:
            return torch.zeros(shape)
        return self.reference.mean.expand(shape).contiguous()

    def state_dict(self) -> dict:
        """Everything, including accepted messages not yet folded in (a shadow verifier commits lazily)."""
        return {"reference": None if self.reference is None else dataclasses.asdict(self.reference),
                "gain_reference": self.gain_reference,
                "fences": {m: f.state_dict() for m, f in self.fences.items()},
                "rewarming": dict(self.rewarming), "locked": self.locked,
                "norms": list(self.norms), "shape": self.shape,
                "pending": [(order, dataclasses.asdict(summary), distances, norm)
                            for order, summary, distances, norm in self.pending],
                "rejected": [(order, dataclasses.asdict(summary)) for order, summary in self.rejected],
                "gains": list(self.gains)}

    def load_state_dict(self, state: dict) -> None:
        ref = state["reference"]
        self.reference = None if ref is None else Summary(**ref)
        self.gain_reference = state.get("gain_reference")
        for m, f in self.fences.items():
            f.load_state_dict(state["fences"][m])
        self.rewarming = dict(state.get("rewarming", {}))
        self.locked = state.get("locked", 0)
        self.norms.clear()
        self.norms.extend(state["norms"])
        self.shape = None if state["shape"] is None else tuple(state["shape"])
        self.pending, self.gains = [], []
        self.commit()  # recompute the frozen thresholds and median from the restored windows
        self.pending = [(tuple(order), Summary(**summary), distances, norm)
                        for order, summary, distances, norm in state["pending"]]
        self.rejected = [(tuple(order), Summary(**summary)) for order, summary in state["rejected"]]
        self.gains = [tuple(g) for g in state.get("gains", [])]
