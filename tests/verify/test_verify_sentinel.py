"""SENTINEL's decisions on synthetic message streams: FPR, inert flags, bans, skips, replayability."""

from __future__ import annotations

import random

import pytest
import torch

from meshlearn.compress.codecs import IdentityCodec
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.verify.sentinel import Sentinel, VerifyConfig

MESH = MeshShape(replicas=2, stages=3)
CODEC = IdentityCodec()
SHAPE = (4, 16, 8)  # (b, n, c)


class Stream:
    """A stationary stream: a fixed per-position pattern plus per-sample noise."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.pattern = torch.randn(SHAPE[1:], generator=self.gen)

    def __call__(self) -> torch.Tensor:
        return self.pattern + 0.5 * torch.randn(SHAPE, generator=self.gen)


def message(kind: str, step: int, mb: int, src: WorkerId, x: torch.Tensor) -> Message:
    dst = MESH.next_stage(src) if kind == "act" else MESH.prev_stage(src)
    return Message(kind, step, mb, src, dst, CODEC.encode(x, kind))


def sentinel(mesh: MeshShape = MESH, **overrides) -> Sentinel:
    """Synthetic streams are not residual: pair metrics off unless a test asks for them."""
    cfg = VerifyConfig(**({"name": "sentinel", "warmup_steps": 20, "window": 128, "pair_metrics": ""}
                          | overrides))
    return Sentinel(cfg, mesh, CODEC)


def run_step(s: Sentinel, step: int, messages: list[Message]) -> list[Message]:
    delivered = [s.inspect(m) for m in messages]
    s.end_step(step)
    return delivered


def honest_step(stream: Stream, step: int, stage: int = 0, replicas: int = 2) -> list[Message]:
    return [message("act", step, mb, WorkerId(r, stage), stream())
            for mb in range(4) for r in range(replicas)]


def test_false_positive_rate_on_a_stationary_stream_is_below_one_percent():
    s, stream = sentinel(), Stream(0)
    flags = scored = 0
    for step in range(250):
        for m in honest_step(stream, step):
            s.inspect(m)
        outcome = s.end_step(step)
        assert not outcome.bans
        scored += sum(d.scored for d in outcome.decisions)
        flags += sum(d.flagged for d in outcome.decisions)
    assert scored == 230 * 8
    assert flags / scored <= 0.01


class HeavyTailedStream(Stream):
    """Noise whose scale varies from message to message: right-skewed distances, as on the demo."""

    def __call__(self) -> torch.Tensor:
        scale = 0.5 * torch.exp(0.5 * torch.randn((), generator=self.gen))
        return self.pattern + scale * torch.randn(SHAPE, generator=self.gen)


def test_calibration_at_the_end_of_warmup_lowers_false_positives_and_keeps_a_gross_attack():
    """fpr_target raises each fence's k once, after the last warm-up step; zeros are still caught."""
    results = {}
    for target in (0.0, 0.01):
        s, stream = sentinel(fpr_target=target, window=64), HeavyTailedStream(3)
        flags = caught = 0
        for step in range(200):
            batch = honest_step(stream, step)
            if step == 150:
                batch[0] = message("act", step, 0, WorkerId(1, 0), torch.zeros(SHAPE))
            for m in batch:
                s.inspect(m)
            decisions = s.end_step(step).decisions
            flags += sum(d.flagged and d.step != 150 for d in decisions)
            caught += sum(d.flagged and d.step == 150 and d.microbatch == 0 for d in decisions)
        ks = [f.k for f in s.verifiers[(0, "act")].fences.values()]
        results[target] = flags, caught, ks
    assert results[0.0][2] == [3.0] * 4
    assert all(k >= 3.0 for k in results[0.01][2]) and max(results[0.01][2]) > 3.0
    assert results[0.01][0] < results[0.0][0]
    assert results[0.0][1] >= 1 and results[0.01][1] >= 1


def test_without_bans_an_attacker_keeps_being_flagged_and_is_never_banned():
    s, stream = sentinel(ban=False), Stream(0)
    flags = 0
    for step in range(40):
        batch = honest_step(stream, step)
        if step >= 25:
            batch[1] = message("act", step, 0, WorkerId(1, 0), torch.zeros(SHAPE))
        for m in batch:
            s.inspect(m)
        outcome = s.end_step(step)
        assert outcome.bans == []
        flags += sum(d.flagged and d.src == WorkerId(1, 0) and d.microbatch == 0 for d in outcome.decisions)
    assert flags == 15 and s.banned == {}


