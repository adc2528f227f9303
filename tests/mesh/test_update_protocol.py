"""The update protocol (mesh/update.py) without any runtime: the clip policy, the action list of
each schedule and DP strategy, the deadlines attached to collective requests, the robust reduce,
the elastic vote's place, and the phase walk with its rounds' deadlines.

The DP phase walk is executed here by a minimal in-test executor (messages delivered at once, no
clock): each registered strategy's actions must walk to the end, every round completing; a toy
strategy (average every other update) shows a round waited for until its deadline, then dropped."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from meshlearn.dp.base import DPStrategy
from meshlearn.dp.registry import BUILDERS, build_strategy
from meshlearn.dp.robust import Robust
from meshlearn.dp.settings import DPConfig
from meshlearn.mesh.network import LinkProfile
from meshlearn.mesh.schedule import build_plan
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.update import (
    ClipAndStep,
    Commit,
    GatherNorms,
    MergeRounds,
    PhaseWalk,
    ReduceGradients,
    RoundStarts,
    StrategyPhase,
    UpdateSpec,
    Wait,
    clip_coefficient,
    clip_policy,
    find,
    receive_round,
    round_give_up_at,
    round_late,
    update_actions,
    waits_for,
)

P, D = 3, 2


def flushes(schedule: str) -> bool:
    return build_plan(schedule, 0, P, 4, 4, 1).flushes


def kinds(actions) -> list[str]:
    return [type(a).__name__ + (f":{a.phase}" if isinstance(a, StrategyPhase) else "") for a in actions]


def replicas_of(name: str, replicas: int = D, **dp) -> list[SimpleNamespace]:
    """Stage 0's replicas as the registry sees a worker (a tiny module, its optimizer), each with
    its strategy as ``dp``."""
    cfg = dataclasses.replace(DPConfig(), name=name, **dp)
    out = []
    for r in range(replicas):
        torch.manual_seed(r)
        module = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
        worker = SimpleNamespace(id=WorkerId(r, 0), mesh=SimpleNamespace(replicas=replicas), module=module,
                                 optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                 dp_contribution=lambda key, values: values,
                                 note_round_score=lambda u, scores: None)
        worker.dp = build_strategy(cfg, worker, LinkProfile())
        out.append(worker)
    return out


def strategies(name: str, replicas: int = D, **dp) -> list:
    return [w.dp for w in replicas_of(name, replicas, **dp)]


# --- the clip policy -------------------------------------------------------------------------------

SQ = {WorkerId(r, s): float(1 + 10 * r + s) for r in range(D) for s in range(P)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_flushing_schedule_clips_by_replica_0s_stages_summed_in_stage_order(schedule):
    policy = clip_policy(1.0, P, flushes(schedule), drifts=False)
    assert policy.scope == "mesh" and policy.max_norm == 1.0
    for me in SQ:  # every worker clips with the same norm: replica 0's
        assert policy.sq_norm(me, SQ.__getitem__) == 1.0 + 2.0 + 3.0


def test_a_drifting_strategy_clips_each_replica_by_its_own_norm():
    policy = clip_policy(1.0, P, flushes("1f1b"), drifts=True)
    assert policy.sq_norm(WorkerId(1, 0), SQ.__getitem__) == 11.0 + 12.0 + 13.0
    assert policy.sq_norm(WorkerId(0, 2), SQ.__getitem__) == 1.0 + 2.0 + 3.0


@pytest.mark.parametrize("drifts", [False, True])
def test_async_and_elastic_clip_each_stage_at_grad_clip_over_root_p(drifts):
    for policy in (clip_policy(2.0, P, flushes("async"), drifts),
                   clip_policy(2.0, P, flushes("1f1b"), drifts, mesh_wide=False)):
        assert policy.scope == "stage"
        assert policy.max_norm == pytest.approx(2.0 / math.sqrt(P))
        assert policy.sq_norm(WorkerId(1, 2), SQ.__getitem__) == SQ[WorkerId(1, 2)]
        # P stages each at the limit together stay within grad_clip
        assert math.sqrt(P * policy.max_norm ** 2) == pytest.approx(2.0)


def test_the_coefficient_is_torchs_clip_grad_norm_and_off_at_zero():
    g = torch.tensor([3.0, 4.0])
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert clip_coefficient(25.0, 1.0) * g[0].item() == pytest.approx(p.grad[0].item(), rel=1e-6)
    assert clip_coefficient(25.0, 0.0) == 1.0 == clip_coefficient(0.01, 1.0)
    assert clip_policy(0.0, P, False, False).coefficient(1e9) == 1.0


# --- the action lists ----------------------------------------------------------------------------

def test_the_built_in_all_reduce_under_flush_and_async():
    spec = UpdateSpec(u=0, flushes=True, stages=P, grad_clip=1.0, strategy=None)
    actions = update_actions(spec)
    assert kinds(actions) == ["ReduceGradients", "GatherNorms", "ClipAndStep"]
    assert waits_for(actions) == "mesh" and find(actions, GatherNorms).latency
    actions = update_actions(dataclasses.replace(spec, flushes=False))
    assert kinds(actions) == ["ReduceGradients", "ClipAndStep"] and waits_for(actions) == "stage"
    # no clip: the norms are still gathered (the report's), but no latency is waited on
    assert not find(update_actions(dataclasses.replace(spec, grad_clip=0.0)), GatherNorms).latency


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("flush", [True, False])
def test_each_registered_strategys_phase_walk(name, flush):
    """Every registered strategy walks pre → (norms) → clip and step → post → merge, or the built-in
    reduce for ``allreduce``; executed here with messages delivered at once, every round of every
    update completes and nothing stays open."""
    workers = replicas_of(name, **({"inner_steps": 2} if name == "diloco" else {}))
    group = [w.dp for w in workers]
    sent = 0
    for u in range(4):
        for w in workers:  # this update's gradients: different on every replica
            for p in w.module.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * u + w.id.replica))
        per_replica = [update_actions(UpdateSpec(u, flush, P, 1.0, s)) for s in group]
        actions = per_replica[0]
        assert all(kinds(a) == kinds(actions) for a in per_replica)
        policy = find(actions, ClipAndStep).policy
        assert policy.scope == ("mesh" if flush else "stage")
        assert policy.per_replica == (flush and group[0].drifts)
        if group[0].collective:
            assert kinds(actions)[0] == "ReduceGradients" and find(actions, StrategyPhase) is None
            continue
        expected = ["StrategyPhase:pre", *(["GatherNorms"] if flush else []), "ClipAndStep",
                    "StrategyPhase:post", "MergeRounds"]
        assert kinds(actions) == expected and waits_for(actions) == ("mesh" if flush else "self")
        sent += _walk(workers, per_replica)
    assert all(s.idle for s in group)
    assert sent > 0 or group[0].collective  # the rounds really ran through the walk


def _walk(workers, per_replica) -> int:
    """Execute one update's actions on every replica in lockstep, each message delivered at once;
    returns how many messages were delivered."""
    group = [w.dp for w in workers]
    delivered = 0
    for i in range(len(per_replica[0])):
        outbox = []
        for worker, actions in zip(workers, per_replica, strict=True):
            strategy, act = worker.dp, actions[i]
            if isinstance(act, StrategyPhase):
                step = strategy.pre_step if act.phase == "pre" else strategy.post_step
                outbox += step(act.u)
            elif isinstance(act, ClipAndStep):  # unclipped here: the local step makes replicas drift
                worker.optimizer.step()
                worker.optimizer.zero_grad(set_to_none=True)
            elif isinstance(act, MergeRounds):
                strategy.apply(act.u)
        while outbox:
            message = outbox.pop(0)
            delivered += 1
            outbox += group[message.dst.replica].receive(message)
        for strategy, actions in zip(group, per_replica, strict=True):
            act = actions[i]
            if isinstance(act, StrategyPhase) and act.phase == "pre":
                assert strategy.pre_ready(act.u)
            if isinstance(act, StrategyPhase) and act.phase == "post":
                assert strategy.post_wait(act.u) is None  # every round it needs arrived
    return delivered


def test_collective_requests_carry_the_runtimes_deadline():
    spec = UpdateSpec(u=0, flushes=True, stages=P, grad_clip=1.0, strategy=None, collective_deadline_s=7.5)
    actions = update_actions(spec)
    assert find(actions, ReduceGradients).deadline_s == 7.5 == find(actions, GatherNorms).deadline_s
    sim = update_actions(dataclasses.replace(spec, collective_deadline_s=None))
    assert find(sim, ReduceGradients).deadline_s is None  # the virtual clock never waits


def test_a_rounds_deadline_counts_from_the_receivers_own_start():
    assert round_give_up_at(10.0, 2.0) == 12.0
    assert round_give_up_at(10.0, None) is None and round_give_up_at(None, 2.0) is None
    assert round_late(10.0, 2.0, 12.5) and not round_late(10.0, 2.0, 12.0)
    assert not round_late(10.0, None, 1e9)


@pytest.mark.parametrize("rule", ["none", "trimmed_mean", "median", "centered_clip"])
def test_the_robust_reduce_is_requested_when_dp_robust_is_not_none(rule):
    [strategy, *_] = strategies("allreduce", replicas=3, robust=rule)
    reduce = find(update_actions(UpdateSpec(0, True, P, 1.0, strategy)), ReduceGradients)
    assert reduce.rule == Robust(rule, 1)
    assert reduce.gathers == (rule != "none")
    assert find(update_actions(UpdateSpec(0, True, P, 1.0, None)), ReduceGradients).rule == Robust()


# --- elastic: the vote ------------------------------------------------------------------------------

def test_elastic_votes_before_the_step_unless_the_strategys_rounds_follow_it():
    elastic = {"mesh_wide": False, "votes": True}
    actions = update_actions(UpdateSpec(0, True, P, 1.0, None, **elastic))
    assert kinds(actions) == ["ReduceGradients", "Commit", "ClipAndStep"]
    assert find(actions, ClipAndStep).policy.scope == "stage"
    group = strategies("diloco", inner_steps=2)
    syncs = [u for u in range(4) if group[0].post_rounds(u)]
    assert syncs and len(syncs) < 4  # diloco syncs every inner_steps updates: both cases occur
    for u in range(4):
        order = kinds(update_actions(UpdateSpec(u, True, P, 1.0, group[0], **elastic)))
        assert order.count("Commit") == 1
        commit_after_post = order.index("Commit") > order.index("StrategyPhase:post")
        assert commit_after_post == (u in syncs), (u, order)
        assert find(update_actions(UpdateSpec(u, True, P, 1.0, group[0], **elastic)), GatherNorms) is None
    assert Commit() == Commit()


# --- the phase walk and the rounds' deadlines ---------------------------------------------------

class EveryOther(DPStrategy):
    """A toy strategy: after every even update, average the replicas' weights, waited for until
    the round's deadline (then the update goes on without it)."""

    name = "every_other"

    def __init__(self, me: WorkerId, replicas: int, weights: torch.Tensor, deadline_s: float | None):
        super().__init__(me, replicas)
        self.weights, self.limit, self.mean = weights, deadline_s, None

    def post_step(self, u: int) -> list:
        return self.share((u, 0), self.weights, u) if u % 2 == 0 else []

    def on_complete(self, key) -> list:
        self.mean = self.exchange.mean(key)
        return []

    def post_wait(self, u: int):
        key = (u, 0)
        return key if u % 2 == 0 and self.mean is None and key not in self.exchange.dropped else None

    def deadline_s(self, key) -> float | None:
        return self.limit

    def apply(self, u: int) -> None:
        if self.mean is not None:
            self.weights.copy_(self.mean)
            self.mean = None


