"""Runs whose links are not trusted (``dist.trusted_links = "false"``): no process group in any
process; the DP all-reduce, the per-step gather, barriers and the validation broadcast run over
framed streams (``distributed/collectives.py``), and the run is still the simulator's."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psutil
import pytest
from dist_helpers import deadline, kill_leftovers, launch, records, train_records, wait_until
from tiny import tiny_config

from meshlearn.distributed.collectives import FRAME_OVERHEAD
from meshlearn.entry.launch import WORKERS_FILE
from meshlearn.train import Trainer

UNTRUSTED = "dist.trusted_links=false"


def _listening(pids: list[int]) -> dict[int, list]:
    """Each process's listening TCP sockets."""
    return {pid: [c.laddr for c in psutil.Process(pid).net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN] for pid in pids}


def _run(cfg, run_dir: Path, *sets: str, watch: bool = False) -> dict[int, list]:
    """Launch; with ``watch``, each worker's listening sockets once its first step is in."""
    seen: dict[int, list] = {}
    result: dict[str, int] = {}
    try:
        with deadline(60, "the dist run"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run_dir, *sets)))
            thread.start()
            if watch:
                wait_until(lambda: train_records(run_dir) >= 1, 50, "the first step")
                workers = json.loads((run_dir / WORKERS_FILE).read_text())
                seen = _listening([info["pid"] for info in workers.values()])
            thread.join()
    finally:
        kill_leftovers(run_dir)
    assert result.get("code") == 0, list((run_dir / "logs").iterdir())
    return seen


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_untrusted_links_train_as_the_simulator_with_no_process_group(tiny_corpus, tmp_path, schedule):
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", f"mesh.schedule={schedule}",
                      "train.steps=12", "train.eval_every=6")
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    listening = _run(cfg, tmp_path / "dist", UNTRUSTED, watch=schedule == "1f1b")
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == list(range(1, 13))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]  # bit for bit
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-6)
    assert [r["val_loss"] for r in records(tmp_path / "sim", "eval")] == [
        r["val_loss"] for r in records(tmp_path / "dist", "eval")]
    # What the frames put on the DP axis (counted from the start): per update, each of the 4 workers'
    # gradients plus a frame's 32 bytes to its one other replica; the simulator's ring at D = 2
    # moves N each. (Async: 2 updates a step, M / update_every; each process counts between its
    # own step ends, so only a drain point's totals agree.)
    updates = 1 if schedule == "1f1b" else cfg.mesh.microbatches // cfg.mesh.update_every
    drains = [r["step"] for r in a if schedule == "1f1b" or r["step"] % 6 == 0]
    assert a[0]["bytes_dp"] > 0 and updates == (1 if schedule == "1f1b" else 2)
    assert [r["bytes_dp"] for r in b if r["step"] in drains] == [
        r["bytes_dp"] + 4 * updates * FRAME_OVERHEAD * r["step"] for r in a if r["step"] in drains]
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary["compute_model"] == "real: 4 processes over framed TCP streams, shaping=sender"
    if schedule == "1f1b":  # the pipeline's and the collectives' listeners closed once connected; no gloo
        assert len(listening) == 4 and all(not socks for socks in listening.values()), listening


def test_a_trusted_runs_workers_hold_gloo_listeners_the_control_of_the_check_above(tiny_corpus, tmp_path):
    """The same look at a run with process groups (``dist.trusted_links = "true"``): every worker
    holds gloo's listening sockets (one per group it is in), so the check above can fail."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "mesh.schedule=1f1b", "train.steps=12")
    listening = _run(cfg, tmp_path / "dist", "dist.trusted_links=true", watch=True)
    assert len(listening) == 4 and all(socks for socks in listening.values()), listening


def test_an_anchored_run_with_untrusted_links_equals_the_simulator(tiny_corpus, tmp_path):
    """The anchor circuit's processes join no group either: their links are streams, and the fast
    workers' sums of the anchors' totals go through the framed gather."""
    from test_dist_anchor import ANCHOR, FAST

    cfg = tiny_config(tiny_corpus, *FAST, *ANCHOR, "anchor.bandwidth_mbit=10000", "anchor.latency_ms=0")
    sim = Trainer(cfg, tmp_path / "sim", progress=False).train()
    _run(cfg, tmp_path / "dist", UNTRUSTED)
    dist = json.loads((tmp_path / "dist" / "summary.json").read_text())
    for key in ("anchor_passes", "anchor_delivered", "anchor_bytes_snapshot", "anchor_bytes_gradients",
                "spectral_anchor_accepted", "spectral_corrected_steps"):
        assert sim[key] == dist[key], key
    assert sim["anchor_passes"] == 3
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], abs=1e-5)


def test_three_replicas_sum_in_the_simulators_order_bit_for_bit(tiny_corpus, tmp_path):
    """D = 3, where a gloo ring adds in another order: the framed sum is the simulator's own."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=3", "mesh.schedule=1f1b",
                      "train.batch_size=12", "train.steps=4")
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    _run(cfg, tmp_path / "dist", UNTRUSTED)
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
