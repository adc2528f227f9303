"""``anchor.use = error_feedback`` (issue 29, 4(b)): the correction a fast worker adds is exactly the
anchor's clean gradient minus its own masked one of the same step (zero when nothing is masked),
it is added to the updates of one step, and kept gradients are freed (refusals: test_anchor.py)."""

from __future__ import annotations

import pytest
import torch
from test_anchor import FAST, unsplit_gradients, weights
from tiny import tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.optim.error_feedback import AnchorErrorFeedback
from meshlearn.train import Trainer

# One replica, 1F1B, no clip: step t's update used exactly the masked gradient of step t's batch
# on the weights step t began with, which is what a snapshot anchor computes its clean one on.
EF = ["anchor.z=1", "anchor.delay=2", "anchor.wire_dtype=fp32", "anchor.send=gradients",
      "anchor.weights=snapshot", "anchor.use=error_feedback", "mesh.replicas=1", "mesh.schedule=1f1b",
      "train.grad_clip=0"]


def first_correction(run: Trainer, wid: WorkerId) -> tuple[dict, dict]:
    """Step until the anchor's share for step 0 reached ``wid``: (its masked gradients of step 0,
    captured at the update, and the correction the feedback then holds)."""
    worker = run.workers[wid]
    feedback = worker.spectral.feedback
    captured = {}

    def capture(opt, args, kwargs) -> None:  # runs after the spectral pre-hook; at step 0 nothing
        for name, param in feedback.params.items():  # is corrected yet, so this is the raw gradient
            captured.setdefault(name, param.grad.detach().clone())

    handle = worker.optimizer.register_step_pre_hook(capture)
    run.step()
    handle.remove()
    assert 0 in feedback.kept
    while run.plugins["anchor"].counters.delivered == 0:
        assert run.totals.step < 2 + run.cfg.anchor.max_late
        run.step()
    return captured, dict(feedback.ready)


@pytest.mark.parametrize("stage", [0, 1])
def test_the_correction_is_the_clean_minus_the_masked_gradient(tiny_corpus, tmp_path, stage):
    run = Trainer(tiny_config(tiny_corpus, *FAST, *EF, "train.steps=6"), tmp_path / "run", progress=False)
    start = weights(run)
    masked, correction = first_correction(run, WorkerId(0, stage))
    oracle = unsplit_gradients(run, start, step=0)
    assert sorted(correction) == sorted(masked) and len(correction) == 2 * 7  # 2 blocks × 7 matrices
    for name, c in correction.items():
        torch.testing.assert_close(c, oracle[name] - masked[name], rtol=1e-5, atol=1e-7)
        assert c.norm() > 0.1 * oracle[name].norm(), name  # the mask's error is not small
    assert list(run.workers[WorkerId(0, stage)].spectral.feedback.kept) == [2]  # step 0's freed


def test_nothing_masked_gives_a_zero_correction(tiny_corpus, tmp_path):
    """The identity codec on the fast circuit: its gradient is the anchor's, so c = 0 (to rounding)."""
    run = Trainer(tiny_config(tiny_corpus, *FAST, *EF, "codec.name=identity", "train.steps=6"),
                  tmp_path / "run", progress=False)
    masked, correction = first_correction(run, WorkerId(0, 1))
    assert len(correction) == 2 * 7
    for name, c in correction.items():
        assert c.abs().max() <= 1e-6 * masked[name].abs().max(), name


@pytest.mark.parametrize("arrives", [(2, 0), (1, 1)])
def test_the_correction_is_added_to_every_update_of_one_step_only(arrives):
    """Async-like: two updates per step. The kept gradient is the mean over step 0's updates; the
    correction is added to both updates of the first step that starts after it arrives (step 2,
    whether it arrives before step 2 or in the middle of step 1), to no other."""
    param = torch.nn.Parameter(torch.zeros(2, 3))
    feedback = AnchorErrorFeedback({"w": param}, every=2, horizon=4)
    grads = {0: [1.0, 3.0], 1: [5.0, 5.0], 2: [10.0, 20.0], 3: [7.0, 7.0]}
    seen = {}
    for step, values in grads.items():
        for i, value in enumerate(values):
            if (step, i) == arrives:
                clean = torch.full((2, 3), 4.0)
                assert feedback.receive("w", clean, step=0)  # c = 4 − mean(1, 3) = 2
                assert 0 not in feedback.kept
            param.grad = torch.full((2, 3), value)
            feedback.before_update(step)
            seen[step, i] = float(param.grad[0, 0])
    assert seen == {(0, 0): 1.0, (0, 1): 3.0, (1, 0): 5.0, (1, 1): 5.0, (2, 0): 12.0, (2, 1): 22.0,
                    (3, 0): 7.0, (3, 1): 7.0}
    assert feedback.summary()["ef_corrections"] == 1 and feedback.summary()["ef_applied_updates"] == 2
    assert list(feedback.kept) == [2]  # step 2's own gradients (10, 20 before the correction)
    kept = feedback.kept[2]
    torch.testing.assert_close(kept.sums["w"] / kept.updates, torch.full((2, 3), 15.0))


def test_kept_gradients_are_freed_when_dropped_or_past_the_horizon():
    param = torch.nn.Parameter(torch.zeros(4))
    feedback = AnchorErrorFeedback({"w": param}, every=2, horizon=3)
    for step in range(9):
        param.grad = torch.ones(4)
        feedback.before_update(step)
        assert len(feedback.kept) <= 3 // 2 + 1
        if step == 2:
            feedback.forget(2)
    assert sorted(feedback.kept) == [6, 8]  # 0 and 4 past the horizon, 2 forgotten
    assert feedback.summary()["ef_forgotten"] == 3
    assert not feedback.receive("w", torch.ones(4), step=4)  # nothing kept for it any more
    assert feedback.summary()["ef_unmatched"] == 1 and feedback.held_bytes == 2 * 4 * 4


def test_a_dropped_share_frees_what_the_worker_kept(tiny_corpus, tmp_path):
    """Anchor links at 5 Mbit/s with no grace: every share misses its due step and is dropped; each
    worker frees the gradient it kept for it, and nothing is ever corrected."""
    run = Trainer(tiny_config(tiny_corpus, *FAST, *EF, "train.steps=8", "anchor.bandwidth_mbit=5",
                              "anchor.max_late=0"), tmp_path / "run", progress=False)
    summary = run.train()
    assert summary["anchor_delivered"] == 0 and summary["anchor_dropped_late"] == 4 * 2  # t = 0, 2, 4, 6
    assert summary["ef_forgotten"] == summary["anchor_dropped_late"] and summary["ef_corrections"] == 0
    assert summary["ef_applied_updates"] == 0
    for worker in run.workers.values():
        assert worker.spectral.feedback.kept == {}
