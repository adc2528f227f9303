"""One mirror replica row (``plan.mirror``) equals the whole mesh simulated: on every method row
(dense, subspace, mask × sync, async × all-reduce, sparse, PowerSGD, DiLoCo) of a 3-replica mesh,
and over a whole run with its drain points; and a mesh whose replicas are not mirror images (one
slow participant) is simulated whole, because its row alone would be wrong."""

from __future__ import annotations

import pytest

from meshlearn.config import load_config
from meshlearn.plan import cost
from meshlearn.plan.cost import CostRun
from meshlearn.plan.methods import methods, subspace_rank
from meshlearn.plan.mirror import mirrors
from meshlearn.plan.presets import preset_overrides
from meshlearn.plan.steady import FAR, horizon, predict, steady

# 3 replicas (the ring all-reduce has more than one hop, a DP round more than one peer), untied
# (subspace rows), P = 4 > M = 2 (steps end in a pattern), slow enough links that DP traffic binds.
MESH = [*preset_overrides("demo"), "model.n_layer=4", "model.tie_embeddings=false", "mesh.stages=4",
        "mesh.replicas=3", "mesh.microbatches=2", "train.batch_size=12", "link.bandwidth_mbit=50",
        "dp.every=2", "dp.delay=2", "dp.inner_steps=3"]
SLOW = "r1s1->*: bandwidth_mbit=5; *->r1s1: bandwidth_mbit=5"


def _numbers(p) -> list[float]:
    w = p.window
    return [p.tokens_per_s, w.bytes_pp, w.bytes_dp, w.idle_fraction, w.compute_share, w.pp_link_share,
            w.dp_link_share, p.steps_simulated, p.memory.total, p.stash_versions, p.in_flight_peak]


def test_one_row_equals_the_whole_mesh_on_every_method():
    cfg = load_config(None, MESH)
    variants, skipped = methods(cfg, subspace_rank(cfg, 0), (0.05,))
    labels = {v.label for v in variants}
    assert len(variants) == 24, skipped  # 3 boundaries × 2 schedules × 4 DP strategies
    assert {"subspace k=8 · 1f1b · diloco", "mask keep=0.05 · async · powersgd"} <= labels
    for v in variants:
        assert CostRun(v.cfg, FAR, drain_at=FAR, mask_keep=v.mask_keep).mirrored, v.label
        row, whole = steady(v.cfg, v.mask_keep), steady(v.cfg, v.mask_keep, mirror=False)
        assert whole.window.bytes_dp > 0, v.label
        assert _numbers(row) == pytest.approx(_numbers(whole), rel=1e-6), v.label


@pytest.mark.parametrize("extra", [["mesh.schedule=async", "dp.name=sparse"],
                                   ["mesh.schedule=gpipe", "dp.name=powersgd"]])
def test_one_row_equals_the_whole_mesh_over_a_whole_run(extra):
    """``predict``: fill, the measured steps, the drain, segments between drain points."""
    cfg = load_config(None, [*MESH, *extra, "train.steps=40", "train.eval_every=15"])
    assert cfg.train.steps > horizon(cfg).steps  # not simulated whole: the extrapolation runs
    row, whole = predict(cfg), predict(cfg, mirror=False)
    assert not row.whole_run
    assert _numbers(row) + [row.overhead_s] == pytest.approx(_numbers(whole) + [whole.overhead_s], rel=1e-6)


def test_replicas_that_differ_are_simulated_whole(monkeypatch):
    cfg = load_config(None, [*MESH, "mesh.schedule=async", "dp.name=sparse", f"links.overrides={SLOW}"])
    assert not mirrors(cfg) and not CostRun(cfg, FAR, drain_at=FAR).mirrored
    assert not mirrors(load_config(None, [*MESH, "link.jitter_ms=1"]))
    assert steady(cfg) == steady(cfg, mirror=False)
    # The control: mirrored anyway, replica 0's row misses replica 1's slow stage.
    monkeypatch.setattr(cost, "mirrors", lambda c: True)
    assert CostRun(cfg, FAR, drain_at=FAR).mirrored
    wrong = steady.__wrapped__(cfg)
    assert abs(wrong.tokens_per_s / steady(cfg, mirror=False).tokens_per_s - 1) > 0.05
