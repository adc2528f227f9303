"""The anchor circuit in the planner: a cost-only anchored run equals the real simulator's (the
trainer's anchor plugin, real passes) on the virtual clock and in every anchor byte; its traffic
on fast (0, s)'s uplink slows the fast circuit; a slow anchor is reported as not keeping up."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlearn.config import load_config
from meshlearn.plan.cost import simulate
from meshlearn.plan.planner import plan
from meshlearn.plan.steady import steady
from meshlearn.plan.table import format_table
from meshlearn.train import Trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the shipped configs, from any cwd
DEMO = str(CONFIGS / "demo.toml")

SHORT = ["train.steps=4", "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=0"]
ANCHOR = ["optim.spectral.enabled=true", "anchor.z=1", "anchor.delay=2"]
TERMS = ("snapshot", "boundary", "gradients", "factors", "listen")


@pytest.mark.parametrize("extra", [
    ["links.access=uplink"],  # factors, outer weights (the relay on fast (0, s)'s uplink)
    ["links.access=uplink", "anchor.weights=snapshot", "anchor.send=gradients", "mesh.schedule=async"],
    ["mesh.schedule=async", "dp.name=diloco", "dp.inner_steps=2", "anchor.bandwidth_mbit=20"],
    ["anchor.weights=snapshot", "anchor.send=gradients", "anchor.use=error_feedback", "mesh.schedule=async"],
], ids=["uplink-outer-factors", "uplink-snapshot-gradients-async", "async-diloco-slow-anchor",
        "snapshot-error-feedback-async"])
def test_cost_only_anchor_equals_real_simulator(tmp_path, extra):
    cfg = load_config(DEMO, [*SHORT, *ANCHOR, *extra])
    trainer = Trainer(cfg, tmp_path, progress=False)
    summary = trainer.train()
    run, window = simulate(trainer.cfg, trainer.cfg.train.steps)
    assert window.tokens_per_s == pytest.approx(summary["sim_tokens_per_s"], rel=1e-9)
    assert window.bytes_pp / window.tokens == pytest.approx(summary["bytes_per_token_pp"], rel=1e-12)
    assert window.bytes_dp / window.tokens == pytest.approx(summary["bytes_per_token_dp"], rel=1e-12)
    anchor, real = run.anchor, trainer.plugins["anchor"]
    for term in TERMS:  # every anchor byte, by the circuit's own accounting
        assert getattr(anchor.circuit.bytes, term) == summary[f"anchor_bytes_{term}"], term
    assert window.anchor.bytes_per_token == pytest.approx(summary["bytes_per_token_anchor"], rel=1e-12)
    assert anchor.circuit.busy_s == pytest.approx(real.circuit.busy_s, rel=1e-12)
    assert anchor.circuit.clock == pytest.approx(real.circuit.clock, rel=1e-12)
    assert window.anchor.passes == summary["anchor_passes"] == 2  # t = 0, 2
    assert window.anchor.delivered == summary["anchor_delivered"]
    assert window.anchor.dropped_late == summary["anchor_dropped_late"]
    assert window.anchor.late_max == summary["anchor_max_late_steps"]
    assert [(d.step, d.worker, d.arrival_s) for d in anchor.pending] == [
        (d.step, d.worker, d.arrival_s) for d in real.pending]


def _fast(extra: list[str]):
    cfg = load_config(DEMO, ["model.vocab_size=256", *SHORT, *extra])
    return simulate(cfg, cfg.train.steps)[1]


def test_the_anchor_slows_the_fast_circuit_only_through_a_shared_uplink():
    """Per-link queues: the anchor's hand-off and relay leave on links of their own, so the fast
    circuit's time is the same with and without it. One uplink per participant: fast (0, s)'s
    relay (and under snapshot its weights) wait behind, and delay, its PP and DP sends."""
    spectral = ["optim.spectral.enabled=true"]
    assert _fast([*spectral, *ANCHOR]).tokens_per_s == _fast(spectral).tokens_per_s
    uplink = ["links.access=uplink"]
    without = _fast([*spectral, *uplink]).tokens_per_s
    outer = _fast([*spectral, *ANCHOR, *uplink])
    snapshot = _fast([*spectral, *ANCHOR, *uplink, "anchor.weights=snapshot"])
    assert snapshot.tokens_per_s < without and outer.tokens_per_s < without
    assert outer.anchor.keeps_up and outer.anchor.bytes_per_token > 0


def test_a_slow_anchor_is_reported_as_not_keeping_up():
    base = ["model.vocab_size=256", "mesh.schedule=async", *ANCHOR, "anchor.max_late=0"]
    cfg = load_config(DEMO, base)
    fast = steady(cfg).window.anchor
    assert fast.keeps_up and fast.dropped_late == 0 and fast.late_max == 0
    slow = steady(load_config(DEMO, [*base, "anchor.bandwidth_mbit=2"])).window.anchor
    assert not slow.keeps_up and slow.dropped_late > 0 and slow.delivered == 0
    assert slow.passes == fast.passes > 0  # the same window: whole hand-off periods


def test_the_planner_reports_the_anchor_on_every_row():
    cfg = load_config(DEMO, ["model.vocab_size=256", "mesh.replicas=1", *ANCHOR,
                                            "anchor.weights=snapshot", "links.access=uplink"])
    result = plan(cfg, sweep=())
    rows = [result["given"], *result["methods"]]
    assert len(rows) > 2 and all(r["anchor"]["keeps_up"] and r["anchor"]["bytes_per_token"] > 0 for r in rows)
    assert "anchor B/tok" in format_table(result) and "keeps up" in format_table(result)
    plain = plan(load_config(DEMO, ["model.vocab_size=256", "mesh.replicas=1"]), sweep=())
    assert "anchor" not in plain["given"] and "anchor B/tok" not in format_table(plain)


def test_a_hand_off_period_longer_than_half_the_search_is_one_window():
    """K = 50 (the paper's longest ablation): the steady window is one whole hand-off period,
    longer than half of plan.steady.MAX_STEPS (before: a window of 0 steps, a division by zero)."""
    cfg = load_config(DEMO, ["model.vocab_size=256", "mesh.schedule=async", *ANCHOR,
                                            "anchor.delay=50", "optim.spectral.max_staleness=60"])
    window = steady(cfg).window
    assert window.steps == 50 and window.anchor.passes == 1 and window.anchor.keeps_up
