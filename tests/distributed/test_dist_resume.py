"""A dist run stopped (train.stop_at_step, or a worker SIGKILLed) and resumed reaches its evaluations
and finishes with the simulator's losses.

The shapes are chosen so that an evaluation message (a whole validation batch) is larger than a
training receive buffer (one microbatch): a receive posted for training that an evaluation batch
meets aborts the receiving process inside gloo, which is what a resume used to do (it fed, and
posted the receives of, every step from 0 again).
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from test_dist_failure import pid_of, start_in_background, wait_for
from tiny import tiny_config

from meshlearn.checkpoint_layout import latest_complete
from meshlearn.distributed.wire import HEADER_ROOM
from meshlearn.train import Trainer

# 16 sequences of 64 positions, width 32: an evaluation batch exceeds a microbatch's receive buffer.
SHAPE = ["mesh.stages=2", "model.n_layer=2", "model.seq_len=64", "train.batch_size=16",
         "mesh.microbatches=2", "train.eval_batches=1"]


def resume_config(corpus, schedule: str, replicas: int, *sets: str):
    cfg = tiny_config(corpus, *SHAPE, f"mesh.schedule={schedule}", f"mesh.replicas={replicas}", *sets)
    micro = cfg.train.batch_size // replicas // cfg.mesh.microbatches
    per_sequence = cfg.model.seq_len * (4 * cfg.model.d_model + 8)
    # What makes a stray training receive fatal to an evaluation (distributed/wire.py's capacities).
    assert (cfg.train.batch_size - micro) * per_sequence > HEADER_ROOM
    return cfg


def simulated(cfg, run_dir):
    """The uninterrupted simulator run of ``cfg`` (to train.steps, through the same drain points)."""
    straight = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at_step=0))
    Trainer(straight, run_dir, progress=False).train()
    return run_dir


def assert_same_run(sim, run) -> None:
    a, b = records(sim), records(run)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) <= 1e-5
    evals = [(r["step"], r["val_loss"]) for r in records(sim, "eval")]
    got = [(r["step"], r["val_loss"]) for r in records(run, "eval")]
    assert [s for s, _ in got] == [s for s, _ in evals]
    assert [v for _, v in got] == pytest.approx([v for _, v in evals], abs=1e-5)


@pytest.mark.parametrize(("schedule", "replicas"), [
    ("1f1b", 2),
    pytest.param("1f1b", 1, marks=pytest.mark.slow),
    ("async", 1),
    pytest.param("async", 2, marks=pytest.mark.slow),
])
def test_a_run_stopped_before_its_first_evaluation_resumes_through_its_evaluations(
        tiny_corpus, tmp_path, schedule, replicas):
    cfg = resume_config(tiny_corpus, schedule, replicas, "train.steps=8", "train.eval_every=6",
                        "train.checkpoint_every=3", "train.stop_at_step=3")
    run, out = tmp_path / "run", io.StringIO()
    try:
        with deadline(90, f"the {schedule} D={replicas} run stopped at step 3 and its resume"):
            assert launch(cfg, run, out=out) == 0, out.getvalue()[-2000:]
            assert records(run, "eval") == []  # stopped before the first evaluation
            closing = out.getvalue().splitlines()[-1]
            assert closing.startswith("stopped at step 3 of 8 (train.stop_at_step = 3) with a checkpoint, "
                                      "no validation yet"), closing
            assert closing.endswith(f"continue with: meshlearn train --resume {run}")
            out = io.StringIO()
            assert launch(cfg, run, resume=True, out=out) == 0, out.getvalue()[-2000:]
            assert out.getvalue().splitlines()[-1].startswith("done: 8 steps, val loss ")
    finally:
        kill_leftovers(run)
    assert_same_run(simulated(cfg, tmp_path / "sim"), run)


@pytest.mark.slow  # about 20 s: a run killed, the failure detected (3 s), the resume
@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_a_run_resumed_after_a_sigkill_reaches_its_evaluations(tiny_corpus, tmp_path, capsys, schedule):
    cfg = resume_config(tiny_corpus, schedule, 2, "train.steps=30", "train.eval_every=10",
                        "train.checkpoint_every=3")
    run = tmp_path / "run"
    try:
        with deadline(120, f"the {schedule} run killed after checkpoint 3 and its resume"):
            thread, result = start_in_background(cfg, run, "dist.dead_after_s=3")
            wait_for(run / "checkpoints" / "step-000003" / "manifest.json", 60)
            os.kill(pid_of(run, "r0s1"), signal.SIGKILL)
            thread.join()
            assert result["code"] == 1
            resumed_from = int(latest_complete(run).name.removeprefix("step-"))
            assert resumed_from < 30 - cfg.train.eval_every  # an evaluation is still ahead
            assert launch(cfg, run, resume=True) == 0, capsys.readouterr().err[-2000:]
    finally:
        kill_leftovers(run)
    assert_same_run(simulated(cfg, tmp_path / "sim"), run)
