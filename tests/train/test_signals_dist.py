"""Under --backend dist a SIGTERM to the launcher stops every worker after the same step."""

import json
import signal
import time

import pytest
from test_signals import cli, train_records

from meshlearn.train.checkpoint import MANIFEST, latest_complete


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
    assert "Traceback" not in err and f"meshlearn train --resume {run}" in err
    folder = latest_complete(run)
    step = json.loads((folder / MANIFEST).read_text())["step"]
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    assert records[-1]["step"] == step >= 2  # every worker stopped after the same step
    assert [r["step"] for r in records] == list(range(1, step + 1))
    assert sorted(p.name for p in folder.glob("*.pt")) == ["r0s0.pt", "r0s1.pt"]
