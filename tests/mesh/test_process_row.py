"""The row each worker contributes to a step's report: built from its stats, it travels as one
float64 vector and comes back as the same named fields, and the mesh's report is one function of
every worker's row (the simulator's rows in process, dist's gathered). A worker's DP outlier score
is its stage's rows' vote, never its own row's word (issue 32: under dist each process writes
its own row)."""

from __future__ import annotations

import pytest
import torch

from meshlearn.distributed.process_rows import ProcessRows
from meshlearn.dp.attribution import COUNT, OutlierLedger
from meshlearn.mesh.report import NO_SCORE, ProcessRow, StepReport, mesh_report, stats_row
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepStats


def test_a_row_comes_back_from_its_vector_field_by_field():
    row = ProcessRow(losses={0: 2.5, 2: 1.25}, sq_norm=0.75, busy_s=3.5, bytes_pp=123_456_789,
                     bytes_dp=42, staleness=1.5, dp_wait_s=0.25,
                     dp_scores={0: [4.5, 0.0, float("inf")], 2: [1.0, NO_SCORE, 3.0]},  # slot → D = 3 scores
                     links=[(10.0, 0.5), (0.0, 0.0), (7.0, 1.0)])
    vector = row.pack(microbatches=4, slots=3, replicas=3)
    assert vector.shape == ((2 + 3) * 4 + len(ProcessRow.SCALARS) + 2 * 3,)
    assert ProcessRow.unpack(vector, microbatches=4, slots=3, replicas=3) == row


def test_a_quarantined_microbatch_has_no_loss_even_when_the_loss_would_be_zero():
    row = ProcessRow(losses={1: 0.0})  # a zero loss is present; microbatch 0 is not
    back = ProcessRow.unpack(row.pack(2, slots=0, replicas=1), 2, slots=0, replicas=1)
    assert back.losses == {1: 0.0}


def test_a_worker_s_stats_become_its_row():
    stats = StepStats(losses={9: 1.5, 8: 2.5}, update_sq_norms=[1.0, 3.0], staleness=[1, 2],
                      dp_scores={7: [2.0, 0.0], 6: [0.5, 1.0]})  # update → the stage's scores
    row = stats_row(stats, microbatches=4, busy_s=7.0)
    assert row == ProcessRow(losses={1: 1.5, 0: 2.5}, sq_norm=2.0, busy_s=7.0, staleness=1.5,
                             dp_scores={3: [2.0, 0.0], 2: [0.5, 1.0]})  # by slot, update mod M
    assert stats_row(stats, 4, sq_norm=0.25).sq_norm == 0.25  # a flushing step's norm before the clip
    assert stats_row(StepStats(), 4) == ProcessRow()


def test_the_mesh_report_is_the_same_arithmetic_whichever_runtime_built_the_rows():
    """Losses of the last stages in replica order, the norm of replica 0's stages summed in stage
    order, the stages' staleness over their replicas, every outlier score there is, per worker in
    update order."""
    mesh = MeshShape(2, 2)
    stage0 = {1: [1.5, 0.25], 0: [0.5, 2.0]}  # slot → (r0s0's, r1s0's) score, in both rows alike
    rows = {WorkerId(0, 0): ProcessRow(sq_norm=4.0, staleness=1.0, dp_scores=stage0),
            WorkerId(0, 1): ProcessRow(losses={1: 3.0, 0: 2.0}, sq_norm=5.0, dp_scores={0: [0.0, 0.5]}),
            WorkerId(1, 0): ProcessRow(sq_norm=100.0, staleness=2.0, dp_scores=dict(stage0)),
            WorkerId(1, 1): ProcessRow(losses={0: 7.0}, sq_norm=100.0, dp_scores={0: [0.0, 0.5]})}
    report = mesh_report(3, mesh, rows, sim_s=None, bytes_pp=10, bytes_dp=20, dp_wait_s=0.5)
    assert report == StepReport(step=3, losses=[2.0, 3.0, 7.0], sim_s=None, bytes_pp=10, bytes_dp=20,
                                grad_norm=3.0, staleness=[1.5, 0.0], dp_wait_s=0.5,
                                dp_scores={"r0s0": [0.5, 1.5], "r0s1": [0.0], "r1s0": [2.0, 0.25],
                                           "r1s1": [0.5]})


