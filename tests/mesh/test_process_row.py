"""The row each process contributes to a step's gather travels as one float64 vector and comes back
as the same named fields (distributed/driver.py builds the step report from them)."""

from __future__ import annotations

from meshlearn.mesh.report import ProcessRow


def test_a_row_comes_back_from_its_vector_field_by_field():
    row = ProcessRow(losses={0: 2.5, 2: 1.25}, sq_norm=0.75, busy_s=3.5, bytes_pp=123_456_789,
                     bytes_dp=42, staleness=1.5, dp_wait_s=0.25, dp_score=4.5,
                     links=[(10.0, 0.5), (0.0, 0.0), (7.0, 1.0)])
    vector = row.pack(microbatches=4, slots=3)
    assert vector.shape == (2 * 4 + len(ProcessRow.SCALARS) + 2 * 3,)
    assert ProcessRow.unpack(vector, microbatches=4, slots=3) == row


def test_a_quarantined_microbatch_has_no_loss_even_when_the_loss_would_be_zero():
    row = ProcessRow(losses={1: 0.0})  # a zero loss is present; microbatch 0 is not
    back = ProcessRow.unpack(row.pack(microbatches=2, slots=0), microbatches=2, slots=0)
    assert back.losses == {1: 0.0}
