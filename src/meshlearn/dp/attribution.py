"""Attribution on the data-parallel axis (issue 32): name the replica that is repeatedly the outlier.

A robust rule (``dp.robust``) bounds what a minority of contributions can do to a stage's
aggregate; it does not say who sent them. Every robust reduce also scores each replica's row
(``dp/robust.outlier_scores``: its distance to the aggregate over the median replica's), from the
same stacked tensor on every replica, so every replica, and the simulator and the dist driver,
hold the same scores bit for bit: the built-in all-reduce's gradients, and every message
strategy's round (a sparse slice, PowerSGD's P and Q factors, a DiLoCo pseudo-gradient or its
factors), whose score is reported with the update that merges the round (``DPStrategy.note_score``;
an update's score is the largest of its rounds'). The drivers report them per step, each
worker's per update (``StepReport.dp_scores``), each the median of what its stage's rows say
(``mesh/report.voted_scores``: every row carries its stage's scores, so under dist a worker's
own row cannot hide or raise its score); this callback marks an update's score above
``dp.outlier_score`` an outlier and reports a replica marked in ``COUNT``·K of its last
``WINDOW``·K scored updates, K the updates per step (1 under a flushing schedule): one
``dp_outlier`` record in metrics.jsonl (a console line of its own) and its marks in
summary.json's ``dp_outliers``.

Why per update, and why K: under a flushing schedule a step is one update (K = 1: 3 of the last 8
steps). Under ``async`` a step holds K = M / ``update_every`` updates, each reducing fewer
microbatches, and an honest replica's score spikes in one of them now and then (an unusual
microbatch, often the same row in every stage at once: on the tests' tiny model up to 25× the
median distance). With a step's score the largest of its updates' (as before), a step was K
chances of a mark; and 3 marks in 8 updates is a window of 8/K steps that an isolated burst
fills. Counting 3·K marks in the last 8·K updates keeps the rule's meaning in steps (a window of
8 steps, 3/8 of its updates marked): on a small model, 24 async steps, 5 seeds clean and 5 with
a ×−4 attacker, under each of centered clipping and the median, it reported every attacker and
no honest replica, where a step's largest score reported 29 honest replicas and 3 marks of the
last 8 updates 16 (``bench/async_attribution.py``, docs/dp_robust.md "Attribution under async").

A report is then a ban request to the trust layer (``TrustLayer.evict``): SENTINEL's ledger rules
decide it (never a stage assumed honest, ``verify.trusted_ends``; at most a strict minority of a
stage's replicas banned over the run, SENTINEL's bans and DP evictions counted together), and the
ban is carried out the same way, at the same step in every process (they all see the same
report): a fresh peer takes the slot with the state of the stage's replica least marked in its
window, and its window restarts.
A strategy whose rounds run behind the updates (sparse ``delay`` > 0, DiLoCo ``overlap`` > 0) is
never at a drain point at a step's end, where a donor's state is taken: there a report is a
report only (``dp/settings.evicts_dp_outliers``), as under ``async``.

One honest mark is noise (a replica with an unusual microbatch: on the demo the honest marks came
in a burst during warm-up, docs/dp_robust.md); a ×−4 attacker, left in place (``verify.ban =
false``), was marked at all 100 of its attacked steps there. Requiring 3 marks of the last 8
(constants: the threshold is the one knob, ``dp.outlier_score``) lets an isolated honest mark, or
two, pass unreported, and still names an attacker that is on (and marked) in only 3 of every 8
steps (``attack.period``/``duty``).

At D = 2 there is no majority: nothing is scored (config refuses a robust rule there) and the
budget is 0 bans, so nothing is evicted.
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
"""The scored updates (steps under a flushing schedule) over which a replica's marks are counted;
× the updates per step under ``async``."""
COUNT = 3
"""Marks within ``WINDOW`` that report a replica (× the updates per step under ``async``)."""


class OutlierLedger:
    """Per worker: its marks in the last ``window`` scored updates, its marks in all, and whether it
    was reported (once per run: the record names it; later marks only count). ``per_step``: the
    updates a step holds (K): the window is ``WINDOW``·K updates, ``COUNT``·K marks report."""

    def __init__(self, threshold: float, per_step: int = 1):
        self.threshold = threshold
        self.window, self.count = WINDOW * per_step, COUNT * per_step
        self.recent: dict[str, deque[bool]] = {}
        self.marks: dict[str, int] = {}
        self.scored = 0  # (worker, step) scores seen: the denominator of a false-positive rate
        self.reported: dict[str, int] = {}  # worker → the 1-based step it was reported at

    def observe(self, step: int, scores: dict[str, list[float]]) -> list[dict]:
        """Take step ``step``'s (0-based) scores, each worker's per update in update order;
        return the ``dp_outlier`` records they cause (a worker is reported at most once)."""
        records = []
        for worker in sorted(scores, key=WorkerId.parse):
            for score in scores[worker]:
                record = self._update(step, worker, score)
                if record is not None:
                    records.append(record)
        return records

    def _update(self, step: int, worker: str, score: float) -> dict | None:
        """One update's score of ``worker``: marked above the threshold, reported at ``count``
        marks within its last ``window`` updates (the record), once."""
        self.scored += 1
        marked = score > self.threshold
        window = self.recent.setdefault(worker, deque(maxlen=self.window))
        window.append(marked)
        if not marked:
            return None
        self.marks[worker] = self.marks.get(worker, 0) + 1
        count = sum(window)
        if count < self.count or worker in self.reported:
            return None
        self.reported[worker] = step + 1
        return {"kind": "dp_outlier", "step": step + 1, "worker": worker,
                "stage": WorkerId.parse(worker).stage, "score": json_score(score), "count": count}

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
        self.recent = {w: deque(d, maxlen=self.window) for w, d in state["recent"].items()}
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

    def __init__(self, threshold: float, trust: TrustLayer | None, per_step: int = 1):
        self.ledger = OutlierLedger(threshold, per_step)
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
        return StepOutput(fields={"dp_score_max": json_score(max(max(s) for s in scores.values()))},
                          records=records)

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)

    def summary(self) -> dict:
        ledger = self.ledger
        return {"dp_outliers": dict(sorted(ledger.marks.items())), "dp_outlier_reports": ledger.reported,
                "dp_scored": ledger.scored}


def attribution_plugin(ctx: PluginContext) -> Callback | None:
    """On with a robust rule (``dp.robust``), which is what scores the contributions, under every
    schedule (marks counted per update). Evicts through the trust plugin, registered before it
    (absent: reports only)."""
    if not scores_dp_outliers(ctx.cfg):
        return None
    trust = ctx.callbacks.get("trust")
    evicts = isinstance(trust, TrustCallback) and trust.trust.dp_evictions
    mesh = ctx.cfg.mesh
    per_step = mesh.microbatches // mesh.update_every if mesh.schedule == "async" else 1
    return AttributionCallback(ctx.cfg.dp.outlier_score, trust.trust if evicts else None, per_step)
