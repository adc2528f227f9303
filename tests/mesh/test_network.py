"""Link arithmetic: serialization, latency, FIFO queueing (per link, or one uplink per sender),
ring all-reduce cost."""

import math

import pytest

from meshlearn.mesh.network import (
    LinkProfile,
    Network,
    ring_allreduce_bytes_per_member,
    ring_allreduce_s,
)
from meshlearn.mesh.topology import MeshShape, WorkerId

A, B, C = WorkerId(0, 0), WorkerId(0, 1), WorkerId(1, 0)


def test_one_message_costs_serialization_plus_latency():
    net = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20))
    arrival = net.link(A, B).transmit(1.0, 1_250_000)  # 10 Mbit at 100 Mbit/s = 0.1 s
    assert arrival == pytest.approx(1.0 + 0.1 + 0.02)


def test_messages_on_one_link_queue_behind_each_other():
    link = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20)).link(A, B)
    first = link.transmit(0.0, 1_250_000)
    second = link.transmit(0.0, 1_250_000)
    assert second - first == pytest.approx(0.1)
    assert link.busy_s == pytest.approx(0.2) and link.bytes_sent == 2_500_000


def test_unlimited_link_only_adds_latency_and_axes_are_named():
    net = Network(LinkProfile(bandwidth_mbit=math.inf, latency_ms=5))
    assert net.link(A, B).transmit(0.0, 10**9) == pytest.approx(0.005)
    assert net.link(A, B).axis == "pp" and net.link(A, C).axis == "dp"


def test_jitter_and_loss_are_seeded_and_keep_order():
    def arrivals(seed):
        link = Network(LinkProfile(100, 10, jitter_ms=30, loss_rate=0.3), seed=seed).link(A, B)
        return [link.transmit(0.001 * i, 1000) for i in range(50)]

    assert arrivals(1) == arrivals(1) and arrivals(1) != arrivals(2)
    assert arrivals(1) == sorted(arrivals(1))


def test_a_shared_uplink_serializes_every_flow_out_of_one_sender():
    """Two flows out of A (a PP link and a DP link) take the sum of their serialization times;
    per-link queues would deliver both after one. Another sender's link is not in A's queue."""
    net = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20), access="uplink")
    first = net.link(A, B).transmit(0.0, 1_250_000)  # 0.1 s at 100 Mbit/s
    second = net.link(A, C).transmit(0.0, 1_250_000)  # waits for the first to leave A
    assert (first, second) == (pytest.approx(0.1 + 0.02), pytest.approx(0.2 + 0.02))
    assert net.link(B, A).transmit(0.0, 1_250_000) == pytest.approx(0.1 + 0.02)
    up = net.uplinks[A]
    assert up.busy_s == pytest.approx(0.2) and up.bytes_sent == 2_500_000
    assert net.link(A, B).busy_s == pytest.approx(0.1)  # each link still counts its own share
    # A collective's transfer occupies the uplink too: what A sends next queues behind it.
    net.link(A, C).occupy(0.2, 0.5, 6_250_000)
    assert net.link(A, B).transmit(0.3, 1_250_000) == pytest.approx(0.7 + 0.1 + 0.02)


def test_per_link_queues_stay_the_default_and_uplinks_survive_a_checkpoint():
    net = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20))
    net.link(A, B).transmit(0.0, 1_250_000)
    assert net.link(A, C).transmit(0.0, 1_250_000) == pytest.approx(0.1 + 0.02) and not net.uplinks
    shared = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20), access="uplink")
    shared.link(A, B).transmit(0.0, 1_250_000)
    restored = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20), access="uplink")
    restored.load_state(shared.state())
    assert restored.uplinks[A].free_at == pytest.approx(0.1)
    assert restored.link(A, C).transmit(0.0, 1_250_000) == pytest.approx(0.2 + 0.02)
    # A real run resumed in a new process: its queues are idle on the new clock, links and
    # uplinks alike (an uplink left on the old clock would hold every message back), bytes kept.
    resumed = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20), access="uplink")
    resumed.load_state(restored.state())
    resumed.idle()
    assert resumed.link(A, C).transmit(0.0, 1_250_000) == pytest.approx(0.1 + 0.02)
    assert resumed.uplinks[A].bytes_sent == 3 * 1_250_000


def test_a_run_saved_with_uplinks_resumes_with_links_access_off():
    """``links.access`` may change on --resume: the saved uplinks' queues are then no queue of
    this run's (before: AttributeError on the first uplink in the checkpoint)."""
    shared = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20), access="uplink")
    shared.link(A, B).transmit(0.0, 1_250_000)
    per_link = Network(LinkProfile(bandwidth_mbit=100, latency_ms=20))
    per_link.load_state(shared.state())
    assert not per_link.uplinks and per_link.link(A, B).free_at == pytest.approx(0.1)
    assert per_link.link(A, C).transmit(0.0, 1_250_000) == pytest.approx(0.1 + 0.02)


def test_ring_allreduce_cost_model():
    profile = LinkProfile(bandwidth_mbit=80, latency_ms=10)
    nbytes = 4_000_000
    # D=4: 6 rounds of a 1 MB chunk (0.1 s at 80 Mbit/s) plus one latency each.
    assert ring_allreduce_s(nbytes, 4, profile) == pytest.approx(6 * (0.1 + 0.01))
    assert ring_allreduce_bytes_per_member(nbytes, 4) == 6_000_000
    assert ring_allreduce_s(nbytes, 1, profile) == 0.0


def test_mesh_shape_ranks_round_trip():
    mesh = MeshShape(replicas=2, stages=3)
    assert [mesh.worker(mesh.rank(w)) for w in mesh.workers()] == mesh.workers()
    assert mesh.next_stage(WorkerId(1, 2)) is None and mesh.prev_stage(WorkerId(1, 0)) is None
    assert WorkerId.parse("r1s2") == WorkerId(1, 2) and str(WorkerId(1, 2)) == "r1s2"
    with pytest.raises(ValueError, match="r<replica>s<stage>"):
        WorkerId.parse("worker3")
