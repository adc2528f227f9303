"""Failure handling with real processes: a worker killed (or frozen) mid-run ends the run within the
deadline, every process names it, the last complete checkpoint survives, and --resume finishes the
run with the same losses an uninterrupted run has."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.checkpoint_layout import latest_complete
from meshlearn.entry.launch import WORKERS_FILE
from meshlearn.entry.worker import main as worker_main
from meshlearn.train import Trainer

LONG = ["mesh.stages=2", "mesh.replicas=2", "train.steps=40", "train.checkpoint_every=2",
        "train.eval_every=20"]


def start_in_background(cfg, run_dir, *sets):
    """The launcher in a thread, so the test can act on the running workers."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run_dir, *sets)))
    thread.start()
    return thread, result


def wait_for(path, seconds: float):
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear within {seconds} s"
        time.sleep(0.02)


def pid_of(run_dir, worker: str) -> int:
    wait_for(run_dir / WORKERS_FILE, 30)
    return json.loads((run_dir / WORKERS_FILE).read_text())[worker]["pid"]


def killed_mid_run(cfg, run, capsys) -> str:
    """Start the run, SIGKILL r1s1 once checkpoint 4 is complete; the run must fail naming r1s1
    first. Returns the launcher's report."""
    thread, result = start_in_background(cfg, run, "dist.dead_after_s=3")
    wait_for(run / "checkpoints" / "step-000004" / "manifest.json", 60)
    os.kill(pid_of(run, "r1s1"), signal.SIGKILL)
    thread.join()
    assert result["code"] == 1
    report = capsys.readouterr().err
    first = report.splitlines()[0]
    assert first.startswith("meshlearn: error: ") and "r1s1" in first, report
    return report


def test_killed_worker_ends_the_run_and_resume_finishes_it(tiny_corpus, tmp_path, capsys):
    cfg = tiny_config(tiny_corpus, *LONG)
    run = tmp_path / "run"
    try:
        with deadline(90, "the killed run and its resume"):
            report = killed_mid_run(cfg, run, capsys)
            assert "r1s1: killed by SIGKILL" in report and "--resume" in report
            # Detected by the others (each survivor's last log line names the dead worker), not only
            # by the launcher seeing an exit code.
            for name in ("r0s0", "r0s1", "r1s0"):
                assert "r1s1" in (run / "logs" / f"{name}.log").read_text().splitlines()[-1]
            done = latest_complete(run)
            assert done is not None and int(done.name.removeprefix("step-")) >= 4

            assert launch(cfg, run, resume=True) == 0
    finally:
        kill_leftovers(run)

    straight = tmp_path / "straight"
    Trainer(cfg, straight, progress=False).train()
    a, b = records(straight), records(run)
    assert [r["step"] for r in b] == list(range(1, 41))  # the records after the checkpoint were cut
    assert max(abs(ra["train_loss"] - rb["train_loss"]) for ra, rb in zip(a, b, strict=True)) <= 1e-5
    assert abs(records(straight, "eval")[-1]["val_loss"] - records(run, "eval")[-1]["val_loss"]) <= 1e-5


@pytest.mark.slow
def test_frozen_worker_is_declared_dead_by_its_silent_heartbeat(tiny_corpus, tmp_path, capsys):
    """SIGSTOP keeps the sockets open: only the heartbeat (or a deadline) can tell."""
    cfg = tiny_config(tiny_corpus, *LONG)
    run = tmp_path / "run"
    try:
        with deadline(90, "the frozen run"):
            thread, result = start_in_background(cfg, run, "dist.dead_after_s=3")
            wait_for(run / "checkpoints" / "step-000002" / "manifest.json", 60)
            os.kill(pid_of(run, "r0s1"), signal.SIGSTOP)
            thread.join()
        assert result["code"] == 1
        first = capsys.readouterr().err.splitlines()[0]
        assert "worker r0s1 stopped answering: no heartbeat" in first, first
        assert latest_complete(run) is not None
    finally:
        kill_leftovers(run)


def test_worker_outside_a_launcher_says_what_is_missing(tiny_corpus, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code = worker_main(["--set", f"data.corpus={tiny_corpus}", "--out", str(tmp_path / "run")])
    assert code == 2
    assert "RANK" in capsys.readouterr().err


def test_a_killed_worker_ends_a_verified_run_naming_it(tiny_corpus, tmp_path, capsys):
    """With a verifier, the links run over TCP (dist.links = auto): the killed worker's streams
    close under the verifier and its partners, and every process names it, as over gloo."""
    cfg = tiny_config(tiny_corpus, *LONG, "verify.name=sentinel")
    run = tmp_path / "run"
    try:
        with deadline(60, "the killed verified run"):
            killed_mid_run(cfg, run, capsys)
    finally:
        kill_leftovers(run)
    for name in ("r0s0", "r0s1", "r1s0", "verifier"):
        assert "r1s1" in (run / "logs" / f"{name}.log").read_text().splitlines()[-1], name
