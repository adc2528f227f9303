"""Reference tables for the synchronous schedules (the tables both drivers execute)."""

import pytest

from meshlearn.mesh.schedule import format_table, schedule_table

GPIPE_P3_M4 = """\
F0 F1 F2 F3 B3 B2 B1 B0
F0 F1 F2 F3 B3 B2 B1 B0
F0 F1 F2 F3 B3 B2 B1 B0"""

ONE_F_ONE_B_P3_M4 = """\
F0 F1 F2 B0 F3 B1 B2 B3
F0 F1 B0 F2 B1 F3 B2 B3
F0 B0 F1 B1 F2 B2 F3 B3"""


def test_gpipe_reference_table():
    assert format_table(schedule_table("gpipe", 3, 4)) == GPIPE_P3_M4


def test_1f1b_reference_table():
    assert format_table(schedule_table("1f1b", 3, 4)) == ONE_F_ONE_B_P3_M4


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (4, 2), (4, 8)])
def test_every_microbatch_runs_forward_then_backward_once(name, stages, micro):
    for row in schedule_table(name, stages, micro):
        assert sorted(str(a) for a in row if a.kind == "F") == sorted(f"F{m}" for m in range(micro))
        assert sorted(str(a) for a in row if a.kind == "B") == sorted(f"B{m}" for m in range(micro))
        for m in range(micro):
            assert [str(a) for a in row].index(f"F{m}") < [str(a) for a in row].index(f"B{m}")


def test_1f1b_holds_fewer_activations_than_gpipe():
    def peak_in_flight(row):
        live = peak = 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        return peak

    assert [peak_in_flight(r) for r in schedule_table("1f1b", 4, 8)] == [4, 3, 2, 1]
    assert [peak_in_flight(r) for r in schedule_table("gpipe", 4, 8)] == [8, 8, 8, 8]


def test_unknown_schedule_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"mesh.schedule = 'zigzag'.*1f1b.*gpipe"):
        schedule_table("zigzag", 2, 2)
