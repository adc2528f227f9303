"""Per-axis link profiles and per-link overrides from the config (``links.*``)."""

from __future__ import annotations

import pytest
from tiny import tiny_config

from meshlearn.errors import ConfigError
from meshlearn.mesh.network import build_run_network
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer


def test_axis_profiles_and_overrides(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "links.dp_bandwidth_mbit=25",
                      "links.dp_latency_ms=80",
                      "links.overrides=r1s1->*: bandwidth_mbit=5; *->r1s1: latency_ms=300, jitter_ms=1")
    net = build_run_network(cfg)
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


def test_the_global_clips_norm_exchange_waits_for_the_slowest_pair(tiny_corpus, tmp_path):
    """r0s0 and r1s1 share no pipeline or DP link: only the global clip's exchange of norms crosses
    between them, and its step waits for that pair's latency (the simulator charged the default
    link's, 0 ms here, while a real run's gather crosses the slow pair: bench/cluster.py)."""
    slow = "links.overrides=r0s0->r1s1: latency_ms=80; r1s1->r0s0: latency_ms=80"
    times = {}
    for clip in (0, 1):
        for links in ("", slow):
            cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b",
                              "link.latency_ms=0", "train.steps=3", f"train.grad_clip={clip}",
                              *([links] if links else []))
            times[clip, bool(links)] = Trainer(cfg, tmp_path / f"{clip}{bool(links)}",
                                               progress=False).train()["sim_time_s"]
    assert times[0, True] == times[0, False]  # no clip: nothing waits on the exchange
    assert times[1, True] - times[1, False] == pytest.approx(3 * 0.080, rel=1e-6)  # 80 ms a step
    net = build_run_network(tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", slow))
    assert net.exchange_latency_s([WorkerId(0, 0), WorkerId(0, 1)]) == pytest.approx(0.010)  # the pp link
    assert not net.links  # the question creates no link


@pytest.mark.parametrize(("text", "fragment"), [("r0s0->r9x: latency_ms=1", "r9x"),
                                                ("r0s0->*: speed=3", "speed"), ("r0s0 latency", "form")])
def test_bad_overrides_name_the_key(tiny_corpus, text, fragment):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, f"links.overrides={text}")
    assert err.value.key == "links.overrides" and fragment in str(err.value)


def test_bad_access_names_the_key_and_what_is_allowed(tiny_corpus):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, "links.access=nic")
    assert err.value.key == "links.access" and "'off', 'uplink'" in str(err.value)


def _run(tiny_corpus, path, access: str, *extra: str) -> dict:
    cfg = tiny_config(tiny_corpus, f"links.access={access}", *extra)
    return Trainer(cfg, path / access, progress=False).train()


def test_an_uplink_changes_nothing_where_each_sender_has_one_link(tiny_corpus, tmp_path):
    """P = 2, D = 1: every worker sends on one link, so its uplink is that link's own queue: the
    virtual clock and every link's counters are the same, bit for bit."""
    extra = ("mesh.stages=2", "mesh.schedule=async")
    off, up = (_run(tiny_corpus, tmp_path, a, *extra) for a in ("off", "uplink"))
    assert up["sim_time_s"] == off["sim_time_s"] and up["links"] == off["links"]


def test_an_uplink_shared_by_pp_and_dp_traffic_slows_the_run(tiny_corpus, tmp_path):
    """P = 2, D = 2 over 1 Mbit/s, async: a worker's activations (or gradients) and its PowerSGD
    factors leave through one queue, so the run takes longer than with a queue per link; the bytes
    are the same."""
    extra = ("mesh.stages=2", "mesh.replicas=2", "mesh.schedule=async", "dp.name=powersgd",
             "link.bandwidth_mbit=1")
    off, up = (_run(tiny_corpus, tmp_path, a, *extra) for a in ("off", "uplink"))
    assert up["sim_time_s"] > 1.05 * off["sim_time_s"]
    assert [link["bytes"] for link in up["links"]] == [link["bytes"] for link in off["links"]]
