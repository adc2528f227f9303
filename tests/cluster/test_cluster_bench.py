"""The helpers of ``bench/cluster.py`` (not the bench itself, which runs minutes): its placements put
every pipeline and DP link across machines; the simulator it asks for a prediction models the slow
pair's delay on exactly the links between those two machines; without root it stops in one line;
and (root only) ``bench/wan.py``'s emulated machines reach each other, the delayed pair no faster
than its relay allows, and vanish afterwards."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster as bench  # noqa: E402 — bench/cluster.py, found through the path above
import wan  # noqa: E402

from meshlearn.mesh.network import build_network  # noqa: E402
from meshlearn.mesh.topology import MeshShape, WorkerId  # noqa: E402


@pytest.mark.parametrize("elastic_mode", [False, True])
@pytest.mark.parametrize("count", [2, 3])
def test_every_link_crosses_machines_and_only_the_slow_pairs_links_are_delayed(count: int,
                                                                             elastic_mode: bool) -> None:
    arm = bench.Arm(count, 40.0, elastic_mode=elastic_mode)
    cfg = bench.arm_config(arm, 3)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    placement = arm.placement
    assert not elastic_mode or any(w.endswith("s2") for w in placement["alice"])  # the coordinator's
    host_of = {w: h for h, workers in placement.items() for w in workers}
    assert sorted(host_of) == sorted(str(w) for w in mesh.workers())  # each worker placed once
    assert sum(len(ws) for ws in placement.values()) == len(host_of)
    slow = {bench.HOSTS[i] for i in bench.SLOW_PAIR[count]}
    network = build_network(cfg.link, cfg.links, mesh, cfg.seed)
    delayed = 0
    for a, b in itertools.permutations(mesh.workers(), 2):
        if a.replica != b.replica and a.stage != b.stage:
            continue  # not a link
        if a.replica == b.replica and abs(a.stage - b.stage) != 1:
            continue  # not a pipeline link
        assert host_of[str(a)] != host_of[str(b)], (a, b)
        across = {host_of[str(a)], host_of[str(b)]} == slow
        assert network.link(a, b).profile.latency_ms == (40.0 if across else 0.0), (a, b)
        assert network.link(a, b).profile.bandwidth_mbit == bench.RATE_MBIT
        delayed += across
    assert delayed > 0  # the slow pair carries links
    assert bench.arm_config(bench.Arm(count, 0.0), 3).link.latency_ms == 0
    assert bench.arm_config(bench.Arm(count, 0.0), 3).links.overrides == ""
    one = bench.arm_config(bench.Arm(1, 0.0), 3)
    loopback = build_network(one.link, one.links, mesh, 0).link(WorkerId(0, 0), WorkerId(0, 1)).profile
    assert loopback.latency_ms == 0 and loopback.bandwidth_mbit == float("inf")


def test_the_placed_config_names_each_host_at_its_machines_address() -> None:
    hosts = [wan.Machine(f"ns{i}", f"10.236.0.{i + 1}") for i in range(3)]
    cfg = bench.placed(bench.arm_config(bench.Arm(3, 40.0), 3), bench.Arm(3, 40.0), hosts)
    assert cfg.cluster.coordinator == "alice" and cfg.backend == "dist"
    assert {h: (c.address, c.workers) for h, c in cfg.cluster.hosts.items()} == {
        name: (m.address, bench.PLACEMENTS[3][name]) for name, m in zip(bench.HOSTS, hosts, strict=True)}


def test_the_slow_pairs_cost_is_its_row_minus_the_same_machines_without_delay() -> None:
    rows = [{"machines": 1, "slow_pair_rtt_ms": 0.0, "median_s_per_step": 0.1, "sim_ms_per_step": 0.01},
            {"machines": 2, "slow_pair_rtt_ms": 80.0, "median_s_per_step": 0.5, "sim_ms_per_step": 250.0},
            {"machines": 2, "slow_pair_rtt_ms": 0.0, "median_s_per_step": 0.2, "sim_ms_per_step": 10.0}]
    assert bench.delay_costs(rows) == [{"machines": 2, "rtt_ms": 80.0, "measured_s": pytest.approx(0.3),
                                        "device_model_s": pytest.approx(0.24)}]


def test_the_elastic_modes_machine_counts_are_checked_in_one_line() -> None:
    assert bench.machine_counts("1,2,3") == [1, 2, 3] and bench.machine_counts("2") == [2]
    for bad in ("4", "2,2", "", "1,x"):
        with pytest.raises(SystemExit, match=r"^--machines = .*: distinct machine counts among 1, 2, 3"):
            bench.machine_counts(bad)
    assert bench.Arm(1, 0.0, elastic=True).label == "1 machine (loopback), elastic (control membership)"


def test_without_root_the_bench_stops_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wan.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["cluster.py"])
    with pytest.raises(SystemExit, match=r"^bench/cluster.py: network namespaces need root \(run it as root"):
        bench.main()


@pytest.mark.skipif(wan.unavailable() is not None, reason=str(wan.unavailable()))
def test_emulated_machines_reach_each_other_and_the_delayed_pair_waits_for_its_relay() -> None:
    with wan.machines(3, "200mbit", {(0, 2): 20.0}, subnet="10.236.9") as hosts:
        namespaces = [m.namespace for m in hosts]
        assert wan.rtt_ms(hosts[0], hosts[2]) >= 40.0  # 20 ms each way, held by the relay
        for a, b in ((0, 1), (1, 2), (2, 1)):
            assert wan.rtt_ms(hosts[a], hosts[b]) >= 0.0  # reached through the pair's own link
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in listed for ns in namespaces)
