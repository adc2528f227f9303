"""Resuming continues exactly: N steps straight == N/2 steps, checkpoint, resume N/2 more."""

import json

from tiny import tiny_config

from meshlearn.train import Trainer


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_resume_reproduces_an_uninterrupted_run(tiny_corpus, tmp_path):
    overrides = ["mesh.stages=2", "mesh.replicas=2", "train.steps=6", "train.eval_every=2",
                 "link.jitter_ms=5", "link.loss_rate=0.1"]
    straight = tmp_path / "straight"
    Trainer(tiny_config(tiny_corpus, *overrides), straight, progress=False).train()

    split = tmp_path / "split"
    Trainer(tiny_config(tiny_corpus, *overrides, "train.stop_at_step=3"), split,
            progress=False).train()
    assert [r["step"] for r in records(split, "train")] == [1, 2, 3]
    # A crash after the checkpoint leaves records the resumed run must not duplicate.
    with (split / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 4, "train_loss": 9.9}) + "\n{partial")
    Trainer(tiny_config(tiny_corpus, *overrides, "train.stop_at_step=3"), split, resume=True,
            progress=False).train()

    a, b = records(straight, "train"), records(split, "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-6
        assert abs(ra["sim_time_s"] - rb["sim_time_s"]) <= 1e-9  # link randomness resumes too
        assert ra["bytes_pp"] == rb["bytes_pp"] and ra["bytes_dp"] == rb["bytes_dp"]
    va, vb = records(straight, "eval"), records(split, "eval")
    assert [r["val_loss"] for r in va] == [r["val_loss"] for r in vb]
    assert not list(split.glob(".*.tmp"))  # atomic writes leave no temporary files
