"""The first and last stages among strangers (issue 31 item 3): from 3 replicas they are verified and
banned like any stage, and the last stage is not blamed for data its row's first stage corrupted."""

from __future__ import annotations

import pytest
import torch
from test_verify_failsafe import CODEC, SHAPE, Stream
from tiny import tiny_config

from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.ends import EndsWatch, data_explained, mean_share
from meshlearn.verify.ledger import Decision, Ledger, Scored
from meshlearn.verify.sentinel import Sentinel
from meshlearn.verify.settings import VerifyConfig
from meshlearn.verify.verdicts import decision_from_record

START = 12
# 4 stages × 4 replicas × 2 microbatches of 2 sequences (as tests/verify/test_verify_mesh.py).
VERIFY = ["mesh.stages=4", "mesh.replicas=4", "train.batch_size=16", "verify.name=sentinel",
          "verify.warmup_steps=10", "verify.window=32"]


def run(tiny_corpus, tmp_path, steps: int, *overrides: str) -> dict:
    cfg = tiny_config(tiny_corpus, *VERIFY, f"train.steps={steps}", f"attack.start_step={START}", *overrides)
    return Trainer(cfg, tmp_path, progress=False).train()


@pytest.mark.parametrize("attack", [["attack.kind=zeros"], ["attack.kind=scaling", "attack.scale=-1"]])
def test_a_first_stage_attacker_is_banned_at_four_replicas(tiny_corpus, tmp_path, attack):
    summary = run(tiny_corpus, tmp_path, START + 6, "attack.workers=r1s0", *attack)
    assert [(b["worker"], b["honest"]) for b in summary["banned_workers"]] == [("r1s0", False)]
    assert summary["trust"]["workers"]["f1"] == 1.0


def test_a_last_stage_that_adds_a_bias_is_banned_at_four_replicas(tiny_corpus, tmp_path):
    """Its gradients are larger than its peers' (as behind a permuting first stage), but their mean
    over tokens carries a share of their energy no data gives: its flags are its own. Without that
    rule (``ends_mean_share`` 1: an excess nothing reaches) it was only quarantined, under an
    ``ends`` alert."""
    attack = ("attack.workers=r1s3", "attack.kind=bias", "attack.bias=2")  # 1σ is not flagged here
    summary = run(tiny_corpus, tmp_path / "rule", START + 6, *attack)
    assert [(b["worker"], b["honest"]) for b in summary["banned_workers"]] == [("r1s3", False)]
    assert summary["banned_workers"][0]["step"] <= START + 3 and summary["trust"]["alerts"] == []
    without = run(tiny_corpus, tmp_path / "without", START + 6, *attack, "verify.ends_mean_share=1.0")
    assert without["banned_workers"] == []
    assert [(a["worker"], a["cause"]) for a in without["trust"]["alerts"]] == [("r1s3", "ends")]


PERMUTED = 30  # the permutation needs a model that has learnt something: its loss must rise


@pytest.mark.slow
def test_a_first_stage_permutation_does_not_ban_the_honest_last_stage(tiny_corpus, tmp_path):
    """r1s0 permutes its sequences: no activation statistic moves, the honest r1s3's gradients grow
    (1.3–1.5× its peers' here). They are quarantined and an ``ends`` alert names the row; nobody is
    banned. Without the rule (a ratio nothing reaches) the same run bans the honest r1s3."""
    attack = ("attack.workers=r1s0", "attack.kind=permute", f"attack.start_step={PERMUTED}",
              f"verify.warmup_steps={PERMUTED - 2}")
    summary = run(tiny_corpus, tmp_path / "rule", PERMUTED + 10, *attack)
    assert summary["banned_workers"] == []
    assert summary["trust"]["flags_per_worker"]["r1s3"]["flags"] > 0
    assert [(a["worker"], a["cause"]) for a in summary["trust"]["alerts"]] == [("r1s3", "ends")]
    without = run(tiny_corpus, tmp_path / "without", PERMUTED + 10, *attack, "verify.ends_norm_ratio=1e9")
    assert [(b["worker"], b["honest"]) for b in without["banned_workers"]] == [("r1s3", True)]


# --- the same on synthetic streams (fast) ----------------------------------------------------


def last_stage_run(change, **overrides) -> Sentinel:
    """The last stage (2 of 3) of 4 replicas sends gradients; from step 22 replica 1's are ``change``d."""
    mesh = MeshShape(replicas=4, stages=3)
    cfg = VerifyConfig(**({"name": "sentinel", "warmup_steps": 20, "window": 128, "pair_metrics": ""}
                          | overrides))
    s, stream = Sentinel(cfg, mesh, CODEC), Stream(0)
    for step in range(30):
        for mb in range(4):
            for r in range(4):
                x = stream()
                if step >= 22 and r == 1:
                    x = change(x, stream)
                src = WorkerId(r, 2)
                s.inspect(Message("grad", step, mb, src, mesh.prev_stage(src), CODEC.encode(x, "grad")))
        s.end_step(step)
    return s


