"""The planner's shortcuts against the long way round: its steady state (a fill, then steps until
their durations repeat) equals a long simulation on every method row of a mesh deeper than a
step's microbatches, with the same binding resource; and its table does not depend on how many
processes run the simulations."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from meshlearn.config import load_config
from meshlearn.plan.cost import CostRun
from meshlearn.plan.methods import methods
from meshlearn.plan.planner import plan
from meshlearn.plan.presets import preset_overrides
from meshlearn.plan.steady import FAR, horizon, steady, with_gains

# 8 stages of 2 microbatches: steps finish in a pattern longer than one step (P > M), where a
# window of the horizon's few steps was up to 17% off the long-run mean.
DEEP = [*preset_overrides("demo"), "model.n_layer=8", "mesh.stages=8", "mesh.microbatches=2",
        "train.batch_size=16"]


@functools.cache
def slow(cfg, keep):
    """The long way: a fill of 16 steps past the horizon's, then 24 whole windows measured."""
    h = horizon(cfg)
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=keep)
    start = run.run(h.warm + 16)
    window = run.window(start, run.run(24 * h.window))
    return dataclasses.replace(steady(cfg, keep), tokens_per_s=window.tokens_per_s,
                               steady_tokens_per_s=window.tokens_per_s, window=window)


def _horizon_only(cfg, keep):
    """The shortcut the planner used before: the horizon's window, right after its fill."""
    h = horizon(cfg)
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=keep)
    start = run.run(h.warm)
    return run.window(start, run.run(h.window)).tokens_per_s


def test_steady_state_equals_the_long_run_on_every_row():
    cfg = load_config(None, DEEP)
    variants, _ = methods(cfg, 0, (0.05,))
    assert len(variants) == 16
    off = []
    for v in variants:
        fast, long = steady(v.cfg, v.mask_keep), slow(v.cfg, v.mask_keep)
        assert fast.tokens_per_s == pytest.approx(long.tokens_per_s, rel=1e-6), v.label
        assert fast.steps_simulated < horizon(v.cfg).warm + 16 + 24 * horizon(v.cfg).window
        if abs(_horizon_only(v.cfg, v.mask_keep) / long.tokens_per_s - 1) > 0.01:
            off.append(v.label)
    assert off  # this mesh does tell the shortcuts apart: the horizon's window alone misses


@pytest.mark.slow
def test_binding_resource_equals_the_long_run_on_every_row():
    cfg = load_config(None, DEEP)
    for v in methods(cfg, 0, (0.05,))[0]:
        fast = with_gains(v.cfg, steady(v.cfg, v.mask_keep), v.mask_keep)
        long = with_gains(v.cfg, slow(v.cfg, v.mask_keep), v.mask_keep, lookup=slow)
        assert fast.binds == long.binds, v.label
        for resource, gain in long.gains.items():
            assert fast.gains[resource] == pytest.approx(gain, rel=1e-6), (v.label, resource)


def test_table_is_the_same_on_two_processes():
    cfg = load_config(None, [*preset_overrides("demo"), "mesh.replicas=1"])
    one, two = plan(cfg, sweep=(100.0,), processes=1), plan(cfg, sweep=(100.0,), processes=2)
    assert (one["simulations"], two["processes"]) == (two["simulations"], 2)
    for key in ("planner_s", "processes"):
        one.pop(key), two.pop(key)
    assert one == two
