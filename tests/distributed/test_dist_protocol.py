"""Morphs in real processes: each process morphs its own worker, the boundary transform travels to
the next stage's process as a ``morph`` message, and the run reproduces the simulator's (which in
turn trains like the run without morphs, tests/protocol)."""

from __future__ import annotations

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.statefile import load_state
from meshlearn.train import Trainer


@pytest.mark.parametrize("shape", [["mesh.schedule=1f1b", "dp.name=allreduce"],
                                   ["mesh.schedule=async", "dp.name=powersgd", "dp.rank=2"]],
                         ids=["1f1b", "async-powersgd"])
def test_dist_morphs_equal_sim_morphs(tiny_corpus, tmp_path, shape):
    cfg = tiny_config(tiny_corpus, *shape, "mesh.stages=2", "mesh.replicas=2", "mesh.microbatches=2",
                      "optim.name=muon", "protocol.morph=orthogonal", "protocol.every_steps=2",
                      "protocol.keep_snapshots=0", "train.steps=6", "train.eval_every=2")
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(90, "the P=2 D=2 dist run with morphs"):
            assert launch(cfg, tmp_path / "dist") == 0, (tmp_path / "dist" / "logs").iterdir()
    finally:
        kill_leftovers(tmp_path / "dist")
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) <= 1e-5
    # The transforms are charged on the pipeline links alike (in the step after each morph).
    assert a[-1]["bytes_pp"] == b[-1]["bytes_pp"]
    va, vb = records(tmp_path / "sim", "eval"), records(tmp_path / "dist", "eval")
    assert max(abs(x["val_loss"] - y["val_loss"]) for x, y in zip(va, vb, strict=True)) <= 1e-5
    ma = [(r["step"], r["transforms"], r["morph_bytes"]) for r in records(tmp_path / "sim", "event")
          if r["event"] == "protocol_morph"]
    mb = [(r["step"], r["transforms"], r["morph_bytes"]) for r in records(tmp_path / "dist", "event")
          if r["event"] == "protocol_morph"]
    assert ma == mb and [m[0] for m in ma] == [2, 4, 6]
    # The same transforms, drawn by each stage's own process: the stages' weights are the
    # simulator's, in the basis of epoch 3 (the boundary stage's writers and skips changed).
    sim = load_state(tmp_path / "sim" / "checkpoint.pt")["workers"]
    for w in ("r0s0", "r1s1"):
        path = next((tmp_path / "dist" / "checkpoints").glob(f"step-*/{w}.pt"))
        shard = load_state(path)
        ours, theirs = shard["workers"][w]["module"], sim[w]["module"]
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-5
    start = tiny_config(tiny_corpus, *shape, "mesh.stages=2", "mesh.replicas=2", "protocol.morph=none")
    plain = Trainer(start, tmp_path / "init", progress=False).workers
    skip = plain[WorkerId(1, 1)].module.state_dict()["layers.2.attn_skip"]
    assert float((shard["workers"]["r1s1"]["module"]["layers.2.attn_skip"] - skip).abs().max()) > 0.5