def test_a_last_stage_sign_flip_is_its_own_fault_and_banned():
    """Gradients ×−1 at their usual size: no data mismatch upstream produces that."""
    s = last_stage_run(lambda x, stream: -x)
    assert [b.worker for b in s.bans] == [WorkerId(1, 2)] and s.ledger.alerts == []


def test_larger_last_stage_gradients_ban_nobody_and_raise_an_ends_alert():
    """What a permuting first stage does to an honest last stage: larger gradients of another shape."""
    def mismatched(x, stream):
        return 1.4 * (x + 0.6 * torch.randn(x.shape, generator=stream.gen))
    s = last_stage_run(mismatched)
    assert s.bans == [] and [(a.worker, a.cause) for a in s.ledger.alerts] == [(WorkerId(1, 2), "ends")]
    without = last_stage_run(mismatched, ends_norm_ratio=1e9)
    assert [b.worker for b in without.bans] == [WorkerId(1, 2)]


def test_larger_last_stage_gradients_with_a_bias_added_are_the_last_stage_s_own():
    """A last stage that adds a fixed vector to every token's gradient makes them larger too (as a
    mismatched loss would), but no data move their mean over tokens that far: it is banned."""
    bias = torch.randn(SHAPE[-1], generator=torch.Generator().manual_seed(5))
    s = last_stage_run(lambda x, stream: x + x.std() * bias)
    assert [b.worker for b in s.bans] == [WorkerId(1, 2)] and s.ledger.alerts == []
    without = last_stage_run(lambda x, stream: x + x.std() * bias, ends_mean_share=1.0)
    assert without.bans == [] and [(a.worker, a.cause) for a in without.ledger.alerts] == [
        (WorkerId(1, 2), "ends")]


def test_the_mean_share_is_scale_free_and_one_for_a_constant():
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    assert mean_share(3 * x) == pytest.approx(mean_share(x)) and mean_share(x) < 0.2
    assert mean_share(torch.ones(2, 16, 8)) == pytest.approx(1.0) and mean_share(torch.zeros(2, 4)) == 0.0


def grad(replica: int, mb: int, norm: float, flagged: bool, reason: str = "swd") -> Scored:
    src = WorkerId(replica, 3)
    decision = Decision(20, mb, "grad", src, WorkerId(replica, 2), "flag" if flagged else "accept",
                        reason if flagged else "", norm=norm)
    return Scored(src, mb, "grad", (2, "grad"), flagged, decision.reason, 2.0 if flagged else 0.1, decision)


def test_larger_last_stage_gradients_are_explained_by_the_row_s_data_and_only_those():
    """r1's flagged gradients are 1.3× its peers' (a loss on mismatched data): explained, no strike.
    r2's are flagged at its peers' size (flipped or noised): its own. A pair of an own-fault flag
    (a sanity failure) is never explained away."""
    scored = [grad(r, mb, {1: 1.3, 2: 1.0}.get(r, 1.0 + 0.01 * r), flagged=r in (1, 2)) for r in range(4)
              for mb in range(2)]
    scored.append(grad(1, 2, 1.3, flagged=True, reason="norm"))
    larger = data_explained(scored, stages=4, ratio=1.2)
    assert larger == {WorkerId(1, 3)}
    assert {e.decision.explained_by for e in scored if e.src == WorkerId(1, 3)} == {"r1s0 data", ""}
    assert all(not e.decision.explained_by for e in scored if e.src != WorkerId(1, 3))
    ledger = Ledger(VerifyConfig(name="sentinel", warmup_steps=0), MeshShape(replicas=4, stages=4))
    strikes = ledger.step_strikes(scored, set())
    assert strikes[WorkerId(1, 3)][0] == 1  # the norm failure alone: its own fault
    assert strikes[WorkerId(2, 3)][0] == 1  # its statistical flags, a majority: a strike


def test_the_ends_alert_needs_repeated_steps_and_comes_once():
    ledger = Ledger(VerifyConfig(name="sentinel", warmup_steps=0), MeshShape(replicas=4, stages=4))
    watch = EndsWatch(ledger)
    alerts = []
    for step in range(6):
        scored = [grad(r, mb, 1.3 if r == 1 else 1.0, flagged=r == 1) for r in range(4) for mb in range(2)]
        alerts += watch.enter(step, scored, data_explained(scored, stages=4, ratio=1.2))
    assert [(a.worker, a.step, a.cause) for a in alerts] == [(WorkerId(1, 3), 2, "ends")]
    state = watch.state_dict()
    again = EndsWatch(ledger)
    again.load_state_dict(state)
    assert again.history == watch.history


def test_a_decision_s_norm_survives_its_record():
    """The dist verifier's decisions reach the writer as records: the norm the rule compares too."""
    decision = grad(1, 0, 1.3, flagged=True).decision
    decision.distances, decision.thresholds = {"swd": 2.0}, {"swd": 1.0}
    assert decision_from_record(decision.record()) == decision
