"""Run folders: one run per folder (refused unless --overwrite), one process per run (the lock)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from meshlearn.train.rundir import (
    LOCK,
    RunFolderError,
    RunLock,
    default_out,
    discard_fresh,
    holds_run,
    read_lock,
    start_fresh,
)


def fake_run(path):
    path.mkdir(parents=True)
    (path / "config.toml").write_text("seed = 1\n")
    (path / "checkpoint.pt").write_bytes(b"old")
    (path / "checkpoints").mkdir()
    return path


def test_a_fresh_start_refuses_a_folder_holding_a_run_and_overwrite_clears_it(tmp_path):
    run = fake_run(tmp_path / "run")
    with pytest.raises(RunFolderError) as err:
        start_fresh(run, overwrite=False)
    message = str(err.value)
    assert "already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert (run / "checkpoint.pt").read_bytes() == b"old"  # refused: nothing touched
    start_fresh(run, overwrite=True)
    assert holds_run(run) == [] and list(run.iterdir()) == []


def test_overwrite_never_empties_a_folder_that_holds_no_run(tmp_path):
    (tmp_path / "src.py").write_text("precious")
    with pytest.raises(RunFolderError, match="is not empty and holds no run .*src.py"):
        start_fresh(tmp_path, overwrite=True)
    assert (tmp_path / "src.py").read_text() == "precious"
    start_fresh(tmp_path / "new", overwrite=False)  # a new or empty folder is fine


def test_a_second_process_on_the_same_run_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with RunLock(run, command="meshlearn train --out run"):
        holder = read_lock(run)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunFolderError) as err:  # a second open file: flock excludes it too
            RunLock(run).acquire()
        assert f"pid {os.getpid()} on {socket.gethostname()}" in str(err.value)
        assert "meshlearn train --out run" in str(err.value)
    assert not (run / LOCK).exists()  # released on exit
    RunLock(run).acquire().release()


def test_a_stale_lock_from_a_dead_process_is_named_and_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": 0,
                                        "command": "meshlearn train (killed)"}))
    warnings = []
    lock = RunLock(run, warn=warnings.append).acquire()
    try:
        assert lock.stale["pid"] == pid
        assert len(warnings) == 1 and f"stale lock of pid {pid}" in warnings[0]
        assert "its process is gone" in warnings[0]
        assert read_lock(run)["pid"] == os.getpid()
    finally:
        lock.release()


def test_default_out_never_collides(tmp_path):
    first = default_out("", "configs/demo.toml", root=tmp_path, now=0)
    second = default_out("", "configs/demo.toml", root=tmp_path, now=0)
    named = default_out("my-run", None, root=tmp_path, now=0)
    assert first != second and first.is_dir() and second.is_dir()
    assert first.name.startswith("demo-") and second.name == first.name + "-2"
    assert named.name.startswith("my-run-")


def test_a_failed_fresh_setup_leaves_no_folder_behind(tmp_path):
    created = tmp_path / "created"
    created.mkdir()
    (created / "config.toml").write_text("")
    discard_fresh(created, created=True)
    assert not created.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / LOCK).write_text("{}")
    (existing / "metrics.jsonl").write_text("")
    discard_fresh(existing, created=False)
    assert [p.name for p in existing.iterdir()] == [LOCK]
