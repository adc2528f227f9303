"""The morph schedule in tokens and in seconds of the run's (virtual) clock, at drain points only."""

import pytest
from test_protocol_training import records, train

from meshlearn.config import load_config
from meshlearn.errors import ConfigError
from meshlearn.protocol.schedule import MorphSchedule
from meshlearn.protocol.settings import ProtocolConfig

TOKENS_PER_STEP = 8 * 16  # tiny_config: train.batch_size × model.seq_len


def morph_events(run_dir):
    return [r for r in records(run_dir, "event") if r["event"] == "protocol_morph"]


def test_token_schedule_names_its_drain_points():
    schedule = MorphSchedule(ProtocolConfig(every_tokens=320), TOKENS_PER_STEP, lambda: 0.0, 2)
    # 128 tokens a step: 384 ≥ 320, 640 ≥ 640, 1024 ≥ 960
    assert [d for d in range(1, 9) if schedule.drains_after(d)] == [3, 5, 8]


def test_seconds_schedule_asks_for_a_drain_after_the_lookahead():
    clock = [0.0]
    schedule = MorphSchedule(ProtocolConfig(every_seconds=1.0), TOKENS_PER_STEP, lambda: clock[0], 2)
    for done, now in [(1, 0.4), (2, 0.8), (3, 1.2)]:
        clock[0] = now
        schedule.step_end(done)
        assert not schedule.drains_after(done)
    assert schedule.request == 5 and schedule.drains_after(5)
    clock[0] = 2.0
    assert schedule.due(5)
    schedule.morphed()
    assert schedule.mark_s == 3.0 and schedule.request is None and not schedule.due(6)


def test_one_schedule_at_a_time():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["protocol.every_tokens=1000", "protocol.every_seconds=30"])
    assert err.value.key == "protocol.every_seconds" and "set one schedule" in str(err.value)


def test_token_morphs_train_like_no_morphs(tiny_corpus, tmp_path):
    train(tiny_corpus, tmp_path / "none", "protocol.morph=none", "protocol.every_tokens=320")
    train(tiny_corpus, tmp_path / "orth", "protocol.morph=orthogonal", "protocol.every_tokens=320")
    assert [r["step"] for r in morph_events(tmp_path / "orth")] == [3, 5, 8]
    a, b = records(tmp_path / "none", "train"), records(tmp_path / "orth", "train")
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-4


@pytest.mark.parametrize("shape", [["mesh.schedule=1f1b"], ["mesh.schedule=async", "mesh.microbatches=4"]],
                         ids=["1f1b", "async"])
def test_seconds_morphs_follow_the_virtual_clock(tiny_corpus, tmp_path, shape):
    """Every morph falls due at the first step end where the virtual clock passed its mark and
    happens ``lookahead`` steps later (no other drains here before the end)."""
    base = [*shape, "train.eval_every=12", "train.steps=12"]
    train(tiny_corpus, tmp_path / "none", *base, "protocol.morph=none")
    step_s = records(tmp_path / "none", "train")[0]["sim_time_s"]
    every = 1.5 * step_s
    orth = train(tiny_corpus, tmp_path / "orth", *base, "protocol.morph=orthogonal",
                 f"protocol.every_seconds={every!r}")
    lookahead = orth.driver.lookahead
    clock = {r["step"]: r["sim_time_s"] for r in records(tmp_path / "orth", "train")}
    events = morph_events(tmp_path / "orth")
    assert len(events) >= 2, events
    mark = every
    for event in events:
        due = event["step"] - lookahead  # the step end at which it fell due
        assert clock[due] >= mark and (due == 1 or clock[due - 1] < mark), (event, mark, clock)
        mark = event["sim_time_s"] + every
    assert all(clock[d] < mark for d in clock if d > events[-1]["step"] - lookahead)  # none missed
    if shape == ["mesh.schedule=1f1b"]:  # drains do not change a flushing schedule
        a = records(tmp_path / "none", "train")
        b = records(tmp_path / "orth", "train")
        assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-4
