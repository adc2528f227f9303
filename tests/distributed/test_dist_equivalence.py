"""DistDriver == SimDriver: real processes over gloo reproduce the simulator's run of the same config.

Same seeds, synchronous schedules, identity codec: every train loss, the validation loss, the bytes
on both axes and the gradient norms must match the simulator's (the simulator in turn matches the
unsplit model, tests/mesh/test_equivalence.py). Links are shaped in the senders (10 ms, 100 Mbit/s).
"""

from __future__ import annotations

from collections import Counter

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.report.records import read_timeline
from meshlearn.train import Trainer


def sim_run(cfg, run_dir):
    Trainer(cfg, run_dir, progress=False).train()
    return run_dir


@pytest.mark.parametrize(("stages", "replicas", "schedule"), [
    (2, 2, "1f1b"),
    (4, 2, "gpipe"),
    (4, 2, "1f1b"),
])
def test_dist_run_equals_sim_run(tiny_corpus, tmp_path, stages, replicas, schedule):
    cfg = tiny_config(tiny_corpus, f"mesh.stages={stages}", f"mesh.replicas={replicas}",
                      f"mesh.schedule={schedule}", "train.steps=5", "train.eval_every=5")
    sim = sim_run(cfg, tmp_path / "sim")
    try:
        with deadline(60, f"the P={stages} D={replicas} dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, (tmp_path / "dist" / "logs").iterdir()
    finally:
        kill_leftovers(tmp_path / "dist")

    a, b = records(sim), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) <= 1e-5
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
        assert (ra["bytes_pp"], ra["bytes_dp"]) == (rb["bytes_pp"], rb["bytes_dp"])  # same accounting
        assert "sim_time_s" not in rb  # a real run logs no virtual clock
    (va,), (vb,) = records(sim, "eval"), records(tmp_path / "dist", "eval")
    assert abs(va["val_loss"] - vb["val_loss"]) <= 1e-5
    # The pipeline timeline (report.timeline_steps = auto: steps 2 and 3): one file per process,
    # holding the same computes and transfers as the simulator's record.
    assert len(list((tmp_path / "dist").glob("timeline.r*s*.json"))) == stages * replicas
    sim_timeline, dist_timeline = read_timeline(sim), read_timeline(tmp_path / "dist")
    assert sim_timeline["steps"] == dist_timeline["steps"] == [2, 3]
    assert dist_timeline["clock"] == "wall" and dist_timeline["workers"] == sim_timeline["workers"]
    assert _what_happened(dist_timeline) == _what_happened(sim_timeline)


def _what_happened(timeline: dict) -> Counter:
    return Counter((e["kind"], e.get("what"), e["worker"], e.get("dst"), e["step"])
                   for e in timeline["events"])


def test_mask_codec_dist_run_equals_sim_run(tiny_corpus, tmp_path):
    """The mask codec in real processes: each end regenerates every mask on its own (nothing but
    the kept values crosses), so losses, norms, bytes and the validation losses, unmasked and
    masked as in training (``val_loss_masked``), are the simulator's."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b",
                      "codec.name=mask", "codec.keep=0.25", "train.steps=3", "train.eval_every=3")
    sim = sim_run(cfg, tmp_path / "sim")
    try:
        with deadline(60, "the mask-codec P=2 D=2 dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, (tmp_path / "dist" / "logs").iterdir()
    finally:
        kill_leftovers(tmp_path / "dist")
    a, b = records(sim), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
        assert (ra["bytes_pp"], ra["bytes_dp"]) == (rb["bytes_pp"], rb["bytes_dp"])
    micro = cfg.train.batch_size // 2 // cfg.mesh.microbatches
    kept = micro * cfg.model.seq_len * round(0.25 * cfg.model.d_model) * 2  # bf16 values per message
    assert b[0]["bytes_pp"] == 2 * 2 * cfg.mesh.microbatches * kept  # replicas × directions × M
    (va,), (vb,) = records(sim, "eval"), records(tmp_path / "dist", "eval")
    assert abs(va["val_loss"] - vb["val_loss"]) <= 1e-5
    assert abs(va["val_loss_masked"] - vb["val_loss_masked"]) <= 1e-5
    assert abs(vb["val_loss_masked"] - vb["val_loss"]) > 1e-3  # the masks were on in one pass only


def test_async_dist_run_equals_sim_run(tiny_corpus, tmp_path):
    """The async schedule in real processes: no per-step collective (reports are gathered at the
    drain points, here eval and the end), the same losses, norms and staleness as the simulator."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=4", "mesh.replicas=2", "mesh.schedule=async",
                      "mesh.microbatches=2", "train.steps=6", "train.eval_every=3")
    sim = sim_run(cfg, tmp_path / "sim")
    try:
        with deadline(60, "the async P=4 D=2 dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, (tmp_path / "dist" / "logs").iterdir()
    finally:
        kill_leftovers(tmp_path / "dist")
    a, b = records(sim), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
        assert ra["staleness"] == rb["staleness"]
        assert ra["tokens"] == rb["tokens"]
    # Bytes are counted per process between its own step ends, so only totals at a drain agree.
    assert (a[-1]["bytes_pp"], a[-1]["bytes_dp"]) == (b[-1]["bytes_pp"], b[-1]["bytes_dp"])
    assert [r["val_loss"] for r in records(sim, "eval")] == pytest.approx(
        [r["val_loss"] for r in records(tmp_path / "dist", "eval")], abs=1e-5)
