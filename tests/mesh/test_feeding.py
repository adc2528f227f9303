"""The feeding policy (mesh/feeding.py) without any runtime: how far each schedule feeds, the
horizon, the drain points (never fed past, settled, reported), a joiner and a resume, and the
verified async rule (a stage's own depth, the verdicts learned before feeding and before a step's
end). A minimal in-test executor runs a whole invocation over random drain points and checks what
every runtime relies on: each step fed once and in order, never past a drain point nor beyond the
lookahead, each step reported once."""

from __future__ import annotations

import random

import pytest

from meshlearn.mesh.feeding import (
    Feed,
    Feeding,
    Horizon,
    LearnVerdicts,
    Report,
    Settle,
    feed_policy,
)
from meshlearn.mesh.schedule import feed_lookahead

M = 4


def test_a_flushing_schedule_feeds_the_coming_step_only():
    feeding = Feeding(feed_policy(M, flushes=True, deepest_in_flight=3))
    assert feeding.policy.lookahead == feeding.policy.ahead == 0
    assert feeding.feed(0, drain=9) == [Feed(0), Horizon(M)]
    # Nothing in the background: the drain is not asked at the step's end (the trainer claims the
    # next step after the plugins' step ends, so a signal there stops after this step).
    assert not feeding.asks_at_end(background=False) and feeding.asks_at_end(background=True)
    assert feeding.step_end(0, drain=None) == [Report(0, 0)]
    assert feeding.step_end(0, drain=9) == [Report(0, 0)]
    assert feeding.feed(1, drain=1) == [Feed(1), Horizon(2 * M)]
    assert feeding.step_end(1, drain=1) == [Settle(), Report(1, 1)]
    assert feeding.fed == 1


def test_async_feeds_ahead_up_to_the_lookahead_never_past_a_drain_point():
    policy = feed_policy(M, flushes=False, deepest_in_flight=5)
    assert policy.lookahead == policy.ahead == feed_lookahead(5, M) == 3
    feeding = Feeding(policy)
    assert feeding.feed(0, drain=9) == [Feed(0), Feed(1), Feed(2), Feed(3), Horizon(4 * M)]
    assert feeding.feed(1, drain=9) == [Feed(4), Horizon(5 * M)]
    assert feeding.feed(2, drain=4) == [Horizon(5 * M)]  # the drain after step 4 caps it
    assert feeding.feed(3, drain=4) == [Horizon(5 * M)]
    assert feeding.fed == 4
    # The simulator and a flushing gather report every step at its end; a drain also settles.
    assert feeding.step_end(3, drain=4) == [Report(3, 3)]
    assert feeding.step_end(4, drain=4) == [Settle(), Report(4, 4)]


def test_a_real_async_run_reports_its_pending_steps_at_the_drain_point():
    feeding = Feeding(feed_policy(M, flushes=False, deepest_in_flight=4, gathers_per_step=False))
    assert feeding.policy.reports_at_drain and feeding.asks_at_end(background=False)
    assert feeding.step_end(0, drain=2) == []
    assert feeding.step_end(1, drain=2) == []
    assert feeding.step_end(2, drain=2) == [Settle(), Report(0, 2)]
    assert feeding.step_end(3, drain=3) == [Settle(), Report(3, 3)]
    # A flushing schedule's gather reports every step at its end, in any runtime.
    assert not feed_policy(M, flushes=True, deepest_in_flight=4, gathers_per_step=False).reports_at_drain


def test_a_joiner_and_a_resume_start_where_the_mesh_stands():
    joiner = Feeding(feed_policy(M, flushes=True, deepest_in_flight=1))  # fed nothing yet
    assert joiner.feed(7, drain=7) == [Feed(7), Horizon(8 * M)]
    resumed = Feeding(feed_policy(M, flushes=False, deepest_in_flight=4))
    resumed.resume(5)  # a checkpoint after step 5: steps 0..5 fed and applied
    assert resumed.feed(6, drain=20) == [Feed(6), Feed(7), Feed(8), Horizon(9 * M)]


def test_verified_async_feeds_its_own_depth_and_learns_verdicts_first():
    """A ban at step b drains after b + L: feeding through step f needs the verdicts through
    f − 1 − L, and whether step t drains needs those through t − L."""
    policy = feed_policy(M, flushes=False, deepest_in_flight=5, own_in_flight=2, verdicts=True)
    assert (policy.lookahead, policy.ahead, policy.verdicts) == (3, 1, True)
    feeding = Feeding(policy)
    assert feeding.before_feed(6) == [LearnVerdicts(6 + 1 - 1 - 3)]
    assert feeding.feed(6, drain=20) == [Feed(6), Feed(7), Horizon(8 * M)]
    assert feeding.before_end(6) == [LearnVerdicts(3)]
    # Under a flushing schedule verdicts ask for no drain ahead: nothing to learn, nothing held back.
    flushing = Feeding(feed_policy(M, flushes=True, deepest_in_flight=5, own_in_flight=2, verdicts=True))
    assert flushing.before_feed(6) == flushing.before_end(6) == []
    assert not Feeding(feed_policy(M, flushes=False, deepest_in_flight=5)).before_feed(6)


@pytest.mark.parametrize("flushes", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_an_invocation_feeds_each_step_once_and_reports_each_once(flushes, seed):
    """The executor a runtime is: ask the drain, feed, run the step, end it."""
    rng = random.Random(seed)
    steps = 40
    drains = {t for t in range(steps) if rng.random() < 0.2} | {steps - 1}
    feeding = Feeding(feed_policy(M, flushes, deepest_in_flight=rng.randint(1, 9),
                                  gathers_per_step=rng.random() < 0.5))
    lookahead = feeding.policy.lookahead
    fed, reported = [], []
    for t in range(steps):
        drain = min(d for d in drains if d >= t)
        actions = feeding.feed(t, drain)
        fed += [a.step for a in actions if isinstance(a, Feed)]
        assert actions[-1] == Horizon((fed[-1] + 1) * M)  # every step fed may start, nothing later
        assert t <= fed[-1] <= min(drain, t + lookahead)
        end = feeding.step_end(t, drain)
        assert (Settle() in end) == (t in drains)
        for report in (a for a in end if isinstance(a, Report)):
            reported += range(report.first, report.last + 1)
        if t in drains:
            assert reported == list(range(t + 1))  # a drain point leaves no report pending
    assert fed == reported == list(range(steps))
