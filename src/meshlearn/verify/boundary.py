"""One boundary, one direction: the reference, the fences, the sanity state and their recovery.

``check`` scores a message against a ``View``: the state as it stood after some closed step (by
default the latest; under the async schedule ``Sentinel`` chooses one per step, see there);
``accept`` queues an accepted message under its step; ``commit(step)`` (at that step's end) folds
that step's queue, and only that step's, into the EMA and windows. Messages of later steps inspected
meanwhile (steps overlap under ``mesh.schedule = async``) stay queued for their own step's end.
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


@dataclass(frozen=True)
class View:
    """What scoring reads, frozen after a closed step: no tensor here is ever changed in place
    (``ema`` and ``combine`` make new ones), so a view costs a few references."""

    reference: Summary | None
    gain_reference: float | None
    thresholds: dict[str, float]
    medians: dict[str, float]
    median_norm: float | None
    rewarming: frozenset[str]
    passing: int | None = None  # the replica whose split passes fence flags on (``capture.py``)


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
        self.reacted_at = -1  # the last step whose end rebased or re-warmed this boundary
        # The reference as it stood after the last step in which no sender was flagged here (the
        # last consensus), and the replica whose fence flags are passed on rather than quarantined
        # (None: nobody's): the fallback when a split between two senders cannot be decided
        # (``capture.py``).
        self.anchor: Summary | None = None
        self.passing: int | None = None
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.median_norm: float | None = None
        self.shape: tuple[int, ...] | None = None
        # Per step (the message's): accepted messages not yet folded in, flagged ones (for a
        # rebase), and (accepted, log gain) of every message with a pair.
        self.pending: dict[int, list[tuple[tuple[int, int], Summary, dict[str, float], float]]] = {}
        self.rejected: dict[int, list[tuple[tuple[int, int], Summary]]] = {}
        self.gains: dict[int, list[tuple[bool, float]]] = {}
        self.off_norms: dict[int, list[float]] = {}  # norms of messages the norm check refused

    def view(self) -> View:
        """The live state, frozen (what ``check`` reads when it is given no view)."""
        return View(self.reference, self.gain_reference, self.thresholds, self.medians,
                    self.median_norm, frozenset(self.rewarming), self.passing)

    def step_summaries(self, step: int) -> dict[int, list[Summary]]:
        """Step ``step``'s queued summaries (accepted and flagged) by sending replica."""
        out: dict[int, list[Summary]] = {}
        for (_, replica), summary in [(o, s) for o, s, _, _ in self.pending.get(step, [])] + \
                self.rejected.get(step, []):
            out.setdefault(replica, []).append(summary)
        return out

    def anchor_score(self, summary: Summary) -> float:
        """How far ``summary`` sits from the anchor, in fence widths (``score``); 0 without one."""
        if self.anchor is None:
            return 0.0
        metrics = [m for m in self.metrics if m not in PAIR_DISTANCES]
        return self.score(message_distances(summary, self.anchor, metrics))

    def summarize(self, values: torch.Tensor) -> Summary:
        if self.directions is None:
            self.directions = swd_directions(values.shape[-1], self.cfg.swd_directions, self.cfg.seed)
        return summarize(values, self.cfg.statistic, self.directions, self.levels)

    def sanity(self, values: torch.Tensor, norm: float, view: View | None = None) -> str:
        """A shape other than the boundary's, non-finite values, or a norm far off the median. The
        shape is a sample's (positions × channels): the number of sequences in a microbatch is the
        receiver's wire guard's to check (it knows the step's layout), and it changes with the rows
        that train a step under elastic membership."""
        median_norm = self.median_norm if view is None else view.median_norm
        if self.shape is not None and tuple(values.shape[1:]) != self.shape[1:]:
            return "shape"
        if not math.isfinite(norm):  # one NaN or inf entry (or an overflowing one) makes the norm so
            return "nonfinite"
        if median_norm is not None:
            ratio = self.cfg.norm_ratio
            if not median_norm / ratio <= norm <= median_norm * ratio:
                return "norm"
        return ""

    def distances(self, summary: Summary, view: View | None = None) -> dict[str, float]:
        """The reference distances (not the pair distances, which need the sender's input)."""
        reference = self.reference if view is None else view.reference
        if reference is None:
            return {}
        return message_distances(summary, reference, [m for m in self.metrics if m not in PAIR_DISTANCES])

    def check(self, values: torch.Tensor, fences_on: bool, received: torch.Tensor | None = None,
              view: View | None = None) -> tuple[Verdict, Summary | None]:
        """Score a message (``received``: what its sender got for the same microbatch, for the pair
        distances) against ``view`` (default: the live state); the summary is None when a sanity
        check failed before it was computed."""
        view = view or self.view()
        norm = values.norm().item()
        sanity = self.sanity(values, norm, view)
        if sanity:
            return Verdict({}, [], sanity, norm), None
        summary = self.summarize(values)
        distances = self.distances(summary, view)
        gain = None
        if received is not None and received.shape == values.shape:
            pairs, gain = pair_distances(received, values, view.gain_reference, self.metrics)
            distances |= pairs
        fired = [m for m, d in distances.items()
                 if fences_on and m not in view.rewarming and d > view.thresholds[m]]
        return Verdict(distances, fired, "", norm, gain), summary

    def score(self, distances: dict[str, float], view: View | None = None) -> float:
        """How far a message sits from its windows' medians towards the fences (0: median, 1: fence),
        the largest over its metrics: what attribution calls "suspect", and what a strike is
        compared with the sender's peers on."""
        thresholds, medians = (self.thresholds, self.medians) if view is None else (view.thresholds,
                                                                                     view.medians)
        scores = [(d - medians[m]) / (thresholds[m] - medians[m])
                  for m, d in distances.items()
                  if math.isfinite(thresholds[m]) and thresholds[m] > medians[m]]
        return max(scores, default=0.0)

    def accept(self, order: tuple[int, int], shape: tuple[int, ...], summary: Summary,
               distances: dict[str, float], norm: float, gain: float | None = None,
               step: int = 0) -> None:
        """Queue an accepted message of ``step`` for that step's ``commit``."""
        if self.shape is None:
            self.shape = shape
        self.pending.setdefault(step, []).append((order, summary, distances, norm))
        if gain is not None:
            self.gains.setdefault(step, []).append((True, gain))

    def reject(self, order: tuple[int, int], summary: Summary | None, gain: float | None = None,
               step: int = 0, off_norm: float | None = None) -> None:
        """A flagged message: kept aside only in case its step's reference (or, ``off_norm``: the
        norm of a message the norm check refused, its norm median) turns out stale."""
        if off_norm is not None:
            self.off_norms.setdefault(step, []).append(off_norm)
        if summary is not None:
            self.rejected.setdefault(step, []).append((order, summary))
        if gain is not None:
            self.gains.setdefault(step, []).append((False, gain))

    def _pop(self, step: int | None) -> tuple[list, list, list]:
        """Step ``step``'s queues, removed (None: every step's, in step order)."""
        steps = sorted(set(self.pending) | set(self.rejected) | set(self.gains)) if step is None else [step]
        out: tuple[list, list, list] = ([], [], [])
        for t in steps:
            out[0].extend(self.pending.pop(t, []))
            out[1].extend(self.rejected.pop(t, []))
            out[2].extend(self.gains.pop(t, []))
            self.off_norms.pop(t, None)
        return out

    def commit(self, step: int | None = None) -> None:
        """Fold step ``step``'s accepted messages (None: all queued) into the reference, windows and
        norm median; other steps' stay queued."""
        pending, _, gains = self._pop(step)
        accepted = sorted(pending, key=lambda p: p[0])
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
        accepted_gains = [g for ok, g in gains if ok]
        if accepted_gains:  # the median of the step's gains, one EMA step of weight β^count
            gain, weight = statistics.median(accepted_gains), self.beta ** len(accepted_gains)
            self.gain_reference = gain if self.gain_reference is None else \
                weight * self.gain_reference + (1 - weight) * gain
        self._close_step()

    def renorm(self, step: int) -> None:
        """The norm check refused a majority of the senders in step ``step``: every norm moved
        together (a regime change: activations that grew a hundredfold), so the median restarts
        from that step's refused norms; its accepted ones join at ``commit``. Without it the median
        never moves again (only accepted norms update it) and the boundary refuses everything for
        good: measured at 2 replicas, a bias attack begun inside the warm-up grew stage 1's
        activations past the ratio and every one of them was dropped for the remaining 72 steps."""
        self.norms.clear()
        self.norms.extend(self.off_norms.pop(step, []))
        self._close_step()

    def rebase(self, step: int | None = None) -> None:
        """Restart the reference from step ``step``'s messages (None: all queued), accepted or
        flagged, combined as in ``reference_update`` (an EMA started afresh would lean on the first
        one and flag the next step again); the windows keep their history (this step's distances
        were measured against a stale reference; if the next step is flagged again, ``rewarm``
        renews them)."""
        pending, rejected, gains = self._pop(step)
        groups: dict[int, list[Summary]] = {}
        for (microbatch, _), summary in [(o, s) for o, s, _, _ in pending] + rejected:
            groups.setdefault(microbatch, []).append(summary)
        robust = any(len(g) >= ROBUST_GROUP for g in groups.values())
        if self.cfg.reference_update == "median" and robust:  # per microbatch, then averaged
            self.reference = combine([combine(g, "median" if len(g) >= ROBUST_GROUP else "mean")
                                      for g in groups.values()], "mean")
        elif groups:
            self.reference = combine([s for g in groups.values() for s in g], "mean")
        if gains:
            self.gain_reference = statistics.median(g for _, g in gains)
        self.norms.extend(norm for _, _, _, norm in pending)
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
        """Recompute what scoring reads (new objects: earlier ``View``s keep theirs)."""
        self.thresholds = {m: self._threshold(m) for m in self.fences}
        self.medians = {m: f.centre() for m, f in self.fences.items()}
        self.median_norm = statistics.median(self.norms) if self.norms else None

    def placeholder(self, shape: tuple[int, ...], view: View | None = None) -> torch.Tensor:
        """The reference broadcast to a message's (b, n, c) shape: what replaces a quarantined one."""
        reference = self.reference if view is None else view.reference
        if reference is None:
            return torch.zeros(shape)
        return reference.mean.expand(shape).contiguous()

    def state_dict(self) -> dict:
        """Everything, including accepted messages not yet folded in (a shadow verifier commits lazily)."""
        return {"reference": None if self.reference is None else dataclasses.asdict(self.reference),
                "gain_reference": self.gain_reference,
                "fences": {m: f.state_dict() for m, f in self.fences.items()},
                "rewarming": dict(self.rewarming), "locked": self.locked, "reacted_at": self.reacted_at,
                "anchor": None if self.anchor is None else dataclasses.asdict(self.anchor),
                "passing": self.passing,
                "norms": list(self.norms), "shape": self.shape,
                "pending": [(order, dataclasses.asdict(summary), distances, norm, step)
                            for step, queue in sorted(self.pending.items())
                            for order, summary, distances, norm in queue],
                "rejected": [(order, dataclasses.asdict(summary), step)
                             for step, queue in sorted(self.rejected.items()) for order, summary in queue],
                "gains": [(ok, gain, step) for step, queue in sorted(self.gains.items())
                          for ok, gain in queue]}

    def load_state_dict(self, state: dict) -> None:
        ref = state["reference"]
        self.reference = None if ref is None else Summary(**ref)
        self.gain_reference = state.get("gain_reference")
        for m, f in self.fences.items():
            f.load_state_dict(state["fences"][m])
        self.rewarming = dict(state.get("rewarming", {}))
        self.locked = state.get("locked", 0)
        self.reacted_at = state.get("reacted_at", -1)
        self.anchor = None if state.get("anchor") is None else Summary(**state["anchor"])
        passing = state.get("passing")  # older states: a bool, for no sender in particular
        self.passing = passing if isinstance(passing, int) and not isinstance(passing, bool) else None
        self.norms.clear()
        self.norms.extend(state["norms"])
        self.shape = None if state["shape"] is None else tuple(state["shape"])
        self.pending, self.rejected, self.gains = {}, {}, {}
        self.commit()  # recompute the frozen thresholds and median from the restored windows
        for order, summary, distances, norm, *step in state["pending"]:  # older states: no step
            self.pending.setdefault(step[0] if step else 0, []).append(
                (tuple(order), Summary(**summary), distances, norm))
        for order, summary, *step in state["rejected"]:
            self.rejected.setdefault(step[0] if step else 0, []).append((tuple(order), Summary(**summary)))
        for ok, gain, *step in state.get("gains", []):
            self.gains.setdefault(step[0] if step else 0, []).append((ok, gain))
