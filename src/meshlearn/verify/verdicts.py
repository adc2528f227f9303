"""A step's verdicts as JSON, so that a verifier in another process can hand them to the workers.

Under ``backend = "dist"`` the trusted verifier process runs ``Sentinel`` (``distributed/verifier.py``)
and, at the end of each step, publishes what ``Sentinel.end_step`` decided plus what only it
knows: the donor of each ban (chosen from its ledger, as ``TrustLayer`` chooses in the simulator),
the wire rejections of its receive guard and its CPU cost so far. ``RemoteSentinel`` is what a
worker process's ``TrustLayer`` holds instead of a ``Sentinel``: its ``end_step`` returns the
published ``StepOutcome``, so scoring, records and bans run through the very code the simulator
uses. Pure: no torch.distributed here; ``fetch`` is the driver's (the rendezvous store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshlearn.compress.wire_checks import Rejection
from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.ledger import Alert, Ban, Decision
from meshlearn.verify.sentinel import StepOutcome


def decision_from_record(record: dict) -> Decision:
    """The inverse of ``Decision.record`` (1-based step back to 0-based; a None fence is open)."""
    return Decision(record["step"] - 1, record["microbatch"], record["message"],
                    WorkerId.parse(record["src"]), WorkerId.parse(record["dst"]), record["action"],
                    record["reason"], dict(record["distances"]),
                    {m: float("inf") if t is None else t for m, t in record["thresholds"].items()},
                    record["explained_by"])


def ban_from_record(record: dict) -> Ban:
    return Ban(WorkerId.parse(record["worker"]), record["step"] - 1, record["metric"], record["boundary"],
               record["message"], record["strikes"])


def alert_from_record(record: dict) -> Alert:
    return Alert(WorkerId.parse(record["worker"]), record["step"] - 1, record["cause"], record["strikes"],
                 record["detail"])


def rejection_from_record(record: dict) -> Rejection:
    return Rejection(record["step"] - 1, record["message"], record["microbatch"],
                     WorkerId.parse(record["src"]), WorkerId.parse(record["dst"]), record["reason"])


def verdict_record(step: int, outcome: StepOutcome, donors: list[WorkerId], rejections: list[Rejection],
                   cost: dict) -> dict:
    """What the verifier publishes for ``step`` (0-based): JSON-ready."""
    return {"step": step, "decisions": [d.record() for d in outcome.decisions],
            "bans": [b.record() | {"donor": str(w)} for b, w in zip(outcome.bans, donors, strict=True)],
            "alerts": [a.record() for a in outcome.alerts], "rebased": outcome.rebased,
            "rewarmed": outcome.rewarmed, "rejections": [r.record() for r in rejections], "cost": cost}


class _Clock:
    """The verifier's CPU cost as last published (``trust.verifier_cost`` in summary.json)."""

    def __init__(self) -> None:
        self.last: dict = {}

    def summary(self) -> dict:
        return dict(self.last)


class RemoteSentinel:
    """The ``Sentinel`` of a worker process: the verifier process's verdicts, fetched per step.

    ``fetch(step)`` returns the published ``verdict_record``; it waits (with a deadline) until the
    verifier has closed the step. The verifier readmits the replacements itself, so ``readmit`` has
    nothing left to do here; each ban's donor comes with the verdict (``donor``).
    """

    def __init__(self, fetch: Callable[[int], dict]):
        self.fetch = fetch
        self.clock = _Clock()
        self.donors: dict[WorkerId, WorkerId] = {}
        self.rejections: list[Rejection] = []  # the verifier's guard's, for the wire plugin

    def end_step(self, step: int) -> StepOutcome:
        record = self.fetch(step)
        self.clock.last = record["cost"]
        bans = [ban_from_record(b) for b in record["bans"]]
        self.donors |= {b.worker: WorkerId.parse(r["donor"])
                        for b, r in zip(bans, record["bans"], strict=True)}
        self.rejections += [rejection_from_record(r) for r in record["rejections"]]
        return StepOutcome([decision_from_record(d) for d in record["decisions"]], bans, record["rebased"],
                           [alert_from_record(a) for a in record["alerts"]], record["rewarmed"])

    def donor(self, wid: WorkerId) -> WorkerId:
        return self.donors[wid]

    def readmit(self, wid: WorkerId) -> None:
        """Done by the verifier when it published the ban."""

    def drained(self, done: int) -> None:
        """Nothing to restart: the flushing schedules the dist verifier supports have no view lag."""

    def pop_rejections(self) -> list[Rejection]:
        rejections, self.rejections = self.rejections, []
        return rejections

    def state_dict(self) -> Any:
        """The verifier's state lives in its own process (a dist run with verification does not
        resume yet, see docs/sentinel.md)."""
        return None
