"""Under --backend dist a SIGTERM to the launcher stops every worker after the same step."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import signal_at
from test_signals import cli, train_records

from meshlearn.checkpoint_layout import MANIFEST, latest_complete
from meshlearn.config import load_config
from meshlearn.entry.launch import launch_local
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer


@pytest.mark.slow  # about 10 s: two real worker processes start, train, stop and checkpoint
def test_dist_workers_agree_on_the_stop_step_and_leave_a_complete_checkpoint(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    sets = [f"data.corpus={tiny_corpus}", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
            "model.seq_len=16", "mesh.stages=2", "mesh.replicas=1", "mesh.microbatches=2",
            "mesh.schedule=async", "train.batch_size=4", "train.steps=100000",
            "train.eval_every=2", "train.checkpoint_every=0", "train.eval_batches=1",  # async: records
            "link.bandwidth_mbit=inf", "link.latency_ms=0", "dist.threads=1", "dist.heartbeat_s=0.2"]
    proc = cli("train", "--backend", "dist", *(x for s in sets for x in ("--set", s)), "--out", str(run),
               cwd=tmp_path)
    try:
        end = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < end:
            if (run / "metrics.jsonl").is_file() and len(train_records(run)) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and (out + err).count(f"meshlearn train --resume {run}") == 1
    folder = latest_complete(run)
    step = json.loads((folder / MANIFEST).read_text())["step"]
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    assert records[-1]["step"] == step >= 2  # every worker stopped after the same step
    assert [r["step"] for r in records] == list(range(1, step + 1))
    assert sorted(p.name for p in folder.glob("*.pt")) == ["r0s0.pt", "r0s1.pt"]


SYNC_SETS = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "mesh.stages=2",
             "mesh.replicas=1", "mesh.microbatches=2", "mesh.schedule=1f1b", "train.batch_size=4",
             "train.steps=6", "train.eval_every=100", "train.checkpoint_every=0", "train.eval_batches=1",
             "link.bandwidth_mbit=inf", "link.latency_ms=0", "dist.threads=1", "dist.heartbeat_s=0.2"]


def records(run: Path) -> list[dict]:
    return [r for r in read_records(run / "metrics.jsonl") if r["kind"] == "train"]


def dist_train(tmp_path, *args, signal_spec: str | None = None) -> subprocess.CompletedProcess:
    """``meshlearn train --backend dist`` in a process of its own; with ``signal_spec``, every
    worker sends itself the signal at that point and rank 0 sends it to the launcher
    (tests/signal_at.py), as a terminal's Ctrl-C reaches the whole process group."""
    tests = Path(__file__).parents[1]
    site = signal_at.sitecustomize(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k != signal_at.ENV}
    env |= {"PYTHONPATH": os.pathsep.join(map(str, (tests.parent / "src", tests, site))),
            "OMP_NUM_THREADS": "1"}
    if signal_spec:
        env[signal_at.ENV] = signal_spec
    return subprocess.run([sys.executable, "-m", "meshlearn", "train", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


@pytest.mark.slow  # 10-20 s: a dist launcher of its own (a fresh forkserver), then the resume
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_dist_workers_stop_after_the_step_the_signal_came_in_and_resume_exactly(tiny_corpus, tmp_path, sig,
                                                                                 code):
    name, run = signal.Signals(sig).name, tmp_path / "run"
    sets = [f"data.corpus={tiny_corpus}", *SYNC_SETS]
    args = ["--backend", "dist", *(x for s in sets for x in ("--set", s))]
    stopped = dist_train(tmp_path, *args, "--out", str(run), signal_spec=f"step:2:{name}")
    assert stopped.returncode == code, stopped.stderr[-2000:]
    assert json.loads((latest_complete(run) / MANIFEST).read_text())["step"] == 3  # after the step in flight
    assert [r["step"] for r in train_records(run)] == [1, 2]  # the last line is left out by train_records
    assert stopped.stdout.rstrip().endswith(
        f"meshlearn: stopped by {name} after step 3 of 6 with a checkpoint (no validation yet); continue "
        f"with: meshlearn train --resume {run}")
    assert (stopped.stdout + stopped.stderr).count("continue with:") == 1  # the launcher does not repeat it
    assert "Traceback" not in stopped.stderr + stopped.stdout
    out = io.StringIO()  # the resume in this process: its forkserver is warm after the first test
    assert launch_local(["--resume", str(run)], load_config(run / "config.toml"), run, out=out) == 0
    assert out.getvalue().rstrip().splitlines()[-1].startswith("done: 6 steps, val loss ")
    straight = tmp_path / "straight"
    Trainer(load_config(None, [f"data.corpus={tiny_corpus}", *SYNC_SETS]), straight, progress=False).train()
    got, want = records(run), records(straight)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["train_loss"] for r in got] == pytest.approx([r["train_loss"] for r in want], abs=1e-5)


def test_a_signal_during_the_final_evaluation_of_a_dist_run_exits_128_plus_n(tiny_corpus, tmp_path):
    sets = [f"data.corpus={tiny_corpus}", *SYNC_SETS]
    done = dist_train(tmp_path, "--backend", "dist", *(x for s in sets for x in ("--set", s)), "--out",
                      str(tmp_path / "run"), signal_spec="drain:6:SIGINT")
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stdout.rstrip().splitlines()[-1].endswith(
        "(SIGINT came as the run finished: nothing was left to stop)")
