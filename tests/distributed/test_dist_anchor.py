"""The anchor circuit under dist: Z × P anchor processes of their own reproduce the simulator's
anchored run, and anchor links far slower than the mesh never delay the fast circuit."""

from __future__ import annotations

import json

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.entry.launch import launch_local
from meshlearn.errors import ConfigError
from meshlearn.train import Trainer

# A masked fast circuit (keep 1/4) on P = 2, D = 2, 1F1B; the fast links are slow (50 ms) so that
# K = 2 steps give the anchor's pass (fast links of its own) a wide margin to arrive in time.
FAST = ["mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b", "codec.name=mask", "codec.keep=0.25",
        "optim.spectral.enabled=true", "link.latency_ms=50", "train.steps=6", "train.eval_every=6"]
ANCHOR = ["anchor.z=1", "anchor.delay=2", "anchor.max_late=2", "anchor.wire_dtype=fp32",
          "anchor.send=gradients", "anchor.weights=snapshot"]


def run_both(cfg, tmp_path, what: str):
    sim = Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(90, what):
            assert launch(cfg, tmp_path / "dist") == 0, sorted((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    return sim, json.loads((tmp_path / "dist" / "summary.json").read_text())


@pytest.mark.parametrize(("send", "links"),
                         [("gradients", "auto"), ("factors", "auto"), ("gradients", "tcp")])
def test_an_anchored_dist_run_equals_the_sim_run(tiny_corpus, tmp_path, send, links):
    """Passes at t = 0, 2, 4 each reach all four fast workers by K = 2 steps later (the anchor
    links are unshaped), in both drivers: the corrected losses, norms and bytes are the
    simulator's; the anchor's bytes (snapshots with batch ids, its boundaries, its gradients or
    its factors: rank 3, below min(m, n) = 32, from the EMA the anchor stage keeps) too. Over
    collective links (auto: the run has no verifier) and over our own TCP links."""
    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.bandwidth_mbit=10000", "anchor.latency_ms=0",
                      f"anchor.send={send}", "anchor.rank=3", f"dist.links={links}")
    sim, dist = run_both(cfg, tmp_path, "the anchored P=2 D=2 dist run")
    for summary in (sim, dist):
        assert summary["anchor_passes"] == 3
        assert summary["anchor_delivered"] == 3 * 4 and summary["anchor_pending_at_end"] == 0
        assert summary["anchor_mean_staleness"] == 2 and summary["anchor_dropped_late"] == 0
        assert summary["spectral_anchor_accepted"] > 0 and summary["spectral_corrected_steps"] > 0
    for key in ("anchor_bytes_snapshot", "anchor_bytes_boundary", "anchor_bytes_gradients",
                "anchor_bytes_factors", "spectral_anchor_accepted", "spectral_corrected_steps"):
        assert sim[key] == dist[key], key
    assert (sim["anchor_bytes_factors"] > 0) == (send == "factors") != (sim["anchor_bytes_gradients"] > 0)
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
        assert (ra["bytes_pp"], ra["bytes_dp"]) == (rb["bytes_pp"], rb["bytes_dp"])
    (va,), (vb,) = records(tmp_path / "sim", "eval"), records(tmp_path / "dist", "eval")
    assert abs(va["val_loss"] - vb["val_loss"]) <= 1e-5
    # The correction changed the run: without the anchor the losses differ after the first fold-in.
    plain = Trainer(tiny_config(tiny_corpus, *FAST), tmp_path / "plain", progress=False)
    plain.train()
    assert max(abs(ra["train_loss"] - rp["train_loss"])
               for ra, rp in zip(a, records(tmp_path / "plain"), strict=True)) > 1e-4


def test_slow_anchor_links_never_delay_the_fast_circuit(tiny_corpus, tmp_path):
    """Anchor links at 0.01 Mbit/s (a stage's snapshot takes minutes to arrive) and no grace
    (max_late = 0): the fast processes finish without waiting for any of it, every share is
    dropped, and their run is the anchor-free simulator run (a correction with no arrival is the
    base optimizer, bit for bit)."""
    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.bandwidth_mbit=0.01", "anchor.max_late=0")
    try:
        with deadline(90, "the slow-anchor P=2 D=2 dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, sorted((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    dist = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert dist["anchor_delivered"] == 0 and dist["anchor_passes"] == 0
    assert dist["anchor_dropped_late"] == 3 * 4 and dist["anchor_pending_at_end"] == 0
    assert dist["spectral_anchor_accepted"] == 0
    plain = Trainer(tiny_config(tiny_corpus, *FAST), tmp_path / "plain", progress=False)
    plain.train()
    a, b = records(tmp_path / "plain"), records(tmp_path / "dist")
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert (ra["bytes_pp"], ra["bytes_dp"]) == (rb["bytes_pp"], rb["bytes_dp"])


@pytest.mark.parametrize("dp", ["allreduce", "diloco"])
def test_outer_weights_the_anchor_follows_by_listening_equal_the_sim_run(tiny_corpus, tmp_path, dp):
    """``anchor.weights = outer`` in real processes: no weights travel at the hand-off (only the
    batch ids), every anchor stage follows the weights its stage's replicas agree on from fast
    replica 0's relays (the live ones under the all-reduce, streaming DiLoCo's outer weights), so
    the anchor computes on what the simulator's computes on: the corrected losses are the
    simulator's, and so are the relayed bytes (every parameter changes at every all-reduce,
    uncompressed DiLoCo's outer weights at each sync: the reduced result's size either way)."""
    dp_keys = ["dp.name=diloco", "dp.inner_steps=2"] if dp == "diloco" else []
    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.weights=outer", "anchor.bandwidth_mbit=10000",
                      "anchor.latency_ms=0", *dp_keys)
    sim, dist = run_both(cfg, tmp_path, f"the anchored P=2 D=2 dist run, outer weights under {dp}")
    for summary in (sim, dist):
        assert summary["anchor_passes"] == 3 and summary["anchor_delivered"] == 3 * 4
        assert summary["anchor_bytes_listen"] > 0
    ids = 3 * 2 * 8 * cfg.train.batch_size // 2  # three passes, two end stages, 8 B per sequence
    assert sim["anchor_bytes_snapshot"] == dist["anchor_bytes_snapshot"] == ids
    assert sim["anchor_bytes_listen"] == dist["anchor_bytes_listen"]
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]


