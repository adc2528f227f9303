"""One update walked by the engine (mesh/update_run.py) without any runtime: each test answers the
requests with fake collective results and checks the requests it gets next — the clip policy's
norms and coefficients, a vote that says no, a strategy's phases with their rounds' deadlines, the
merge (and a spectator's reset), and what a runtime that lacks a request is told."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_update_protocol import SQ, EveryOther, pair

from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.update import (
    ClipAndStep,
    Commit,
    GatherNorms,
    ReduceGradients,
    RoundStarts,
    StrategyPhase,
    UpdateSpec,
    Wait,
    clip_coefficient,
    receive_round,
    update_actions,
)
from meshlearn.mesh.update_run import Apply, Send, UpdateRun, drive

P = 3
ME = WorkerId(1, 2)


class OwnNorm:
    """This stage's squared norm, counting how often the engine asks for it."""

    def __init__(self, value: float):
        self.value, self.asked = value, 0

    def __call__(self) -> float:
        self.asked += 1
        return self.value


def run_of(spec: UpdateSpec, own: OwnNorm, me: WorkerId = ME, starts: RoundStarts | None = None,
           spectator: bool = False) -> UpdateRun:
    return UpdateRun(update_actions(spec), me, spec.strategy, starts or RoundStarts(), own, spectator)


def test_a_flushing_step_clips_every_worker_by_the_gathered_norms_of_replica_0():
    own = OwnNorm(99.0)
    run = run_of(UpdateSpec(0, flushes=True, stages=P, grad_clip=1.0, strategy=None), own)
    assert isinstance(run.start(), ReduceGradients)
    assert isinstance(gather := run.resume(), GatherNorms) and gather.latency
    apply = run.resume(SQ.__getitem__)  # the runtime's answer: every worker's norm
    assert apply == Apply(clip_coefficient(1.0 + 2.0 + 3.0, 1.0), 6.0)
    assert run.resume() is None
    assert run.outcome.stepped and run.outcome.committed and own.asked == 0


def test_async_clips_each_stage_at_grad_clip_over_root_p_by_its_own_norm_asked_once():
    own = OwnNorm(4.0)
    run = run_of(UpdateSpec(0, flushes=False, stages=P, grad_clip=1.0, strategy=None), own)
    assert isinstance(run.start(), ReduceGradients)
    apply = run.resume()
    assert apply == Apply(clip_coefficient(4.0, 1.0 / math.sqrt(P)), 4.0) and apply.coefficient < 1.0
    assert run.resume() is None and own.asked == 1 and run.outcome.sq_norm == 4.0


@pytest.mark.parametrize("commits", [True, False])
def test_elastic_votes_on_the_stage_norm_and_a_no_applies_nothing(commits):
    own = OwnNorm(0.25)
    run = run_of(UpdateSpec(0, True, P, 1.0, None, mesh_wide=False, votes=True), own)
    assert isinstance(run.start(), ReduceGradients)
    assert run.resume() == Commit()
    assert run.outcome.sq_norm == 0.25  # known before the vote: the step's report needs it either way
    after = run.resume(commits)
    if commits:
        assert after == Apply(1.0, 0.25) and run.resume() is None
    else:
        assert after is None
    assert run.outcome.committed == run.outcome.stepped == commits and own.asked == 1


def test_a_post_phase_waits_until_the_rounds_deadline_then_drops_it_and_merges():
    a, _ = pair(deadline_s=2.0)
    run = run_of(UpdateSpec(0, False, P, 0.0, a), OwnNorm(1.0), me=a.me)
    assert run.start() == Send([], StrategyPhase("pre", 0))
    assert run.resume(5.0) == Apply(1.0, 1.0)  # nothing to wait for before the step; no clip
    send = run.resume()
    assert send.phase == StrategyPhase("post", 0) and len(send.messages) == 1
    run.starts.mark(send.messages, 10.0)  # the runtime sends them at its clock's 10.0
    assert run.resume(10.0) == Wait(12.0, 0)
    assert run.resume(11.0) == Wait(12.0, 0)  # an arrival of something else: still waiting
    assert run.pop_waited() == 0.0
    assert run.resume(12.5) is None and a.dropped == 1  # past the deadline: dropped, merged without
    assert run.pop_waited() == pytest.approx(2.5) and run.pop_waited() == 0.0
    assert torch.equal(a.weights, torch.zeros(3))


def test_a_round_that_arrives_in_time_ends_the_wait_and_is_merged():
    a, b = pair(deadline_s=2.0)
    starts = RoundStarts()
    run = run_of(UpdateSpec(0, False, P, 0.0, a), OwnNorm(1.0), me=a.me, starts=starts)
    run.start()
    run.resume(0.0)
    send = run.resume()
    starts.mark(send.messages, 10.0)
    assert isinstance(run.resume(10.0), Wait)
    assert receive_round(a, starts, b.post_step(0)[0], arrived=11.0) == []  # the runtime delivers
    assert run.resume(11.0) is None and a.dropped == 0
    assert torch.equal(a.weights, torch.full((3,), 0.5))


def test_a_round_without_deadline_is_waited_for_without_a_deadline_event():
    a, _ = pair(deadline_s=None)
    run = run_of(UpdateSpec(0, False, P, 0.0, a), OwnNorm(1.0), me=a.me)
    run.start()
    run.resume(0.0)
    run.resume()
    assert run.resume(10.0) == Wait(None, 0) and run.resume(1e9) == Wait(None, 0)


class Spectated(EveryOther):
    def __init__(self):
        super().__init__(WorkerId(0, 0), 2, torch.zeros(3), None)
        self.resets = 0

    def post_step(self, u: int) -> list:
        return []

    def reset_local(self) -> None:
        self.resets += 1


@pytest.mark.parametrize("spectator", [False, True])
def test_a_spectators_strategy_forgets_its_own_state_after_the_merge(spectator):
    strategy = Spectated()
    spec = UpdateSpec(1, True, P, 1.0, strategy, mesh_wide=False, votes=True)
    outcome = drive(run_of(spec, OwnNorm(1.0), me=strategy.me, spectator=spectator),
                    {Send: lambda send: 0.0, Commit: lambda _: True, Apply: lambda _: None})
    assert outcome.committed and outcome.stepped
    assert strategy.resets == int(spectator)


def test_drive_names_a_request_the_runtime_cannot_execute():
    run = run_of(UpdateSpec(0, True, P, 1.0, None, mesh_wide=False, votes=True), OwnNorm(1.0))
    with pytest.raises(RuntimeError, match="cannot execute Commit"):
        drive(run, {ReduceGradients: lambda _: None, Apply: lambda _: None})


def test_a_workers_run_reads_its_schedule_and_the_runtimes_shape():
    worker = SimpleNamespace(version=3, plan=SimpleNamespace(flushes=True), mesh=SimpleNamespace(stages=P),
                             dp=None, id=ME, grad_sq_norm=OwnNorm(2.0))
    run = UpdateRun.of(worker, 1.0, RoundStarts())
    assert [type(a) for a in run.actions] == [ReduceGradients, GatherNorms, ClipAndStep]
    elastic = UpdateRun.of(worker, 1.0, RoundStarts(), u=0, mesh_wide=False, votes=True)
    assert [type(a) for a in elastic.actions] == [ReduceGradients, Commit, ClipAndStep]
    assert elastic.actions[-1].policy.scope == "stage" and run.actions[-1].policy.scope == "mesh"
