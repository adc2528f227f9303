"""The timeline record: the chosen steps' every compute and transfer, nothing else, and no effect
on the run it records."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from tiny import tiny_config

from meshlearn.errors import ConfigError
from meshlearn.mesh.timeline import TimelineRecorder, parse_timeline_steps
from meshlearn.train import Trainer


@pytest.mark.parametrize("value, steps, expected", [
    ("auto", 10, [4, 5]), ("auto", 1, [0]), ("off", 10, []), ("", 10, []), ("3, 1", 10, [0, 2]),
])
def test_parse_timeline_steps(value, steps, expected):
    assert parse_timeline_steps(value, steps) == expected


@pytest.mark.parametrize("value, message", [
    ("0", "must lie in"), ("11", "must lie in"), ("two", "expected auto"), ("1,2,3,4,5,6,7,8,9", "at most 8"),
])
def test_bad_timeline_steps_are_one_line_naming_the_key(tiny_corpus, value, message):
    with pytest.raises(ConfigError, match=f"report.timeline_steps = '{value}': .*{message}"):
        tiny_config(tiny_corpus, "train.steps=10", f"report.timeline_steps={value}")


def test_the_cap_truncates_and_says_so():
    recorder = TimelineRecorder(frozenset({0}), "virtual", max_events=2)
    for t in range(3):
        recorder.compute("r0s0", "F", 0, t, float(t), t + 0.5)
    assert len(recorder.events) == 2 and recorder.truncated and not recorder.wants(0)


def _run(tiny_corpus, tmp_path, name, *overrides):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "train.steps=4", *overrides)
    summary = Trainer(cfg, tmp_path / name, progress=False).train()
    losses = [json.loads(line).get("train_loss") for line in (tmp_path / name / "metrics.jsonl").open()]
    return summary, losses


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_the_simulator_records_the_chosen_steps_and_nothing_else(tiny_corpus, tmp_path, schedule):
    summary, losses = _run(tiny_corpus, tmp_path, "on", f"mesh.schedule={schedule}",
                           "report.timeline_steps=2,3")
    timeline = json.loads((tmp_path / "on" / "timeline.json").read_text())
    assert timeline["steps"] == [2, 3] and timeline["clock"] == "virtual" and not timeline["truncated"]
    assert timeline["workers"] == ["r0s0", "r0s1", "r1s0", "r1s1"]
    events = timeline["events"]
    assert {e["step"] for e in events} == {2, 3}
    per = Counter((e["kind"], e["worker"], e["step"]) for e in events if e["kind"] != "send")
    M = 2  # tiny_config's microbatches
    for worker in timeline["workers"]:
        for step in (2, 3):
            assert per["F", worker, step] == M and per["B", worker, step] == M
            assert per["U", worker, step] == (1 if schedule == "1f1b" else M)
    sends = Counter((e["what"], e["step"]) for e in events if e["kind"] == "send")
    for step in (2, 3):  # 2 replicas × 1 boundary × M microbatches, each way; the ring: 2 links × 2 stages
        assert sends["act", step] == 2 * M and sends["grad", step] == 2 * M
        assert sends["allreduce", step] == 2 * 2 * (1 if schedule == "1f1b" else M)
    assert all(e["t0"] <= (e.get("t_sent") or e["t1"]) <= e["t1"] for e in events)
    # Recording changes nothing: the same losses and virtual time as a run that records nothing.
    plain, plain_losses = _run(tiny_corpus, tmp_path, "off", f"mesh.schedule={schedule}",
                               "report.timeline_steps=off")
    assert not (tmp_path / "off" / "timeline.json").exists()
    assert losses == plain_losses and summary["sim_time_s"] == plain["sim_time_s"]
