"""DPAxis (distributed/dp_axis.py) without a driver, processes or sockets: it is given the worker,
the link model, the collectives and its send/receive explicitly, so fakes of those run it. Unshaped
(``shaped=False``): nothing sleeps, and the link model still counts every byte."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from meshlearn.distributed.dp_axis import DPAxis, DPLinks
from meshlearn.dp.robust import Robust
from meshlearn.mesh.messages import Message
from meshlearn.mesh.network import LinkProfile, LinksConfig, build_network, ring_allreduce_bytes_per_member
from meshlearn.mesh.timeline import TimelineRecorder
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.update import ReduceGradients


def _refuse(*args):
    raise AssertionError(f"the stage's collective uses no link of the DP axis: {args}")


def _axis(replicas: int, collectives, links: DPLinks | None = None):
    """Replica 0 of stage 0 in a D × 1 mesh, three gradient values of ones; what it sets and notes
    is kept in ``got``."""
    mesh, me = MeshShape(replicas, 1), WorkerId(0, 0)
    got: dict = {}
    worker = SimpleNamespace(id=me, mesh=mesh, dp=None, n_params=3, flat_gradients=lambda: torch.ones(3),
                             set_flat_gradients=lambda flat: got.__setitem__("flat", flat),
                             note_dp_score=lambda step, scores: got.__setitem__("scores", (step, scores)))
    network = build_network(LinkProfile(bandwidth_mbit=8.0, latency_ms=50.0), LinksConfig(), mesh, seed=0)
    timeline = TimelineRecorder(frozenset({0}), "wall")
    ring_next = WorkerId(1, 0) if replicas > 1 else None
    axis = DPAxis(worker, network, 0.0, False, collectives, ring_next,
                  links or DPLinks(_refuse, _refuse, _refuse, _refuse), lambda: timeline)
    return axis, network, timeline, got


def test_the_stage_mean_is_the_sum_over_replicas_and_the_ring_s_bytes_are_counted():
    # D = 3 replicas of ones: their sum is 3 everywhere
    collectives = SimpleNamespace(framed=False, stage_sum=lambda flat, what: flat * 3)
    axis, network, timeline, got = _axis(3, collectives)
    axis.reduce_gradients(0, ReduceGradients(Robust(), None))
    assert torch.equal(got["flat"], torch.ones(3))
    ring = ring_allreduce_bytes_per_member(3 * 4, 3)
    assert network.link(WorkerId(0, 0), WorkerId(1, 0)).bytes_sent == ring
    assert [(e["axis"], e["what"], e["bytes"]) for e in timeline.events] == [("dp", "allreduce", ring)]
    axis.reduce_gradients(1, ReduceGradients(Robust(), None))  # step 1 is not recorded
    assert len(timeline.events) == 1 and axis.strategy is None and axis.summary(_refuse) == {}


def test_a_robust_rule_gathers_notes_every_replica_s_score_and_counts_a_copy_to_each_peer():
    """Every replica's score, not its own only: the stage's rows vote each worker's (``voted_scores``)."""
    reduced = torch.full((3,), 0.5)
    scores = [7.0, 1.0, 2.0]  # in replica order
    collectives = SimpleNamespace(framed=False, stage_reduce=lambda flat, rule, what: (reduced, scores))
    axis, network, timeline, got = _axis(3, collectives)
    axis.reduce_gradients(0, ReduceGradients(Robust("median"), None))
    assert got["flat"] is reduced and got["scores"] == (0, [7.0, 1.0, 2.0])
    assert [network.link(WorkerId(0, 0), WorkerId(r, 0)).bytes_sent for r in (1, 2)] == [12, 12]
    assert [(e["dst"], e["what"]) for e in timeline.events] == [("r1s0", "allgather"), ("r2s0", "allgather")]


def test_one_replica_reduces_nothing():
    axis, network, timeline, got = _axis(1, SimpleNamespace(framed=False))
    axis.reduce_gradients(0, ReduceGradients(Robust(), None))
    assert got == {} and network.links == {} and timeline.events == []


def test_a_wait_delivers_one_arrival_to_the_driver_or_reports_the_deadline_passed():
    arrivals = [None, Message("act", 0, 0, WorkerId(0, 0), WorkerId(0, 1), None)]
    delivered: list[Message] = []
    links = DPLinks(_refuse, _refuse, lambda what, peer, give_up_at: arrivals.pop(), delivered.append)
    axis, _, _, _ = _axis(2, SimpleNamespace(framed=False), links)
    assert axis.wait("a round", None) and [m.kind for m in delivered] == ["act"]  # any kind: the driver's
    assert not axis.wait("a round", 0.0) and len(delivered) == 1