def test_decisions_do_not_depend_on_arrival_order():
    """Replay: the same messages, delivered in another order within each step, give the same log."""
    logs = []
    for order_seed in (0, 1):
        s, stream, shuffle = sentinel(), Stream(0), random.Random(order_seed)
        log = []
        for step in range(60):
            batch = honest_step(stream, step)
            if step >= 40:
                batch[3] = message("act", step, 1, WorkerId(1, 0), 3.0 * batch[3].payload.tensors["values"])
            shuffle.shuffle(batch)
            for m in batch:
                s.inspect(m)
            log += sorted((d.step, d.microbatch, str(d.src), d.action, tuple(sorted(d.distances.items())))
                          for d in s.end_step(step).decisions)
        logs.append(log)
    assert logs[0] == logs[1]
    assert any(entry[3] == "flag" for entry in logs[0])


def test_flagged_messages_leave_references_and_windows_untouched():
    twins = [sentinel(), sentinel()]
    streams = [Stream(0), Stream(0)]
    for step in range(30):
        for s, stream in zip(twins, streams, strict=True):
            batch = honest_step(stream, step)
            if s is twins[1] and step == 25:  # one extra, flagrantly bad message
                batch.append(message("act", step, 5, WorkerId(1, 0), torch.full(SHAPE, -3.0)))
            run_step(s, step, batch)
    # One flagged message among the sender's five of the step is no strike (ledger.step_strikes).
    assert twins[1].bans == [] and sum(twins[1].history[WorkerId(1, 0)]) == 0
    a, b = (t.verifiers[(0, "act")] for t in twins)
    assert torch.equal(a.reference.mean, b.reference.mean)
    assert torch.equal(a.reference.table, b.reference.table)
    assert all(list(a.fences[m].values) == list(b.fences[m].values) for m in a.fences)
    assert list(a.norms) == list(b.norms)


def test_the_sender_is_banned_at_its_third_strike_and_then_quarantined():
    """Stage 1 of 3 (a middle stage), 3 replicas: the ban budget allows one ban there."""
    s, stream = sentinel(MeshShape(replicas=3, stages=3)), Stream(0)
    for step in range(25):
        run_step(s, step, honest_step(stream, step, stage=1, replicas=3))
    attacker = WorkerId(1, 1)
    for mb in range(2):
        s.inspect(message("act", 25, mb, attacker, torch.zeros(SHAPE)))
    assert s.end_step(25).bans == []  # two strikes
    s.inspect(message("act", 26, 0, attacker, torch.zeros(SHAPE)))
    s.inspect(message("act", 26, 0, WorkerId(0, 1), Stream(0)()))
    outcome = s.end_step(26)
    assert [d.action for d in outcome.decisions] == ["flag", "accept"] and outcome.rebased == []
    [ban] = outcome.bans
    assert ban.worker == attacker and ban.step == 26 and ban.strikes == 3 and ban.metric == "norm"
    assert ban.record()["step"] == 27  # 1-based, as in metrics.jsonl
    delivered = s.inspect(message("act", 27, 0, attacker, Stream(0)()))  # not replaced: quarantined
    assert delivered.skip and s.end_step(27).decisions[0].action == "banned"
    s.readmit(attacker)  # a replacement took the slot
    assert not s.inspect(message("act", 28, 0, attacker, Stream(0)())).skip


def regime_change(replicas: int, **overrides) -> tuple[Sentinel, list]:
    """25 steps of one stream, then 3 steps in which every sender's traffic changes the same way,
    at stage 1 (a middle stage, which may be banned). Banned senders are replaced at once
    (readmitted), as the trainer's trust layer does."""
    mesh = MeshShape(replicas=replicas, stages=3)
    s, stream = sentinel(mesh, **overrides), Stream(0)
    for step in range(25):
        run_step(s, step, honest_step(stream, step, stage=1, replicas=replicas))
    shifted = Stream(0)
    shifted.pattern = -stream.pattern
    outcomes = []
    for step in range(25, 28):
        for m in honest_step(shifted, step, stage=1, replicas=replicas):
            s.inspect(m)
        outcomes.append(s.end_step(step))
        for ban in outcomes[-1].bans:
            s.readmit(ban.worker)
    return s, outcomes


