"""Reference tables for the synchronous schedules (the tables both drivers execute)."""

import pytest

from meshlearn.mesh.schedule import build_plan, format_table, schedule_table, send_order

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "async"])
def test_send_order_is_the_order_a_stage_s_plan_runs_its_forwards_and_backwards(name):
    """What a receiver that cannot read a header relies on: the n-th activation (gradient) a stage
    sends in a step is microbatch ``send_order(...)[n]``. Checked by running each stage's plan for
    three steps (async: as many microbatches in flight as 1F1B keeps)."""
    stages, micro, steps = 3, 4, 3
    for stage in range(stages):
        plan = build_plan(name, stage, stages, micro, in_flight=stages - stage, update_every=micro)
        sent: dict[str, list[int]] = {"F": [], "B": []}
        while len(sent["B"]) < steps * micro:
            kind, j = plan.peek(horizon=steps * micro)
            if kind != "U":
                sent[kind].append(j)
            plan.advance(kind)
        for kind in ("F", "B"):
            order = send_order(name, stage, stages, kind, micro)
            assert sent[kind] == [t * micro + m for t in range(steps) for m in order], (stage, kind)
    assert send_order("gpipe", 0, stages, "B", micro) == [3, 2, 1, 0]  # the one that descends
