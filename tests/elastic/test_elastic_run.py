"""Elastic membership with real processes on loopback (shaped links): a stage replica SIGKILLed
mid-run leaves, its row partners stay and spectate, the other rows go on and the run completes."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import (  # noqa: E402
    deadline,
    kill_leftovers,
    launch,
    launch_and_signal,
    records,
    train_records,
    wait_until,
)
from elastic_records import assert_no_vote_rows_requests_unless_changed  # noqa: E402
from tiny import tiny_config  # noqa: E402

from meshlearn.checkpoint_layout import latest_complete  # noqa: E402
from meshlearn.entry.launch import WORKERS_FILE  # noqa: E402
from meshlearn.statefile import load_state

ELASTIC = ["backend=dist", "mesh.stages=2", "mesh.replicas=2", "train.steps=8", "elastic.enabled=true",
           "dist.timeout_s=5", "dist.dead_after_s=2"]


def assert_no_quorum_requests_unless_changed(rows: list[dict]) -> None:
    """Under ``elastic.membership = "control"`` a step asks the store nothing for its quorum
    unless the step before did not commit or its membership changed (one stage: the records'
    participants); the first step forms the first quorum."""
    assert rows[0]["quorum_requests"] > 0
    steady = [r for prev, r in zip(rows, rows[1:], strict=False)
              if prev["committed"] and prev["participants"] == r["participants"]]
    assert len(steady) >= len(rows) // 2 and all(r["quorum_requests"] == 0 for r in steady), rows
    changed = [r for prev, r in zip(rows, rows[1:], strict=False) if not prev["committed"]
               or prev["participants"] != r["participants"]]
    assert changed and all(r["quorum_requests"] > 0 for r in changed), rows
    assert_no_vote_rows_requests_unless_changed(rows)



@pytest.mark.parametrize(("killed", "membership"), [
    ("r1s1", "torchft"), ("r0s1", "torchft"),
    pytest.param("r1s1", "control", marks=pytest.mark.slow)])
def test_killed_stage_replica_leaves_and_the_others_finish(tiny_corpus, tmp_path, killed, membership):
    """r0s1 is the last stage of row 0, the first step's records' writer: after row 0 leaves, row
    1's last stage writes them (each step's records exactly once, evaluation included)."""
    cfg = tiny_config(tiny_corpus, *ELASTIC, "train.eval_every=3", f"elastic.membership={membership}")
    run = tmp_path / "run"
    gone, kept = (1, 0) if killed == "r1s1" else (0, 1)
    assert launch_and_signal(cfg, run, killed, signal.SIGKILL, 120) == 0
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, 9))  # every step once, none lost or twice
    assert all(r["participants"] == 2 for r in rows[:2])
    assert rows[-1]["participants"] == 1  # the killed replica's row is gone from every later quorum
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    assert len(rows) - len(committed) <= 1  # at most the step the kill landed in is lost
    assert committed[-1]["train_loss"] < committed[0]["train_loss"]
    # The data follows the participants: committed steps train batches 0, 1, 2, … each once (the
    # batch of a step that did not commit is trained by the next one), split over the agreed rows.
    assert [r["batch"] for r in committed] == list(range(len(committed)))
    for r, following in zip(rows, rows[1:], strict=False):
        assert following["batch"] == r["batch"] + r["committed"]
    assert rows[0]["rows"] == [0, 1] and rows[-1]["rows"] == [kept]
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [3, 6, 8]  # after the kill too, each once
    assert all(math.isfinite(r["val_loss"]) for r in evals[1:])
    members = json.loads((run / WORKERS_FILE).read_text())
    assert members[killed]["events"][-1]["why"] == "killed by SIGKILL"
    # The killed replica's row partner stays: it drops the row's links and spectates to the end.
    partner = members[f"r{gone}s0"]["events"]
    assert [e["event"] for e in partner] == ["joined", "spectates", "finished"], partner
    assert partner[1]["step"] >= 2 and any(why in partner[1]["why"] for why in (killed, "not complete"))
    assert partner[-1] == {"event": "finished", "step": 8, "why": "finished"}
    for name in (f"r{kept}s0", f"r{kept}s1"):
        assert members[name]["events"][-1] == {"event": "finished", "step": 8, "why": "finished"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["uncommitted_steps"] == len(rows) - len(committed)
    assert summary["final_train_loss"] is not None


@pytest.mark.slow
def test_every_replica_of_a_stage_killed_stops_with_its_name_and_resume_is_exact(tiny_corpus, tmp_path,
                                                                                 capsys):
    cfg = tiny_config(tiny_corpus, *ELASTIC, "train.steps=10", "train.checkpoint_every=2")
    run = tmp_path / "run"
    result = {}
    try:
        with deadline(150, "the elastic run that loses stage 1, and its resume"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            wait_until(lambda: latest_complete(run) is not None and train_records(run) >= 4, 60,
                  "a complete checkpoint")
            members = json.loads((run / WORKERS_FILE).read_text())
            for name in ("r0s1", "r1s1"):
                os.kill(members[name]["pid"], signal.SIGKILL)
            thread.join()
            assert result["code"] == 1
            report = capsys.readouterr().err
            first = report.splitlines()[0]
            assert first.startswith("meshlearn: error: no pipeline row finished the run: every replica "
                                    "of stage 1 is gone"), report
            assert "--resume" in report
            assert launch(cfg, run, resume=True) == 0
    finally:
        kill_leftovers(run)
    straight = tmp_path / "straight"
    assert launch(cfg, straight) == 0
    a, b = records(straight), records(run)
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]  # bit for bit


def _kill_one_then_the_other(cfg, run: Path) -> int:
    """r0s1 SIGKILLed after two steps, r1s0 three train records later: row 0's r0s0 spectates
    while row 1 trains alone, then row 1 breaks at the other stage."""
    result: dict[str, int] = {}
    try:
        with deadline(150, "the elastic run with r0s1, then r1s0 SIGKILLed"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            wait_until(lambda: train_records(run) >= 2, 60, "two committed steps")
            members = json.loads((run / WORKERS_FILE).read_text())
            os.kill(members["r0s1"]["pid"], signal.SIGKILL)
            wait_until(lambda: train_records(run) >= 5, 60, "five train records")
            os.kill(members["r1s0"]["pid"], signal.SIGKILL)
            thread.join()
    finally:
        kill_leftovers(run)
    return result["code"]


@pytest.mark.parametrize(("when", "strategy"), [
    pytest.param("at once", [], id="at once"),
    pytest.param("one then the other", [], marks=pytest.mark.slow, id="one then the other"),
    pytest.param("at once", ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=2", "dp.compress=powersgd",
                             "dp.rank=2"], marks=pytest.mark.slow, id="at once-diloco")])
def test_rows_broken_at_different_stages_are_re_paired_and_train_on(tiny_corpus, tmp_path, when, strategy):
    """r0s1 and r1s0 killed (at once, or at different steps): no slot row is complete, but a
    replica of each stage lives (r0s0, r1s1). They are re-paired as row (0, 1) — r0s0's
    activations go to r1s1 — and train every later step with the whole batch, the batches in
    order, none skipped or trained twice (also under a message-based DP strategy: its rounds are
    sums over the quorum, whoever is paired with whom)."""
    cfg = tiny_config(tiny_corpus, *ELASTIC, "train.steps=12", *strategy)
    run = tmp_path / "run"
    if when == "at once":
        code = launch_and_signal(cfg, run, ("r0s1", "r1s0"), (signal.SIGSTOP, signal.SIGKILL), 120)
    else:
        code = _kill_one_then_the_other(cfg, run)
    assert code == 0
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, 13))  # every step once
    assert rows[0]["rows"] == [0, 1]
    repaired = next(i for i, r in enumerate(rows) if r["rows"] == [[0, 1]])
    assert repaired >= 2  # two steps committed with the slot rows before the kill
    assert all(r["rows"] == [[0, 1]] for r in rows[repaired:])
    # The re-pairing step commits only if torchft's quorums have dropped the dead already; from
    # the next step on every step commits, with the re-paired row alone.
    after = rows[repaired + 1:]
    assert len(after) >= 4 and all(r["committed"] and r["participants"] == 1 for r in after)
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    assert len(rows) - len(committed) <= 3  # the steps the kills landed in, and the re-pairing one
    assert [r["batch"] for r in committed] == list(range(len(committed)))  # in order, each once
    for r, following in zip(rows, rows[1:], strict=False):
        assert following["batch"] == r["batch"] + r["committed"]
    members = json.loads((run / WORKERS_FILE).read_text())
    for name in ("r0s1", "r1s0"):
        assert members[name]["events"][-1]["why"] == "killed by SIGKILL"
    step = rows[repaired]["step"] - 1  # 0-based, as events name steps
    for name, partner in (("r0s0", "r1s1"), ("r1s1", "r0s0")):
        events = members[name]["events"]
        kinds = [e["event"] for e in events]
        assert kinds[0] == "joined" and kinds[-1] == "finished" and "repaired" in kinds, events
        pairing = events[kinds.index("repaired")]
        assert (pairing["step"], pairing["row"], pairing["partners"]) == (step, [0, 1], [partner])
        assert events[-1] == {"event": "finished", "step": 12, "why": "finished"}
    evals = records(run, "eval")  # the last one through the re-paired row's own link
    assert [r["step"] for r in evals][-1:] == [12] and math.isfinite(evals[-1]["val_loss"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_train_loss"] is not None


@pytest.mark.slow
def test_frozen_stage_replica_is_dropped_by_timeout_and_the_others_finish(tiny_corpus, tmp_path):
    """SIGSTOP: no connection is reset; the quorum's heartbeat timeout (and the row partner's
    heartbeat watch, if it is waiting on a link) find it. The launcher kills the frozen process once
    the run has ended."""
    cfg = tiny_config(tiny_corpus, *ELASTIC)
    run = tmp_path / "run"
    assert launch_and_signal(cfg, run, "r1s1", signal.SIGSTOP, 150) == 0
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["participants"] == 1
    members = json.loads((run / WORKERS_FILE).read_text())
    assert members["r1s1"]["events"][-1]["why"] == "killed by the launcher: no answer after the run ended"
    # Its row partner stays: it stops training once the frozen replica is out of the quorums (or
    # its heartbeat watch finds it silent), and spectates to the end.
    partner = members["r1s0"]["events"]
    assert [e["event"] for e in partner] == ["joined", "spectates", "finished"], partner
    assert "stops training at step" in (run / "logs" / "r1s0.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("membership", ["torchft", "control"])
def test_a_replacement_joins_heals_from_a_live_peer_and_contributes(tiny_corpus, tmp_path, membership):
    """One stage, two replicas: r1s0 is SIGKILLed; ``meshlearn worker --join`` takes its slot, heals
    from r0s0 at the next step and trains on; at the end both replicas' weights and optimizer
    state are equal bit for bit (a replica whose optimizer state had not been healed would drift)."""
    import subprocess

    import torch

    steps = 12
    # min_replicas = 2: after the kill no quorum forms until the replacement is in (the survivor
    # waits for it, up to quorum_timeout_s), so the test does not race the end of the run.
    cfg = tiny_config(tiny_corpus, "backend=dist", "mesh.replicas=2", f"train.steps={steps}",
                      "elastic.enabled=true", "elastic.min_replicas=2", "elastic.quorum_timeout_s=90",
                      "dist.timeout_s=5", "dist.dead_after_s=2", f"elastic.membership={membership}")
    run = tmp_path / "run"
    result = {}
    joiner = None
    try:
        with deadline(150, "the elastic run with a replacement"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            wait_until(lambda: train_records(run) >= 3, 60, "three committed steps")
            os.kill(json.loads((run / WORKERS_FILE).read_text())["r1s0"]["pid"], signal.SIGKILL)
            wait_until(lambda: len(json.loads((run / WORKERS_FILE).read_text())["r1s0"]["events"]) >= 2, 30,
                  "r1s0's departure in workers.json")
            address = json.loads((run / "elastic.json").read_text())["store"]
            src = Path(__file__).resolve().parents[2] / "src"
            joiner = subprocess.Popen(
                [sys.executable, "-m", "meshlearn.entry.worker", "--join", address, "--out", str(run)],
                env=os.environ | {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            output = joiner.communicate(timeout=120)[0]
            thread.join()
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
        kill_leftovers(run)
    assert joiner.returncode == 0, output
    assert result["code"] == 0
    events = json.loads((run / WORKERS_FILE).read_text())["r1s0"]["events"]
    kinds = [e["event"] for e in events]
    assert kinds == ["joined", "left", "joined", "contributes", "finished"], events
    joined_at = events[2]["step"]
    assert events[3]["step"] == joined_at  # one stage: its row is complete at once, it trains
    assert f"joined at step {joined_at + 1}, healed from a live replica" in output
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert joined_at >= 3 and all(r["participants"] == 2 for r in rows[joined_at:])  # it contributes
    assert all(r["committed"] for r in rows[joined_at:])
    if membership == "control":
        assert_no_quorum_requests_unless_changed(rows)
    final = run / "checkpoints" / f"step-{steps:06d}"
    a, b = (load_state(final / f"{w}.pt")["workers"][w] for w in ("r0s0", "r1s0"))
    for key, tensor in a["module"].items():
        assert torch.equal(tensor, b["module"][key]), key
    for (pa, sa), (pb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items(),
                                  strict=True):
        assert pa == pb and all(torch.equal(sa[k], sb[k]) for k in sa), pa
