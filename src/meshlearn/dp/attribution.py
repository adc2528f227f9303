"""Attribution on the data-parallel axis (issue 32): name the replica that is repeatedly the outlier.

A robust rule (``dp.robust``) bounds what a minority of contributions can do to a stage's
aggregate; it does not say who sent them. Every robust reduce also scores each replica's row
(``dp/robust.outlier_scores``: its distance to the aggregate over the median replica's), from the
same stacked tensor on every replica, so every replica, and the simulator and the dist driver,
hold the same scores bit for bit: the built-in all-reduce's gradients, and every message
strategy's round (a sparse slice, PowerSGD's P and Q factors, a DiLoCo pseudo-gradient or its
factors), whose score is reported with the update that merges the round (``DPStrategy.note_score``;
a step's score is the largest of its rounds'). The drivers report them per step (``StepReport.dp_scores``);
this callback marks a score above ``dp.outlier_score`` an outlier and reports a replica marked in
``COUNT`` of its last ``WINDOW`` scored steps: one ``dp_outlier`` record in metrics.jsonl (a
console line of its own) and its marks in summary.json's ``dp_outliers``.

A report is then a ban request to the trust layer (``TrustLayer.evict``): SENTINEL's ledger rules
decide it (never a stage assumed honest, ``verify.trusted_ends``; at most a strict minority of a
stage's replicas banned over the run, SENTINEL's bans and DP evictions counted together), and the
ban is carried out the same way, at the same step in every process (they all see the same
report): a fresh peer takes the slot with the state of the stage's replica least marked in its
window, and its window restarts.
A strategy whose rounds run behind the updates (sparse ``delay`` > 0, DiLoCo ``overlap`` > 0) is
never at a drain point at a step's end, where a donor's state is taken: there a report is a
report only (``dp/settings.evicts_dp_outliers``).

One honest mark is noise (a replica with an unusual microbatch: on the demo the honest marks came
in a burst during warm-up, docs/dp_robust.md); a ×−4 attacker, left in place (``verify.ban =
false``), was marked at all 100 of its attacked steps there. Requiring 3 marks of the last 8
(constants: the threshold is the one knob, ``dp.outlier_score``) lets an isolated honest mark, or
two, pass unreported, and still names an attacker that is on (and marked) in only 3 of every 8
steps (``attack.period``/``duty``).

At D = 2 there is no majority: nothing is scored (config refuses a robust rule there) and the
budget is 0 bans, so nothing is evicted. Flushing schedules only (``scores_dp_outliers``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from meshlearn.dp.settings import scores_dp_outliers
from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.plugin import TrustCallback
from meshlearn.verify.trust import TrustLayer

WINDOW = 8
"""The scored steps (updates under a flushing schedule) over which a replica's marks are counted."""
COUNT = 3
"""Marks within ``WINDOW`` that report a replica."""


class OutlierLedger:
    """Per worker: its marks in the last ``WINDOW`` scored steps, its marks in all, and whether it
    was reported (once per run: the record names it; later marks only count)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.recent: dict[str, deque[bool]] = {}
        self.marks: dict[str, int] = {}
        self.scored = 0  # (worker, step) scores seen: the denominator of a false-positive rate
        self.reported: dict[str, int] = {}  # worker → the 1-based step it was reported at

    def observe(self, step: int, scores: dict[str, float]) -> list[dict]:
        """Take step ``step``'s (0-based) scores; return the ``dp_outlier`` records it causes."""
        records = []
        for worker in sorted(scores, key=WorkerId.parse):
            score = scores[worker]
            self.scored += 1
            marked = score > self.threshold
            window = self.recent.setdefault(worker, deque(maxlen=WINDOW))
            window.append(marked)
            if not marked:
                continue
            self.marks[worker] = self.marks.get(worker, 0) + 1
            count = sum(window)
            if count >= COUNT and worker not in self.reported:
                self.reported[worker] = step + 1
                records.append({"kind": "dp_outlier", "step": step + 1, "worker": worker,
                                "stage": WorkerId.parse(worker).stage, "score": json_score(score),
                                "count": count})
        return records

    def donor(self, worker: str, replicas: list[str]) -> str:
        """The replica among ``replicas`` (``worker``'s stage) that was marked least in its window,
        the lowest replica on a tie: whose state replaces an evicted ``worker``. Every process
        holds the same windows, so every one (and the simulator) picks the same."""
        peers = [w for w in replicas if w != worker]
        return min(peers, key=lambda w: (sum(self.recent.get(w, ())), WorkerId.parse(w).replica))

    def readmit(self, worker: str) -> None:
        """A fresh peer took the evicted slot: its window restarts (a slot is reported once)."""
        self.recent.pop(worker, None)

    def state_dict(self) -> dict:
        return {"recent": {w: list(d) for w, d in self.recent.items()}, "marks": dict(self.marks),
                "scored": self.scored, "reported": dict(self.reported)}

    def load_state_dict(self, state: dict) -> None:
        self.recent = {w: deque(d, maxlen=WINDOW) for w, d in state["recent"].items()}
        self.marks, self.scored = dict(state["marks"]), state["scored"]
        self.reported = dict(state["reported"])


def json_score(score: float) -> float | None:
    """A score as metrics.jsonl holds it: a non-finite contribution scores ∞, which JSON cannot
    hold (Python would write ``Infinity``), so it is written as null."""
    return score if math.isfinite(score) else None


class AttributionCallback(Callback):
    """The trainer's side: feeds each step's scores to the ledger and each report to the trust
    layer (``trust``; None: nothing evicts, e.g. ``verify.ban = false``); every process runs it on
    the same report, the writer logs its records."""

    def __init__(self, threshold: float, trust: TrustLayer | None):
        self.ledger = OutlierLedger(threshold)
        self.trust = trust

    def on_step_end(self, step: int, report: Any) -> StepOutput:
        scores = report.dp_scores
        records = []
        for record in self.ledger.observe(step, scores):
            records.append(record)
            record["evicted"] = False
            if self.trust is None:
                continue
            wid = WorkerId.parse(record["worker"])
            replicas = [str(w) for w in self.trust.mesh.stage_replicas(wid.stage)]
            donor = WorkerId.parse(self.ledger.donor(record["worker"], replicas))
            record["evicted"], events = self.trust.evict(wid, step, record["count"], donor)
            records += events
            if record["evicted"]:
                self.ledger.readmit(record["worker"])
        if self.trust is not None:
            self.trust.announce(step, [r for r in records if r["kind"] == "ban"])
        if not scores:
            return StepOutput()
        return StepOutput(fields={"dp_score_max": json_score(max(scores.values()))}, records=records)

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)

    def summary(self) -> dict:
        ledger = self.ledger
        return {"dp_outliers": dict(sorted(ledger.marks.items())), "dp_outlier_reports": ledger.reported,
                "dp_scored": ledger.scored}


def attribution_plugin(ctx: PluginContext) -> Callback | None:
    """On with a robust rule (``dp.robust``), which is what scores the contributions, under a
    flushing schedule. Off under ``async``: an update there reduces ``update_every`` microbatches,
    not a step's, and a step's score is the largest of its updates', so honest scores run higher;
    uncalibrated, it reported an honest replica in a clean 8-step run of the tests' tiny model.
    Evicts through the trust plugin, registered before it (absent: reports only)."""
    if not scores_dp_outliers(ctx.cfg):
        return None
    trust = ctx.callbacks.get("trust")
    evicts = isinstance(trust, TrustCallback) and trust.trust.dp_evictions
    return AttributionCallback(ctx.cfg.dp.outlier_score, trust.trust if evicts else None)
