"""The feeding policy: which steps' work a runtime hands its workers, and what a step's end owes a
drain point, written once, sans-IO.

Every runtime used to restate the same rule: feed the workers every step up to the next drain point,
or a lookahead that covers the deepest stage's in-flight window under ``async`` (none under a
flushing schedule, so every step's end stays a possible drain point for a stop request,
train/signals.py); never let a forward of a later step start (the horizon); at a drain point let a
DP strategy's background rounds land or miss their deadline before weights count as settled; and,
where a step's report needs every process's rows but nothing gathers them per step (a real
``async`` run), report the pending steps at the drain point. Here that rule is decided once, as
explicit actions; the simulator, the dist and the elastic runtimes only execute them (hand the work
over and post its receives, run the background events or receives, gather the rows).

Before feeding step t (``Feeding.before_feed``), a runtime whose drain points depend on a verifier's
verdicts (dist, ``async``, SENTINEL: a ban at step b drains after b + lookahead) learns them:

    LearnVerdicts(through)      the verdicts through step ``through`` must be known

then it asks its work source for the next drain point and feeds (``Feeding.feed(t, drain)``):

    Feed(step)                  hand step ``step``'s work to the workers (and post its receives)
    Horizon(microbatch)         no forward of a microbatch ≥ this may start

At step t's end the same runtime first learns the verdicts through t − lookahead
(``Feeding.before_end``: a ban among them asks for a drain after t), then, only where something
depends on the answer (``Feeding.asks_at_end``: background rounds still open, or reports pending),
asks the next drain point once more, and executes ``Feeding.step_end(t, drain)``, in order:

    Settle                      a drain point: background DP rounds land or are dropped
    Report(first, last)         the steps whose reports are complete now (every step's own under
                                the simulator and a flushing schedule; a real async run's pending
                                steps at the drain point, none between)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlearn.mesh.schedule import feed_lookahead
from meshlearn.mesh.topology import WorkerId

if TYPE_CHECKING:
    from meshlearn.mesh.worker import StepWork, Worker


@dataclass(frozen=True)
class LearnVerdicts:
    """The verifier's verdicts through step ``through`` must be known (they may ask for a drain)."""

    through: int


@dataclass(frozen=True)
class Feed:
    """Hand step ``step``'s work to the workers; a real runtime posts its receives with it."""

    step: int


@dataclass(frozen=True)
class Horizon:
    """No forward of a microbatch (global id, ``t · M + m``) ≥ ``microbatch`` may start."""

    microbatch: int


@dataclass(frozen=True)
class Settle:
    """A drain point: the DP strategy's rounds still open land or miss their deadline (then
    dropped) before the weights count as settled; they cost the step no time."""


@dataclass(frozen=True)
class Report:
    """Steps ``first`` .. ``last`` (inclusive) have complete reports now."""

    first: int
    last: int


FeedAction = LearnVerdicts | Feed | Horizon
StepEndAction = Settle | Report


@dataclass(frozen=True)
class FeedPolicy:
    """How far a runtime feeds. ``lookahead``: the mesh's rule (``feed_lookahead``), one number in
    every process (the trainer's stop rule and the verifier's lag read it as ``Driver.lookahead``);
    ``ahead``: how far this process feeds (the lookahead, or less where verdicts must be known
    first); ``verdicts``: drain points depend on a verifier's verdicts lagging by the lookahead;
    ``reports_at_drain``: reports need every process's rows and only a drain point gathers them."""

    microbatches: int
    lookahead: int
    ahead: int
    verdicts: bool = False
    reports_at_drain: bool = False


def feed_policy(microbatches: int, flushes: bool, deepest_in_flight: int, own_in_flight: int | None = None,
                verdicts: bool = False, gathers_per_step: bool = True) -> FeedPolicy:
    """The policy of a runtime. ``deepest_in_flight``: the deepest stage's in-flight window (the
    mesh's, so every process feeds equally far ahead); ``own_in_flight``: this process's stage's.

    With a verifier under ``async`` (``verdicts``) a ban at step b drains the pipeline after step
    b + L (L = the lookahead), so feeding up to step f needs the verdicts through f − 1 − L. A stage
    then feeds only as far as its own plan can reach before the running step ends (its own depth),
    so its order stays the simulator's, and the verdicts it needs are already posted, or nearly:
    stage 0 forwards step u only after it finished step u − L, every later stage only after stage 0
    did. ``gathers_per_step``: the step's report comes with it (the simulator; a flushing
    schedule's gather); False: a real async run's rows wait for the drain point."""
    lookahead = feed_lookahead(deepest_in_flight, microbatches, flushes)
    verified = verdicts and not flushes
    ahead = math.ceil(own_in_flight / microbatches) if verified and own_in_flight is not None else lookahead
    return FeedPolicy(microbatches, lookahead, ahead, verified, not flushes and not gathers_per_step)


