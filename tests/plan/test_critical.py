"""The binding resource from one simulation's critical path (``plan.critical``): the seconds that
carry their parts change no number of the simulation, their parts add up to the time, and the
resource they name is the one doubling names, on shapes where each resource binds."""

from __future__ import annotations

import dataclasses

import pytest

from meshlearn.config import load_config
from meshlearn.mesh.network import LinkProfile
from meshlearn.plan.critical import PARTS, Seconds, SensitiveProfile
from meshlearn.plan.methods import methods
from meshlearn.plan.presets import preset_overrides
from meshlearn.plan.steady import predict, steady, with_gains, with_path

DEMO = [*preset_overrides("demo"), "train.steps=40", "train.eval_every=20"]


def test_seconds_carry_their_parts():
    compute, link = Seconds.of(2.0, "compute"), Seconds.of(0.5, "PP link")
    latency = Seconds.of(0.25, "latency")
    t = max(compute + latency, link) + 3 * link - 1.0 + 0.5  # a constant moves the value, not the parts
    assert float(t) == 3.25
    assert dict(zip(PARTS, t.g, strict=True)) == {"compute": 2.0, "PP link": 1.5, "DP link": 0.0,
                                                  "latency": 0.25, "update": 0.0}
    assert t.shares()["other"] == pytest.approx(-0.5 / 3.25)
    assert type(t / t) is float and type(t * t) is float  # no time: plain numbers
    assert (t / 2).g == tuple(x / 2 for x in t.g)



def test_a_profile_s_kept_seconds_are_its_own():
    """The per-size seconds a SensitiveProfile keeps are not carried into a copy with another
    bandwidth (``dataclasses.replace``), which would time its transfers at the old one's."""
    slow = SensitiveProfile(bandwidth_mbit=8.0, latency_ms=0.0)
    assert float(slow.serialization_s(1000)) == LinkProfile(8.0, 0.0).serialization_s(1000)
    fast = dataclasses.replace(slow, bandwidth_mbit=80.0)
    assert float(fast.serialization_s(1000)) == LinkProfile(80.0, 0.0).serialization_s(1000)

@pytest.mark.parametrize("extra", [
    [],
    ["mesh.schedule=async", "dp.name=sparse", "dp.delay=2"],
    ["mesh.schedule=gpipe", "dp.name=powersgd", "link.bandwidth_mbit=20"],
    ["dp.name=diloco", "dp.inner_steps=3", "links.dp_bandwidth_mbit=10"],
], ids=lambda e: "+".join(e) or "demo")
def test_critical_path_changes_no_number(extra):
    cfg = load_config(None, [*DEMO, *extra])
    plain, traced = predict(cfg), predict(cfg, critical_path=True)
    assert plain.tokens_per_s == traced.tokens_per_s and plain.steps_simulated == traced.steps_simulated
    assert plain.window == traced.window.__class__(**{**traced.window.__dict__, "path": None})
    shares = traced.window.path
    assert set(shares) == {*PARTS, "other"} and abs(shares["other"]) < 1e-9  # the parts are the time


def test_an_explicit_deadline_is_no_resource():
    """A fixed dp.deadline_s that the steps wait for is time no resource accounts for: other."""
    cfg = load_config(None, [*DEMO, "mesh.schedule=async", "dp.name=sparse", "dp.delay=1",
                             "dp.deadline_s=0.5", "links.dp_bandwidth_mbit=0.1"])
    p = steady(cfg, critical_path=True)
    assert p.window.path["other"] > 0.99  # the steps wait out the fixed deadline (and little else)
    assert with_path(cfg, p).binds.startswith("DP link oversubscribed")


# One shape per resource: compute (fast links), PP bandwidth, DP bandwidth, latency (the demo's).
BINDS = [
    (["link.bandwidth_mbit=100000", "link.latency_ms=0.01", "sim.peak_tflops=0.1"], "compute"),
    (["link.bandwidth_mbit=5", "link.latency_ms=1", "mesh.replicas=1"], "PP link"),
    (["mesh.schedule=async", "links.dp_bandwidth_mbit=20", "link.latency_ms=1"], "DP link"),
    ([], "latency"),
]


@pytest.mark.parametrize("extra, resource", BINDS, ids=[r for _, r in BINDS])
def test_path_names_what_doubling_names(extra, resource):
    cfg = load_config(None, [*DEMO, *extra])
    path = with_path(cfg, steady(cfg, critical_path=True))
    doubling = with_gains(cfg, steady(cfg))
    assert path.binds == doubling.binds == resource
    share = path.window.path[resource]
    assert doubling.gains[resource] <= 1 / (1 - share / 2) + 1e-9  # halving its part: at most that


def test_path_agrees_with_doubling_on_every_row():
    cfg = load_config(None, [*DEMO, "link.bandwidth_mbit=30", "link.latency_ms=5"])
    variants, _ = methods(cfg, 0, (0.05,))
    rows = {v.label: (with_path(v.cfg, steady(v.cfg, v.mask_keep, critical_path=True)).binds,
                      with_gains(v.cfg, steady(v.cfg, v.mask_keep), v.mask_keep).binds) for v in variants}
    assert len(rows) == 16 and len({p for p, _ in rows.values()}) > 1, rows  # not one answer for all
    assert {label: b for label, b in rows.items() if b[0] != b[1]} == {}


def test_a_byte_pattern_on_a_shared_uplink_is_no_oversubscription():
    """The paper's shape, uplinks, M95 + PowerSGD: every step takes the same time from the second
    on, while the PowerSGD rounds queued behind the pipeline's sends on the stage 0 and 7 uplinks
    land every 6th step. A 2-step window caught the busy steps (uplink busy ×1.3: "oversubscribed");
    over 64 steps the busiest uplink is busy under 1 and the row is bound by its DP bytes."""
    cfg = load_config(None, [*preset_overrides("llama-1b", tied=False), "mesh.stages=8",
                             "mesh.replicas=7", "mesh.microbatches=8", "mesh.schedule=async",
                             "mesh.update_every=8", "train.batch_size=112", "sim.device=a100",
                             "codec.name=bf16", "dp.name=powersgd", "dp.rank=64", "links.access=uplink"])
    p = steady(cfg, mask_keep=0.05, critical_path=True)
    assert p.window.uplink_share < 1.0 and p.window.steps > 2
    assert with_path(cfg, p).binds == "DP link"