def test_when_most_senders_are_flagged_the_reference_is_rebased_not_the_workers_banned():
    """Honest majority: if (almost) every sender looks wrong, the reference is what went stale."""
    s, outcomes = regime_change(replicas=3)
    assert all(d.action == "flag" for d in outcomes[0].decisions) and outcomes[0].rebased == ["s1|s2 act"]
    assert all(o.bans == [] for o in outcomes)
    assert sum(d.flagged for d in outcomes[-1].decisions) <= 1  # recovered after one step
    assert all(sum(h) == 0 for h in s.history.values())  # the voided flags left no strikes


def test_without_a_rebase_a_stale_reference_flags_every_step_but_bans_nobody():
    """Before issue 17 this banned all three honest replicas every step. Now the stale reference
    still flags everyone (why the rebase exists), but nobody stands out from its peers, so nobody
    is struck; and even counting every flag (ban_margin = 0), one ban per stage is all the budget
    allows at 3 replicas; the rest of the evidence becomes alerts."""
    _, outcomes = regime_change(replicas=3, majority_rebase=False)
    assert all(o.rebased == [] for o in outcomes)
    assert all(all(d.flagged for d in o.decisions) for o in outcomes)
    assert all(o.bans == [] and o.alerts == [] for o in outcomes)
    _, outcomes = regime_change(replicas=3, majority_rebase=False, ban_margin=0.0)
    assert sum(len(o.bans) for o in outcomes) == 1
    alerted = {a.worker for o in outcomes for a in o.alerts}  # the replacement too, once it is flagged
    assert alerted | {b.worker for o in outcomes for b in o.bans} == {WorkerId(r, 1) for r in range(3)}
    assert all(a.cause == "budget" for o in outcomes for a in o.alerts)


def test_with_two_senders_the_reference_is_rebased_strikes_stand_and_nobody_is_banned():
    """A flagged "majority" of two may be an attacker plus one false positive: no voiding, but the
    reference still recovers. Before issue 17 both honest senders were banned here; with 2 replicas
    there is no honest majority, the ban budget is 0, and the evidence becomes alerts (counting
    every flag as a strike: ban_margin = 0; by default neither stands out from the other). The
    flagged step is one strike each (ledger.step_strikes), so the alert needs strikes = 1 here."""
    s, outcomes = regime_change(replicas=2, ban_margin=0.0, strikes=1)
    assert outcomes[0].rebased == ["s1|s2 act"]
    assert all(o.bans == [] for o in outcomes)
    assert {a.worker for o in outcomes for a in o.alerts} == {WorkerId(0, 1), WorkerId(1, 1)}
    assert all(sum(h) >= 1 for h in s.history.values())  # the strikes stood
    assert sum(d.flagged for d in outcomes[-1].decisions) <= 1


def test_no_ban_during_warmup_but_sanity_checks_still_quarantine():
    s, stream = sentinel(warmup_steps=50), Stream(0)
    for step in range(10):
        run_step(s, step, honest_step(stream, step))
    bad = torch.full(SHAPE, float("nan"))
    delivered = [s.inspect(message("act", 10, mb, WorkerId(1, 0), bad)) for mb in range(4)]
    outcome = s.end_step(10)
    assert outcome.bans == [] and [d.reason for d in outcome.decisions] == ["nonfinite"] * 4
    assert all(m.skip and torch.isfinite(m.payload.tensors["values"]).all() for m in delivered)


