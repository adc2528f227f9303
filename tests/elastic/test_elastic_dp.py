"""Message-based DP strategies under elastic membership, with real processes on loopback (shaped
links): with fixed membership the elastic run equals the fixed-membership driver; a SIGKILLed
replica leaves, its row partner spectates and the others finish."""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import (  # noqa: E402
    launch_and_signal,
    launch_fixed_and_elastic,
    records,
    tensors,
)
from tiny import tiny_config  # noqa: E402

from meshlearn.entry.launch import WORKERS_FILE  # noqa: E402
from meshlearn.statefile import load_state

# Long deadlines: the fixed driver drops a round that runs behind past its deadline (the elastic
# one reduces every round inside its step), and a dropped round would make the runs differ.
STRATEGIES = {
    "diloco": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=2", "dp.overlap=1", "dp.deadline_s=60"],
    "diloco_powersgd": ["dp.name=diloco", "dp.inner_steps=2", "dp.compress=powersgd", "dp.rank=2"],
    "powersgd": ["dp.name=powersgd", "dp.rank=2"],
    "sparse": ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=1", "dp.rule=ema", "dp.ema_warm_updates=0",
               "dp.ema_ramp_end=4", "dp.deadline_s=60"],
}
BASE = ["backend=dist", "mesh.replicas=2", "dist.timeout_s=5", "dist.dead_after_s=2"]
# P = 2: the elastic driver clips per stage (grad_clip / √P), the fixed one by the norm over the
# row's stages, so clipping is off there; with one stage the two clips are the same.
PIPELINE = ["mesh.stages=2", "train.grad_clip=0"]


def _shard(run: Path, step: int, name: str) -> dict:
    folder = run / "checkpoints" / f"step-{step:06d}"
    return load_state(folder / f"{name}.pt")["workers"][name]


@pytest.mark.parametrize(("strategy", "stages"), [("diloco", 2), ("diloco_powersgd", 1), ("powersgd", 1),
                                                  ("sparse", 1)])
def test_elastic_strategy_with_fixed_membership_equals_the_fixed_driver(tiny_corpus, tmp_path, strategy,
                                                                        stages):
    steps = 6
    cfg = tiny_config(tiny_corpus, *BASE, *(PIPELINE if stages == 2 else []), f"train.steps={steps}",
                      *STRATEGIES[strategy])
    runs = launch_fixed_and_elastic(cfg, tmp_path, 90, f"the {strategy} runs")
    a, b = records(runs["fixed"]), records(runs["elastic"])
    assert [r["step"] for r in b] == list(range(1, steps + 1)) and all(r["committed"] for r in b)
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    summary = json.loads((runs["elastic"] / "summary.json").read_text())
    fixed = json.loads((runs["fixed"] / "summary.json").read_text())
    # the fixed driver sums its counters over the processes; the elastic summary is one last
    # stage's own (the same on every replica: every round is in every replica's quorum)
    assert summary["dp_rounds"] == fixed["dp_rounds"] // (2 * stages) > 0
    assert summary["dp_dropped_rounds"] == fixed["dp_dropped_rounds"] == 0
    # Weights and the strategy's whole state (outer weights, momentum, error feedback, Q, pending
    # rounds) bit for bit: with two replicas every mean is (a + b) / 2 in both drivers.
    for name in ("r0s0", f"r1s{stages - 1}"):
        x, y = _shard(runs["fixed"], steps, name), _shard(runs["elastic"], steps, name)
        for key, tensor in x["module"].items():
            assert torch.equal(tensor, y["module"][key]), (name, key)
        a, b = list(tensors(x["dp"])), list(tensors(y["dp"]))
        assert len(a) == len(b) > 0 and all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), name


@pytest.mark.parametrize("strategy", ["diloco", "powersgd", "sparse"])
def test_a_killed_replica_leaves_and_the_others_finish_the_strategy(tiny_corpus, tmp_path, strategy):
    """r1s1 SIGKILLed after two committed steps (inner_steps = 1: every DiLoCo update has an outer
    round, so the kill lands in a step with one; sparse averaging, delay 1: a round in flight over
    every update): r1s1 leaves, its partner r1s0 spectates, row 0 trains the rest alone, and every
    round after that is row 0's."""
    sets = STRATEGIES[strategy] + (["dp.inner_steps=1", "dp.fragments=1", "dp.overlap=0"]
                                   if strategy == "diloco" else [])
    cfg = tiny_config(tiny_corpus, *BASE, *PIPELINE, "train.steps=8", "elastic.enabled=true", *sets)
    run = tmp_path / "run"
    assert launch_and_signal(cfg, run, "r1s1", signal.SIGKILL, 120) == 0
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[0]["rows"] == [0, 1] and rows[-1]["rows"] == [0] and rows[-1]["participants"] == 1
    committed = [r for r in rows if r["committed"]]
    assert all(math.isfinite(r["train_loss"]) for r in committed)
    # The step the kill landed in; two were lost in 2 of ~14 runs when the partner left in the middle
    # of a spectated step's rounds. It stays now (it never leaves on a partner's death); the bound
    # is kept from then, not rerun enough to tighten.
    assert len(rows) - len(committed) <= 2
    # the rounds of an update that did not commit are run again, over the survivors, by the next
    # step: it trains the same batch
    assert [r["batch"] for r in committed] == list(range(len(committed)))
    for r, following in zip(rows, rows[1:], strict=False):
        assert following["batch"] == r["batch"] + r["committed"]
    summary = json.loads((run / "summary.json").read_text())
    # one round per committed update (PowerSGD counts its P and Q phases as one round, at
    # pre_step); an uncommitted one is rolled back, counter included, and retried
    assert summary["dp_rounds"] == len(committed) and summary["dp_dropped_rounds"] == 0
    members = json.loads((run / WORKERS_FILE).read_text())
    assert members["r1s1"]["events"][-1]["why"] == "killed by SIGKILL"
    assert [e["event"] for e in members["r1s0"]["events"]] == ["joined", "spectates", "finished"]
    for name in ("r0s1", "r1s0"):
        assert members[name]["events"][-1] == {"event": "finished", "step": 8, "why": "finished"}
