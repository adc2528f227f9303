"""The row each worker contributes to a step's report: built from its stats, it travels as one
float64 vector and comes back as the same named fields, and the mesh's report is one function of
every worker's row (the simulator's rows in process, dist's gathered)."""

from __future__ import annotations

from meshlearn.mesh.report import ProcessRow, StepReport, mesh_report, stats_row
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepStats


def test_a_row_comes_back_from_its_vector_field_by_field():
    row = ProcessRow(losses={0: 2.5, 2: 1.25}, sq_norm=0.75, busy_s=3.5, bytes_pp=123_456_789,
                     bytes_dp=42, staleness=1.5, dp_wait_s=0.25, dp_scores=[4.5, 0.0, float("inf")],
                     links=[(10.0, 0.5), (0.0, 0.0), (7.0, 1.0)])
    vector = row.pack(microbatches=4, slots=3)
    assert vector.shape == (3 * 4 + len(ProcessRow.SCALARS) + 2 * 3,)
    assert ProcessRow.unpack(vector, microbatches=4, slots=3) == row


def test_a_quarantined_microbatch_has_no_loss_even_when_the_loss_would_be_zero():
    row = ProcessRow(losses={1: 0.0})  # a zero loss is present; microbatch 0 is not
    back = ProcessRow.unpack(row.pack(microbatches=2, slots=0), microbatches=2, slots=0)
    assert back.losses == {1: 0.0}


def test_a_worker_s_stats_become_its_row():
    stats = StepStats(losses={9: 1.5, 8: 2.5}, update_sq_norms=[1.0, 3.0], staleness=[1, 2],
                      dp_scores={7: 2.0, 6: 0.5})  # update → score
    row = stats_row(stats, microbatches=4, busy_s=7.0)
    assert row == ProcessRow(losses={1: 1.5, 0: 2.5}, sq_norm=2.0, busy_s=7.0, staleness=1.5,
                             dp_scores=[0.5, 2.0])  # in update order
    assert stats_row(stats, 4, sq_norm=0.25).sq_norm == 0.25  # a flushing step's norm before the clip
    assert stats_row(StepStats(), 4) == ProcessRow()


def test_the_mesh_report_is_the_same_arithmetic_whichever_runtime_built_the_rows():
    """Losses of the last stages in replica order, the norm of replica 0's stages summed in stage
    order, the stages' staleness over their replicas, every outlier score there is."""
    mesh = MeshShape(2, 2)
    rows = {WorkerId(0, 0): ProcessRow(sq_norm=4.0, staleness=1.0, dp_scores=[0.5, 1.5]),
            WorkerId(0, 1): ProcessRow(losses={1: 3.0, 0: 2.0}, sq_norm=5.0),
            WorkerId(1, 0): ProcessRow(sq_norm=100.0, staleness=2.0),
            WorkerId(1, 1): ProcessRow(losses={0: 7.0}, sq_norm=100.0, dp_scores=[0.0])}
    report = mesh_report(3, mesh, rows, sim_s=None, bytes_pp=10, bytes_dp=20, dp_wait_s=0.5)
    assert report == StepReport(step=3, losses=[2.0, 3.0, 7.0], sim_s=None, bytes_pp=10, bytes_dp=20,
                                grad_norm=3.0, staleness=[1.5, 0.0], dp_wait_s=0.5,
                                dp_scores={"r0s0": [0.5, 1.5], "r1s1": [0.0]})