class Feeding:
    """One process's feeding state: ``fed``, the last step whose work its workers have (-1 before
    any; at a drain point, the last step applied), and the first step whose report is pending."""

    def __init__(self, policy: FeedPolicy, fed: int = -1):
        self.policy = policy
        self.fed = fed
        self.pending_from: int | None = None

    def resume(self, fed: int) -> None:
        """At a checkpoint's drain point: exactly the steps through ``fed`` were fed and applied."""
        self.fed = fed
        self.pending_from = None

    def before_feed(self, step: int) -> list[LearnVerdicts]:
        """What must be known before the work source is asked where step ``step``'s drain is."""
        policy = self.policy
        if not policy.verdicts:
            return []
        return [LearnVerdicts(step + policy.ahead - 1 - policy.lookahead)]

    def before_end(self, step: int) -> list[LearnVerdicts]:
        """What must be known before the work source is asked whether step ``step`` drains."""
        if not self.policy.verdicts:
            return []
        return [LearnVerdicts(step - self.policy.lookahead)]

    def feed(self, step: int, drain: int) -> list[Feed | Horizon]:
        """Step ``step`` is about to run and the next drain point is after step ``drain``: feed
        every step not fed yet up to the drain or the lookahead, whichever comes first (never a
        step before ``step``: a joiner starts where the mesh stands), and close the horizon there."""
        last = min(drain, step + self.policy.ahead)
        feeds = [Feed(t) for t in range(max(self.fed + 1, step), last + 1)]
        self.fed = max(self.fed, last)
        return [*feeds, Horizon((last + 1) * self.policy.microbatches)]

    def hand_over(self, step: int, source, workers: Mapping[WorkerId, Worker],
                  take: Callable[[WorkerId, StepWork], None]) -> None:
        """Execute ``feed``'s actions for a process's ``workers`` (every worker in the simulator,
        its own in a real runtime; ``source``: the work source, which gives their work): each fed
        step's work to ``take`` (a worker's ``feed``, and in a real runtime the step's receives),
        then their horizon."""
        for action in self.feed(step, source.next_drain(step)):
            if isinstance(action, Feed):
                for wid, work in source.work(action.step).items():  # the process's workers' work
                    take(wid, work)
            else:
                for worker in workers.values():
                    worker.horizon = action.microbatch

    def end(self, step: int, source, background: bool) -> list[StepEndAction]:
        """``step_end``, the next drain point asked of ``source`` only where ``asks_at_end`` says
        something depends on it."""
        return self.step_end(step, source.next_drain(step) if self.asks_at_end(background) else None)

    def asks_at_end(self, background: bool) -> bool:
        """Whether a runtime must ask its work source, at a step's end, whether the step drains:
        only when something depends on the answer: ``background`` work still open (a DP
        strategy's rounds, the simulator's events), or reports that wait for a drain point. Asking
        claims the next step for a stop request (train/signals.py: once this process's workers
        finished the step); the trainer claims it itself after the plugins' step ends, so asking
        when nothing depends on it would move a signal that comes at a step's end one step later."""
        return background or self.policy.reports_at_drain

    def step_end(self, step: int, drain: int | None) -> list[StepEndAction]:
        """Step ``step`` ended on this process; the next drain point is after step ``drain``
        (None: not asked, ``asks_at_end`` said nothing depends on it)."""
        assert drain is not None or not self.policy.reports_at_drain, "pending reports need the drain asked"
        drains = drain == step
        actions: list[StepEndAction] = [Settle()] if drains else []
        if not self.policy.reports_at_drain:
            return [*actions, Report(step, step)]
        if self.pending_from is None:
            self.pending_from = step
        if drains:
            actions.append(Report(self.pending_from, step))
            self.pending_from = None
        return actions