def pair(deadline_s: float | None) -> list[EveryOther]:
    return [EveryOther(WorkerId(r, 0), 2, torch.full((3,), float(r)), deadline_s) for r in range(2)]


def test_a_post_phase_waits_for_its_round_until_the_deadline_then_drops_it():
    a, b = pair(deadline_s=2.0)
    starts = RoundStarts()
    walk = PhaseWalk(a, StrategyPhase("post", 0), starts)
    sent = walk.messages()
    starts.mark(sent, 10.0)
    assert walk.poll(11.0) == Wait(12.0, 0)  # the peer's part is missing: wait until the deadline
    assert walk.poll(12.5) is None and a.dropped == 1  # past it: dropped, the update goes on
    late = b.post_step(0)[0]
    assert receive_round(a, starts, late, arrived=12.6) == [] and a.mean is None


def test_a_round_that_completes_in_time_is_merged():
    a, b = pair(deadline_s=2.0)
    starts = RoundStarts()
    walk = PhaseWalk(a, StrategyPhase("post", 0), starts)
    starts.mark(walk.messages(), 10.0)
    receive_round(a, starts, b.post_step(0)[0], arrived=11.5)
    assert walk.poll(11.5) is None and a.dropped == 0
    a.apply(0)
    assert torch.equal(a.weights, torch.full((3,), 0.5))
    assert PhaseWalk(a, StrategyPhase("post", 1), starts).messages() == []  # odd updates: no round


def test_a_round_without_deadline_is_waited_for_and_a_pre_phase_until_ready():
    a, _ = pair(deadline_s=None)
    starts = RoundStarts()
    walk = PhaseWalk(a, StrategyPhase("post", 0), starts)
    starts.mark(walk.messages(), 10.0)
    assert walk.poll(1e9) == Wait(None, 0) and a.dropped == 0
    assert PhaseWalk(a, StrategyPhase("pre", 0), starts).poll(0.0) is None


def test_round_starts_keep_the_first_send_and_forget_settled_rounds():
    a, _ = pair(deadline_s=1.0)
    starts = RoundStarts()
    starts.mark(a.post_step(0), 5.0)
    starts.mark(a.post_step(0), 7.0)  # a later part of the same round: its start stays
    assert starts.give_up_at(a, (0, 0)) == 6.0
    starts.forget_before(1)
    assert starts.give_up_at(a, (0, 0)) is None