def test_resuming_an_anchored_dist_run_is_refused_before_any_process_starts(tiny_corpus, tmp_path):
    """Its passes in flight are in no checkpoint: one line from the launcher, no process spawned
    (before, every worker refused on its own and the launcher reported a failure without a cause)."""
    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "backend=dist")
    with pytest.raises(ConfigError, match=r"anchor circuit \(anchor.z > 0\) cannot resume yet"):
        launch_local(["--resume", str(tmp_path)], cfg, tmp_path)
    assert not (tmp_path / "logs").exists()


def test_an_error_feedback_dist_run_equals_the_sim_run(tiny_corpus, tmp_path):
    """``anchor.use = error_feedback`` (3 passes × 4 workers × 2 blocks × 7 matrices): each fast
    process keeps its own gradient of the handed-off steps and adds the anchor's correction,
    exactly as the simulator's workers do."""
    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.bandwidth_mbit=10000", "anchor.latency_ms=0",
                      "anchor.use=error_feedback")
    sim, dist = run_both(cfg, tmp_path, "the error-feedback P=2 D=2 dist run")
    for summary in (sim, dist):
        assert summary["anchor_delivered"] == 3 * 4 and summary["ef_unmatched"] == 0
        assert summary["ef_corrections"] == 3 * 4 * 2 * 7 and summary["spectral_anchor_accepted"] == 0
    for key in ("ef_corrections", "ef_applied_updates", "ef_forgotten", "anchor_bytes_gradients"):
        assert sim[key] == dist[key], key
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["train_loss"] - rb["train_loss"]) <= 1e-5
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-5 * ra["grad_norm"]
