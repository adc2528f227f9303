"""Replacements join a running mesh of two (and three) stages (real processes on loopback, shaped links).

P = 2 × D = 2. A broken row: r1s1 is SIGKILLed; its partner r1s0 stays and *spectates* while row 0
trains on; one ``meshlearn worker --join`` takes r1s1's slot and row 1 trains again. A replacement
row: both of row 1's workers are killed; ``--join`` is started for stage 0 first: it heals there
and spectates (its row has no stage 1); then for stage 1. From the step where both are in their
stages' quorums, row 1 trains again: each step splits its global batch over both rows. The runs
are long (``train.steps`` far away) and end by a graceful stop (SIGTERM to one worker: every
process stops after the same step, with a checkpoint), so nothing in the tests depends on how
long a process takes to start.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import deadline, kill_leftovers, launch, records, wait_until  # noqa: E402
from elastic_records import assert_no_vote_rows_requests_unless_changed  # noqa: E402
from tiny import tiny_config  # noqa: E402

from meshlearn.checkpoint_layout import MANIFEST, latest_complete  # noqa: E402
from meshlearn.elastic.listeners import listening  # noqa: E402
from meshlearn.entry.launch import WORKERS_FILE  # noqa: E402
from meshlearn.jsonl import read_records  # noqa: E402
from meshlearn.statefile import load_state

SRC = Path(__file__).resolve().parents[2] / "src"
ELASTIC = ["backend=dist", "mesh.stages=2", "mesh.replicas=2", "train.steps=2000", "elastic.enabled=true",
           "dist.timeout_s=5", "dist.dead_after_s=2"]


def _members(run: Path) -> dict:
    return json.loads((run / WORKERS_FILE).read_text())


def _event(run: Path, name: str, kind: str) -> dict | None:
    """The latest ``kind`` event of slot ``name``; a join counts only a joiner's (a generation)."""
    return next((e for e in reversed(_members(run)[name]["events"])
                 if e["event"] == kind and (kind != "joined" or "generation" in e)), None)


def _last_record(run: Path) -> int:
    path = run / "metrics.jsonl"
    steps = [r["step"] for r in read_records(path) if r["kind"] == "train"] if path.exists() else []
    return steps[-1] if steps else 0


