"""ProcessRows (distributed/process_rows.py) without processes: a fake gather stands in for the
other process of a 1 × 2 mesh, so the rows, the report and the summary's link table are checked
exactly."""

from __future__ import annotations

import torch

from meshlearn.distributed.process_rows import ProcessRows
from meshlearn.mesh.network import LinkProfile, LinksConfig, build_network
from meshlearn.mesh.report import ProcessRow
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepStats

M = 2  # microbatches


def test_every_process_s_row_gives_the_report_and_the_last_step_s_link_table():
    mesh, me, up = MeshShape(1, 2), WorkerId(0, 0), WorkerId(0, 1)
    network = build_network(LinkProfile(bandwidth_mbit=8.0, latency_ms=50.0), LinksConfig(), mesh, seed=0)
    network.link(me, up).transmit(0.0, 1000)  # 1 ms on the wire at 1 MB/s
    theirs = [ProcessRow(losses={0: 2.0, 1: 4.0}, busy_s=3.0, links=[(0.0, 0.0), (500.0, 0.25), (0.0, 0.0)]),
              ProcessRow(losses={1: 6.0}, busy_s=5.0, links=[(0.0, 0.0), (700.0, 0.5), (0.0, 0.0)])]
    rows = ProcessRows(mesh, network, [(me, up), (me, None), (me, None)], M,
                       lambda values: torch.stack([values, torch.stack([r.pack(M, 3, 1) for r in theirs])]))
    own = [rows.own(StepStats(), bytes_pp=1000, bytes_dp=0, busy_s=busy, dp_wait_s=0.0, sq_norm=1.0)
           for busy in (1.0, 2.0)]
    assert own[0].links == [(1000, 0.001), (0.0, 0.0), (0.0, 0.0)] and own[0].sq_norm == 1.0
    per_step = rows.gather_steps(own)
    assert per_step == [[own[0], theirs[0]], [own[1], theirs[1]]] and rows.last == per_step[-1]
    assert rows.report(7, per_step[0]).losses == [2.0, 4.0] and rows.report(8, per_step[1]).bytes_pp == 1000
    usage = rows.usage(wall_s=10.0)
    assert usage["idle_fraction"] == 1.0 - (2.0 + 5.0) / (2 * 10.0)
    assert [(ln["src"], ln["dst"], ln["bytes"], ln["busy_s"]) for ln in usage["links"]] == [
        ("r0s0", "r0s1", 1000, 0.001), ("r0s1", "r0s0", 700, 0.5)]


def test_before_any_gather_the_summary_has_no_idle_fraction_and_no_links():
    mesh = MeshShape(1, 2)
    network = build_network(LinkProfile(), LinksConfig(), mesh, seed=0)
    rows = ProcessRows(mesh, network, [], M, lambda values: values[None])
    assert rows.usage(wall_s=10.0) == {"idle_fraction": None, "links": []}
