"""A step's verdicts as JSON, so that a verifier in another process can hand them to the workers.

Under ``backend = "dist"`` the trusted verifier process runs ``Sentinel`` (``distributed/verifier.py``)
and, at the end of each step, publishes what ``Sentinel.end_step`` decided plus what only it
knows: the donor of each ban (chosen from its ledger, as ``TrustLayer`` chooses in the simulator),
the wire rejections of its receive guard and its CPU cost so far. ``RemoteSentinel`` is what a
worker process's ``TrustLayer`` holds instead of a ``Sentinel``: its ``end_step`` returns the
published ``StepOutcome``, so scoring, records and bans run through the very code the simulator
uses. Pure: no torch.distributed here; ``fetch`` is the driver's (the rendezvous store).

Under ``mesh.schedule = async`` a ban decided at step b is carried out at a drain point the
simulator places after step min(next drain ≥ b, b + L) (``TrustLayer.end_step``, L the feed
lookahead). Every worker process must agree on that drain before it feeds past it, long before the
trainer's ``on_step_end(b)`` runs there (an async dist run reports its steps at drain points). So
the driver reads verdicts ahead (``learn_through``) and the trust layer asks ``ban_drain_due``;
the donors come with the verdict of the step the drain follows (``replacements``), chosen by the
verifier as ``TrustLayer.on_drain`` would choose them there.
"""

from __future__ import annotations

from collections.abc import Callable

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
                    record["explained_by"], record.get("delivered", False), record.get("norm", 0.0))


def ban_from_record(record: dict) -> Ban:
    return Ban(WorkerId.parse(record["worker"]), record["step"] - 1, record["metric"], record["boundary"],
               record["message"], record["strikes"])


def alert_from_record(record: dict) -> Alert:
    return Alert(WorkerId.parse(record["worker"]), record["step"] - 1, record["cause"], record["strikes"],
                 record["detail"])


def rejection_from_record(record: dict) -> Rejection:
    return Rejection(record["step"] - 1, record["message"], record["microbatch"],
                     WorkerId.parse(record["src"]), WorkerId.parse(record["dst"]), record["reason"])


def verdict_record(step: int, outcome: StepOutcome, replacements: dict[WorkerId, WorkerId],
                   rejections: list[Rejection], cost: dict) -> dict:
    """What the verifier publishes for ``step`` (0-based): JSON-ready. ``replacements``: banned
    worker → donor, for the slots replaced if the pipeline drains after this step (flushing
    schedules: this step's bans; async: every pending ban)."""
    return {"step": step, "decisions": [d.record() for d in outcome.decisions],
            "bans": [b.record() for b in outcome.bans],
            "replacements": {str(w): str(d) for w, d in replacements.items()},
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
    nothing left to do here; each ban's donor comes with a verdict (``replacements``). ``lag``: the
    verifier's view lag L under async (0: steps do not overlap).
    """

    def __init__(self, fetch: Callable[[int], dict], lag: int = 0,
                 snapshot: Callable[[int], bytes] | None = None,
                 restore: Callable[[bytes], None] | None = None):
        self.fetch = fetch
        self.lag = lag
        # The records' writer only: the verifier's own state at a drain point (``snapshot(done)``),
        # kept in that worker's checkpoint shard, and handed back to it on resume (``restore``).
        self.snapshot = snapshot
        self.restore = restore
        self.clock = _Clock()
        self.donors: dict[WorkerId, WorkerId] = {}
        self.rejections: list[Rejection] = []  # the verifier's guard's, for the wire plugin
        self.records: dict[int, dict] = {}  # fetched ahead of their end_step
        self.learned = -1  # the last step whose verdict was fetched
        self.ban_steps: list[int] = []  # steps with a ban not yet carried out at a drain point
        self.synced = 0  # steps done at the last drain point

    def learn_through(self, step: int) -> None:
        """Fetch the verdicts of every step up to ``step`` (waiting for those not posted yet)."""
        while self.learned < step:
            self.learned += 1
            self.records[self.learned] = record = self.fetch(self.learned)
            if record["bans"]:
                self.ban_steps.append(self.learned)

    def ban_drain_due(self, done: int) -> bool:
        """Async: whether a ban asks for a drain point after ``done`` steps — the simulator's
        ``drain_at`` = min(next drain ≥ b, b + lag) + 1 for a ban at step b: due from b + lag + 1
        on unless a drain point came first (at or after b: the ban was carried out there). Exact
        once the verdicts through ``done − 1 − lag`` are learned."""
        return any(b >= self.synced and b + self.lag + 1 <= done for b in self.ban_steps)

    def end_step(self, step: int) -> StepOutcome:
        if self.lag:  # async: in order, so that every ban reaches ban_drain_due
            self.learn_through(step)
        record = self.records.pop(step) if step in self.records else self.fetch(step)
        self.clock.last = record["cost"]
        bans = [ban_from_record(b) for b in record["bans"]]
        self.donors |= {WorkerId.parse(w): WorkerId.parse(d) for w, d in record["replacements"].items()}
        self.rejections += [rejection_from_record(r) for r in record["rejections"]]
        return StepOutcome([decision_from_record(d) for d in record["decisions"]], bans, record["rebased"],
                           [alert_from_record(a) for a in record["alerts"]], record["rewarmed"])

    def donor(self, wid: WorkerId) -> WorkerId:
        return self.donors[wid]

    def readmit(self, wid: WorkerId) -> None:
        """Done by the verifier when it published the ban."""

    def drained(self, done: int) -> None:
        """A drain point: the bans decided before it were carried out there (the verifier restarts
        its own view lag when the next step's first message arrives)."""
        self.synced = done
        self.ban_steps = [b for b in self.ban_steps if b >= done]

    def pop_rejections(self) -> list[Rejection]:
        rejections, self.rejections = self.rejections, []
        return rejections

    def state_dict(self) -> dict:
        """At a drain point (a checkpoint): how far the verdicts were read, and — in the records'
        writer — the verifier process's whole state there, so that a resumed run goes on exactly."""
        return {"learned": self.learned, "synced": self.synced,
                "verifier": self.snapshot(self.synced) if self.snapshot is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.learned, self.synced = state["learned"], state["synced"]
        if self.restore is not None and state["verifier"] is not None:
            self.restore(state["verifier"])
