"""Per-axis link profiles and per-link overrides from the config (``links.*``)."""

from __future__ import annotations

import pytest
from tiny import tiny_config

from meshlearn.config import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer
from meshlearn.train.assemble import build_network


def test_axis_profiles_and_overrides(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "links.dp_bandwidth_mbit=25",
                      "links.dp_latency_ms=80",
                      "links.overrides=r1s1->*: bandwidth_mbit=5; *->r1s1: latency_ms=300, jitter_ms=1")
    net = build_network(cfg)
    pp = net.link(WorkerId(0, 0), WorkerId(0, 1)).profile
    dp = net.link(WorkerId(0, 0), WorkerId(1, 0)).profile
    assert (pp.bandwidth_mbit, pp.latency_ms) == (100, 10)  # link.* of the tiny config
    assert (dp.bandwidth_mbit, dp.latency_ms) == (25, 80)
    out = net.link(WorkerId(1, 1), WorkerId(0, 1)).profile  # a DP link out of the slow worker
    assert (out.bandwidth_mbit, out.latency_ms) == (5, 80)
    into = net.link(WorkerId(1, 0), WorkerId(1, 1)).profile  # a PP link into it
    assert (into.bandwidth_mbit, into.latency_ms, into.jitter_ms) == (100, 300, 1)


def test_slow_dp_links_slow_the_allreduce_on_the_virtual_clock(tiny_corpus, tmp_path):
    times = []
    for bw in (0, 1):
        cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", f"links.dp_bandwidth_mbit={bw}")
        times.append(Trainer(cfg, tmp_path / str(bw), progress=False).train()["sim_time_s"])
    assert times[1] > 2 * times[0]


@pytest.mark.parametrize(("text", "fragment"), [("r0s0->r9x: latency_ms=1", "r9x"),
                                                ("r0s0->*: speed=3", "speed"), ("r0s0 latency", "form")])
def test_bad_overrides_name_the_key(tiny_corpus, text, fragment):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, f"links.overrides={text}")
    assert err.value.key == "links.overrides" and fragment in str(err.value)