def test_a_dropped_microbatch_is_skipped_downstream_and_carries_nothing():
    """Skip propagation: after an upstream flag, no downstream verifier scores (or flags) the batch."""
    s, stream1, stream2 = sentinel(), Stream(0), Stream(1)
    for step in range(25):
        run_step(s, step, honest_step(stream1, step, 0) + honest_step(stream2, step, 1))
    r1 = lambda stage: WorkerId(1, stage)  # noqa: E731
    placeholder = s.verifiers[(1, "act")].reference.mean.expand(SHAPE).clone()
    flagged = s.inspect(message("act", 25, 0, r1(0), -5 * stream1()))
    downstream = s.inspect(message("act", 25, 0, r1(1), 50 * stream2()))  # would be flagged if scored
    grad_back = s.inspect(message("grad", 25, 0, r1(2), torch.randn(SHAPE)))
    grad_first = s.inspect(message("grad", 25, 0, r1(1), torch.randn(SHAPE)))
    other = s.inspect(message("act", 25, 1, r1(1), stream2()))
    decisions = s.end_step(25).decisions
    assert [d.action for d in decisions] == ["flag", "skip", "skip", "skip", "accept"]
    assert flagged.skip and downstream.skip and not other.skip
    assert torch.equal(downstream.payload.tensors["values"], placeholder)
    assert not grad_back.payload.tensors["values"].any() and not grad_first.payload.tensors["values"].any()
    assert sum(s.history[r1(1)]) == 0  # honest downstream worker: no strike


@pytest.mark.parametrize("grad_action", ["ema", "zero"])
def test_a_flagged_gradient_is_replaced_and_its_upstream_gradients_pass_unscored(grad_action):
    s, stream = sentinel(grad_action=grad_action), Stream(0)
    for step in range(25):
        run_step(s, step, [message("grad", step, mb, WorkerId(r, 2), stream())
                           for mb in range(4) for r in range(2)])
    reference = s.verifiers[(1, "grad")].reference.mean.clone()
    replaced = s.inspect(message("grad", 25, 0, WorkerId(1, 2), -stream()))
    upstream = s.inspect(message("grad", 25, 0, WorkerId(1, 1), 1e6 * stream()))
    assert [d.action for d in s.end_step(25).decisions] == ["flag", "skip"]
    expected = reference.expand(SHAPE) if grad_action == "ema" else torch.zeros(SHAPE)
    assert torch.allclose(replaced.payload.tensors["values"], expected, atol=1e-5)
    assert upstream.payload.tensors["values"].abs().max() > 1e5  # passed on, derived from the EMA


def test_state_dict_round_trip_continues_identically():
    a, stream_a = sentinel(), Stream(0)
    for step in range(30):
        run_step(a, step, honest_step(stream_a, step))
    b = sentinel()
    b.load_state_dict(a.state_dict())
    stream_b = Stream(0)
    for step in range(30):
        honest_step(stream_b, step)  # advance the second stream to the same point
    for step in range(30, 40):
        batch_a, batch_b = honest_step(stream_a, step), honest_step(stream_b, step)
        for ma, mb in zip(batch_a, batch_b, strict=True):
            a.inspect(ma)
            b.inspect(mb)
        da, db = a.end_step(step).decisions, b.end_step(step).decisions
        assert [(d.action, d.distances) for d in da] == [(d.action, d.distances) for d in db]


def test_with_an_honest_majority_a_minority_sender_barely_moves_the_reference():
    """reference_update=median: one of four senders adds a large bias during warm-up, when every
    message is accepted (the note's "poisoned reference" pitfall). The median bounds its pull on the
    reference by the honest spread; the mean takes a quarter of the bias. Without the warm-up
    suspension, which (with the first stage verified from 3 replicas) keeps the sender out of the
    reference altogether: then even the mean takes none of it."""
    mesh = MeshShape(replicas=4, stages=3)
    absorbed = {}
    for how, suspend in (("median", False), ("mean", False), ("suspended", True)):
        s, stream = sentinel(mesh, reference_update="mean" if suspend else how, warmup_steps=40,
                             warmup_suspend=suspend), Stream(0)
        bias = 2.0 * torch.randn(SHAPE[-1], generator=torch.Generator().manual_seed(1))
        for step in range(40):
            batch = [message("act", step, m.microbatch, m.src, m.payload.tensors["values"] + bias)
                     if m.src.replica == 3 else m for m in honest_step(stream, step, replicas=4)]
            run_step(s, step, batch)
        offset = s.verifiers[(0, "act")].reference.mean - stream.pattern
        absorbed[how] = (offset.mean(0) @ bias / bias.norm() ** 2).item()  # share of the bias taken
    assert abs(absorbed["median"]) < 0.1 and absorbed["mean"] > 0.2 and abs(absorbed["suspended"]) < 0.1