# --- the scores as dist's gathered rows vote them ------------------------------------------------

MESH = MeshShape(3, 2)  # D = 3: one liar is a strict minority of its stage
M = 2
ATTACKER = WorkerId(1, 1)
HONEST = [0.5, 40.0, 0.25]  # stage 1's scores in one update, as every member computed them


def gathered_report(step: int, rows: dict[WorkerId, ProcessRow]):
    """The report every process computes from ``rows``, each packed by its own process and gathered
    as dist gathers them (``ProcessRows``: the vectors, unpacked on the receiving side)."""
    vectors = torch.stack([rows[MESH.worker(rank)].pack(M, 0, MESH.replicas)
                           for rank in range(MESH.world_size)])
    process_rows = ProcessRows(MESH, network=None, slots=[], microbatches=M,
                               gather=lambda own: vectors[:, None])  # (world, steps = 1, n)
    [step_rows] = process_rows.gather_steps([rows[ATTACKER]])
    return process_rows.report(step, step_rows)


def stage_rows(attacker_row: dict[int, list[float]], scores: list[float] = HONEST
               ) -> dict[WorkerId, ProcessRow]:
    """Stage 1's honest members' rows carry ``scores`` (slot 0); the attacker's row says ``attacker_row``."""
    rows = {w: ProcessRow(dp_scores={0: list(scores)} if w.stage == 1 else {}) for w in MESH.workers()}
    rows[ATTACKER] = ProcessRow(dp_scores=attacker_row)
    return rows


@pytest.mark.parametrize("claim", [{}, {0: [0.5, 0.0, 0.25]}, {0: [0.0, 0.0, 0.0]}],
                         ids=["no_score", "zero_for_itself", "zero_for_all"])
def test_the_attacker_s_own_row_cannot_hide_its_score_and_it_is_still_reported(claim):
    """Its row says NO_SCORE (no robust reduce) or 0; the two honest rows carry its score: the vote
    is theirs, and the ledger reports it at its ``COUNT``-th marked update, as if it had told."""
    ledger, told = OutlierLedger(threshold=3.0), OutlierLedger(threshold=3.0)
    for step in range(COUNT):
        report = gathered_report(step, stage_rows(claim))
        assert report.dp_scores == {"r0s1": [0.5], "r1s1": [40.0], "r2s1": [0.25]}
        records = ledger.observe(step, report.dp_scores)
        assert records == told.observe(step, gathered_report(step, stage_rows({0: HONEST})).dp_scores)
    assert [(r["worker"], r["step"], r["score"]) for r in records] == [("r1s1", COUNT, 40.0)]


def test_a_lying_row_cannot_raise_an_honest_worker_s_score_either():
    """The attacker votes ∞ for both honest members (and garbage, NaN, for one update slot): each
    keeps the score its peers computed, and nobody is reported."""
    ledger = OutlierLedger(threshold=3.0)
    clean = [0.5, 0.75, 0.25]
    for step in range(2 * COUNT):
        report = gathered_report(step, stage_rows({0: [float("inf"), 0.75, float("inf")],
                                                   1: [float("nan")] * 3}, clean))
        assert report.dp_scores == {"r0s1": [0.5], "r1s1": [0.75], "r2s1": [0.25]}
        assert ledger.observe(step, report.dp_scores) == []


def test_a_score_slot_from_the_wire_that_is_no_score_reads_as_none():
    """Another process's bytes: a negative or NaN score is NO_SCORE, a slot without any score is left out."""
    vector = ProcessRow(dp_scores={0: [1.0, 2.0], 1: [3.0, 4.0]}).pack(2, 0, 2)
    at = 2 * 2 + len(ProcessRow.SCALARS)
    vector[at + 1], vector[at + 2], vector[at + 3] = float("nan"), -7.0, float("nan")
    assert ProcessRow.unpack(vector, 2, 0, 2).dp_scores == {0: [1.0, NO_SCORE]}