def _join(address: str, run: Path, log: Path) -> subprocess.Popen:
    """``meshlearn worker --join``, its output in ``log`` (read at the end)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshlearn.entry.worker", "--join", address, "--out", str(run)],
            env=os.environ | {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"},
            stdout=out, stderr=subprocess.STDOUT)


def _shard(folder: Path, name: str) -> dict:
    return load_state(folder / f"{name}.pt")["workers"][name]


def _assert_identical(a: dict, b: dict, what: str) -> None:
    for key, tensor in a["module"].items():
        assert torch.equal(tensor, b["module"][key]), f"{what}: {key}"
    for (pa, sa), (pb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items(),
                                  strict=True):
        assert pa == pb and all(torch.equal(sa[k], sb[k]) for k in sa), f"{what}: optimizer {pa}"
    assert a["version"] == b["version"], what


def _assert_same_stage_state(a: dict, b: dict, strategy: str, what: str) -> None:
    """What a joiner shares with its stage's live replica, bit for bit, by DP strategy: all of it
    (all-reduce); weights, optimizer and PowerSGD's warm-start Q, not its own error feedback
    (powersgd); DiLoCo's outer weights, outer momentum and compressors' Q — the replicas' inner
    weights and optimizers drift apart by design (diloco)."""
    if strategy == "allreduce":
        _assert_identical(a, b, what)
        return
    assert a["version"] == b["version"], what
    if strategy == "powersgd":
        _assert_identical(a, b, what)
        tensors = [(a["dp"]["q"], b["dp"]["q"])]
    else:
        tensors = [(a["dp"]["outer"], b["dp"]["outer"]), (a["dp"]["momentum"], b["dp"]["momentum"])]
        tensors += [(x["q"], y["q"]) for x, y in zip(a["dp"]["compressors"], b["dp"]["compressors"],
                                                    strict=True)]
    for x, y in tensors:
        x, y = (list(t.values()) if isinstance(t, dict) else t for t in (x, y))
        assert len(x) == len(y) > 0 and all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), what


def _kill_row(run: Path, replica: int) -> None:
    """SIGKILL every worker of row ``replica``, frozen first (SIGSTOP), so that none of them sees
    another die and reports anything before its own end."""
    pids = [m["pid"] for name, m in _members(run).items() if name.startswith(f"r{replica}s")]
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            os.kill(pid, signum)


@contextlib.contextmanager
def _live_run(cfg, run: Path, what: str) -> Iterator[tuple[dict, list[subprocess.Popen]]]:
    """The run, launched in a thread and two steps in; yields (the launcher's result, the list
    the block appends its joiners to). At the block's end a graceful stop (SIGTERM to r0s0: every
    process stops after the same step, with a checkpoint) ends it; nothing is left behind."""
    result: dict = {}
    joiners: list[subprocess.Popen] = []
    try:
        with deadline(240, what):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            wait_until(lambda: _last_record(run) >= 2, 60, "two steps")
            yield result, joiners
            os.kill(_members(run)["r0s0"]["pid"], signal.SIGTERM)
            for j in joiners:
                j.wait(timeout=60)
            thread.join()
    finally:
        for j in joiners:
            if j.poll() is None:
                j.kill()
        kill_leftovers(run)


def _row_1_trains(run: Path, stages: int = 2) -> int:
    """Wait for row 1 to train again (every one of its workers reports it) and four steps more;
    the first step it trained."""
    wait_until(lambda: all(_event(run, f"r1s{s}", "contributes") for s in range(stages)), 90,
               "row 1 training again")
    trains = _event(run, "r1s1", "contributes")["step"]
    wait_until(lambda: _last_record(run) >= trains + 4, 60, "four steps with row 1 training")
    return trains


STRATEGIES = {"allreduce": [], "powersgd": ["dp.name=powersgd", "dp.rank=2"],
              "diloco": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=2", "dp.compress=powersgd",
                         "dp.rank=2"]}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_replacement_row_joins_heals_spectates_and_trains(tiny_corpus, tmp_path, strategy):
    cfg = tiny_config(tiny_corpus, *ELASTIC, *STRATEGIES[strategy])
    run = tmp_path / "run"
    with _live_run(cfg, run, "the elastic run with a replacement row") as (result, joiners):
        _kill_row(run, 1)
        wait_until(lambda: all(_event(run, n, "left") for n in ("r1s0", "r1s1")), 60, "row 1's departure")
        address = json.loads((run / "elastic.json").read_text())["store"]
        joiners.append(_join(address, run, tmp_path / "join0.log"))  # r1s0: first free in row order
        wait_until(lambda: _event(run, "r1s0", "joined") is not None, 90, "r1s0's join")
        healed = _event(run, "r1s0", "joined")["step"]
        wait_until(lambda: _last_record(run) >= healed + 3, 60, "three steps with r1s0 spectating")
        joiners.append(_join(address, run, tmp_path / "join1.log"))  # takes r1s1
        trains = _row_1_trains(run)
    outputs = [(tmp_path / f"join{i}.log").read_text() for i in range(2)]
    assert [j.returncode for j in joiners] == [128 + signal.SIGTERM] * 2, outputs  # the graceful stop
    assert result["code"] == 0
    assert f"joined at step {healed + 1}, healed from a live replica of stage 0" in outputs[0]
    members = _members(run)
    for name in ("r1s0", "r1s1"):
        kinds = [e["event"] for e in members[name]["events"]]
        assert kinds == ["joined", "left", "joined", "contributes", "finished"], members[name]
        assert members[name]["events"][2]["generation"] == 1
    # Row 1 trains from one step in both stages, agreed; r1s0 spectated the steps before it.
    assert _event(run, "r1s0", "contributes")["step"] == trains
    assert trains >= healed + 3
    rows = records(run)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1))
    by_step = {r["step"]: r for r in rows}
    assert all(by_step[s]["rows"] == [0] for s in range(healed + 1, trains + 1))  # r1s0 spectates
    after = [by_step[s] for s in range(trains + 1, len(rows) + 1)]
    assert all(r["rows"] == [0, 1] and r["committed"] and r["participants"] == 2 for r in after)
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    # The stop's checkpoint is complete after the membership change: every stage of both rows.
    final = latest_complete(run)
    assert final is not None and int(final.name.removeprefix("step-")) == len(rows)
    assert json.loads((final / MANIFEST).read_text())["shards"] == ["r0s0", "r0s1", "r1s0", "r1s1"]
    # Healed, then spectated, then trained: bit for bit the state of the live replica of its stage
    # (what of it the strategy shares, docs/elastic.md).
    for s in range(2):
        _assert_same_stage_state(_shard(final, f"r0s{s}"), _shard(final, f"r1s{s}"), strategy, f"stage {s}")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "membership"), [(name, "torchft") for name in STRATEGIES]
                         + [("allreduce", "control")])
def test_a_broken_rows_partner_stays_and_one_joiner_completes_the_row(tiny_corpus, tmp_path, strategy,
                                                                      membership):
    """r1s1 SIGKILLed: r1s0 stays in stage 0's quorum, drops its links and spectates while row 0
    trains alone; a single ``--join`` takes r1s1's slot (generation 1), heals from r0s1 and row 1
    trains again from one step, agreed, on new links. At the graceful stop both of row 1's
    workers equal their stage's live replica bit for bit (what of it the strategy shares): r1s0
    spectated (applied row 0's updates), the joiner was healed, and both trained since."""
    cfg = tiny_config(tiny_corpus, *ELASTIC, *STRATEGIES[strategy], f"elastic.membership={membership}")
    run = tmp_path / "run"
    with _live_run(cfg, run, "the elastic run whose row one joiner completes") as (result, joiners):
        os.kill(_members(run)["r1s1"]["pid"], signal.SIGKILL)
        wait_until(lambda: _event(run, "r1s1", "left") and _event(run, "r1s0", "spectates"), 60,
                   "r1s1's departure and r1s0 spectating")
        broke = _event(run, "r1s0", "spectates")["step"]  # the first step r1s0 did not train
        wait_until(lambda: _last_record(run) >= broke + 4, 60, "three steps with r1s0 spectating")
        address = json.loads((run / "elastic.json").read_text())["store"]
        joiners.append(_join(address, run, tmp_path / "join.log"))  # the only free slot: r1s1
        trains = _row_1_trains(run)
        if membership == "control":  # no worker listens: each stream was dialed to a listener
            pids = {name: m["pid"] for name, m in _members(run).items()}  # closed once it came
            assert {name: listening(pid) for name, pid in pids.items()} == {name: [] for name in pids}
    output = (tmp_path / "join.log").read_text()
    assert joiners[0].returncode == 128 + signal.SIGTERM, output
    assert result["code"] == 0
    assert "healed from a live replica of stage 1" in output
    members = _members(run)
    partner = members["r1s0"]["events"]
    assert [e["event"] for e in partner] == ["joined", "spectates", "contributes", "finished"], partner
    # found dead (a closed link, a silent heartbeat) or, if the kill fell between two steps, its row
    # missing from the next step's quorums
    assert any(why in partner[1]["why"] for why in ("r1s1", "its row is not complete")), partner[1]
    assert partner[2]["step"] == trains
    assert "stops training at step" in (run / "logs" / "r1s0.log").read_text()
    replaced = members["r1s1"]["events"]
    assert [e["event"] for e in replaced] == ["joined", "left", "joined", "contributes", "finished"], replaced
    assert replaced[1]["why"] == "killed by SIGKILL" and replaced[2]["generation"] == 1
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    by_step = {r["step"]: r for r in rows}
    # Before the kill both rows; the step the kill landed in commits nowhere (or is row 0's alone);
    # then row 0 alone while r1s0 spectates; from the joiner's first step both rows, committed.
    assert all(by_step[s]["rows"] == [0, 1] for s in range(1, broke + 1))
    assert by_step[broke + 1]["rows"] == [0] or not by_step[broke + 1]["committed"]
    assert trains >= broke + 3 and all(by_step[s]["rows"] == [0] for s in range(broke + 2, trains + 1))
    after = [by_step[s] for s in range(trains + 1, len(rows) + 1)]
    assert all(r["rows"] == [0, 1] and r["committed"] and r["participants"] == 2 for r in after)
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    assert [r["batch"] for r in committed] == list(range(len(committed)))  # each batch once, in order
    if membership == "control":
        assert_no_vote_rows_requests_unless_changed(rows)
    final = latest_complete(run)
    assert final is not None and int(final.name.removeprefix("step-")) == len(rows)
    assert json.loads((final / MANIFEST).read_text())["shards"] == ["r0s0", "r0s1", "r1s0", "r1s1"]
    for s in range(2):
        _assert_same_stage_state(_shard(final, f"r0s{s}"), _shard(final, f"r1s{s}"), strategy, f"stage {s}")


@pytest.mark.slow
def test_a_three_stage_rows_middle_replica_is_replaced_and_the_row_relinks(tiny_corpus, tmp_path):
    """P = 3 × D = 2: r1s1, the middle of row 1, is SIGKILLed; both its partners (r1s0 upstream,
    r1s2 downstream) stay and spectate; one ``--join`` takes r1s1's slot and all three link anew at
    one agreed step (the middle meets its upstream partner, then its downstream one) and train:
    every later step splits its batch over both rows and commits, and at the graceful stop each
    of row 1's workers equals its stage's live replica bit for bit."""
    cfg = tiny_config(tiny_corpus, *ELASTIC, "mesh.stages=3", "model.n_layer=3")
    run = tmp_path / "run"
    what = "the three-stage elastic run whose middle replica is replaced"
    with _live_run(cfg, run, what) as (result, joiners):
        os.kill(_members(run)["r1s1"]["pid"], signal.SIGKILL)
        wait_until(lambda: _event(run, "r1s1", "left") and _event(run, "r1s0", "spectates")
                   and _event(run, "r1s2", "spectates"), 60, "r1s1's departure and its partners spectating")
        broke = max(_event(run, n, "spectates")["step"] for n in ("r1s0", "r1s2"))
        wait_until(lambda: _last_record(run) >= broke + 2, 60, "a step with row 1 spectating")
        address = json.loads((run / "elastic.json").read_text())["store"]
        joiners.append(_join(address, run, tmp_path / "join.log"))  # the only free slot: r1s1
        trains = _row_1_trains(run, stages=3)
    output = (tmp_path / "join.log").read_text()
    assert joiners[0].returncode == 128 + signal.SIGTERM, output
    assert result["code"] == 0
    assert "healed from a live replica of stage 1" in output
    members = _members(run)
    for name in ("r1s0", "r1s2"):
        events = members[name]["events"]
        assert [e["event"] for e in events] == ["joined", "spectates", "contributes", "finished"], events
        assert events[2]["step"] == trains  # the whole row links at one step
    replaced = members["r1s1"]["events"]
    assert [e["event"] for e in replaced] == ["joined", "left", "joined", "contributes", "finished"], replaced
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    by_step = {r["step"]: r for r in rows}
    assert all(by_step[s]["rows"] == [0] for s in range(broke + 2, trains + 1))  # row 1 spectates
    after = [by_step[s] for s in range(trains + 1, len(rows) + 1)]
    assert len(after) >= 4 and all(r["rows"] == [0, 1] and r["committed"] for r in after)
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    assert [r["batch"] for r in committed] == list(range(len(committed)))
    final = latest_complete(run)
    assert final is not None and int(final.name.removeprefix("step-")) == len(rows)
    shards = [f"r{r}s{s}" for r in range(2) for s in range(3)]
    assert json.loads((final / MANIFEST).read_text())["shards"] == shards
    for s in range(3):
        _assert_identical(_shard(final, f"r0s{s}"), _shard(final, f"r1s{s}"), f"stage {s}")


@pytest.mark.slow
@pytest.mark.parametrize(("killed", "listed"), [
    (("r1s1",), ["r0s0", "r0s1"]),
    (("r0s1", "r1s0"), ["r0s0", "r1s1"])],  # rows broken at different stages: re-paired as (0, 1)
    ids=["row 1 left", "re-paired"])
def test_a_checkpoint_after_a_row_left_is_complete_and_resumes_exactly(tiny_corpus, tmp_path, killed, listed):
    """Row 1 leaves (r1s1 SIGKILLed), or rows 0 and 1 break at different stages and are re-paired;
    the checkpoints after that list the training row's shards, written by its last stage (agreed,
    no barrier of the departed). Resumed from one, the run starts those workers only (the
    membership of the checkpoint; the other slots are free for joiners; the first listed last
    stage starts metrics.jsonl) and trains every later step bit for bit as the original did."""
    import shutil

    cfg = tiny_config(tiny_corpus, *ELASTIC, "train.steps=12", "train.checkpoint_every=2",
                      "dist.keep_checkpoints=10")
    run, again = tmp_path / "run", tmp_path / "again"
    result: dict = {}
    try:
        with deadline(180, "the elastic run that loses a row, and its resume"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            wait_until(lambda: _last_record(run) >= 2, 60, "two steps")
            for name in killed:
                os.kill(_members(run)[name]["pid"], signal.SIGKILL)
            thread.join()
            assert result["code"] == 0
            folders = sorted((run / "checkpoints").iterdir())
            manifests = {int(f.name.removeprefix("step-")): json.loads((f / MANIFEST).read_text())["shards"]
                         for f in folders}
            after = [step for step, shards in sorted(manifests.items()) if shards == listed]
            assert after and after[-1] == 12 and after[0] < 12, manifests  # complete, the training row's
            resume_at = after[0]
            shutil.copytree(run, again)
            for folder in (again / "checkpoints").iterdir():
                if int(folder.name.removeprefix("step-")) > resume_at:
                    shutil.rmtree(folder)
            assert launch(cfg, again, resume=True) == 0
    finally:
        kill_leftovers(run)
        kill_leftovers(again)
    original, resumed = records(run), records(again)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    tail = slice(resume_at, 12)
    assert [r["train_loss"] for r in resumed[tail]] == [r["train_loss"] for r in original[tail]]  # exactly
    assert [r["batch"] for r in resumed[tail]] == [r["batch"] for r in original[tail]]
    members = _members(again)
    for name in ("r0s0", "r0s1", "r1s0", "r1s1"):
        kinds = [e["event"] for e in members[name]["events"]]
        assert kinds[-1] == "finished" if name in listed else kinds == ["absent"], (name, kinds)
    for name in listed:
        a = _shard(run / "checkpoints" / "step-000012", name)
        b = _shard(again / "checkpoints" / "step-000012", name)
        _assert_identical(a, b, f"{name} at the end")
