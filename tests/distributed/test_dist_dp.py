"""DistDriver == SimDriver for every message-based DP strategy (P = 2, D = 2, shaped loopback):
the same rounds, carried point to point in the background, give the same losses; deadlines are
long enough that no round is dropped in either driver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.config import load_config
from meshlearn.train import Trainer

STRATEGIES = {
    "sparse": ["dp.name=sparse", "dp.fraction=0.25", "dp.delay=2", "dp.rule=ema", "dp.ema_warm_updates=0",
               "dp.ema_ramp_end=4", "dp.deadline_s=60"],
    "sparse_sync": ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=0", "dp.rule=avg"],
    "powersgd": ["dp.name=powersgd", "dp.rank=2"],
    "diloco": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=2", "dp.overlap=1",
               "dp.deadline_s=60"],
}


# Every strategy under 1f1b; under async the ones that never block (the waiting ones share the
# phase code that 1f1b exercises), to keep the suite short.
# One over our own TCP links (dist.links = tcp): the pipeline and the DP rounds' point-to-point links.
# Every strategy with untrusted links (dist.trusted_links = false): no process group, the clip's and
# the report's gathers and the replicas' average for evaluation over framed collectives.
CASES = ([(name, "1f1b", "auto") for name in STRATEGIES]
         + [("sparse", "async", "auto"), ("diloco", "async", "auto"), ("sparse", "1f1b", "tcp")]
         + [(name, "1f1b", "untrusted") for name in STRATEGIES])


@pytest.mark.parametrize(("strategy", "schedule", "links"), CASES)
def test_dist_dp_strategy_equals_sim(tiny_corpus, tmp_path, strategy, schedule, links):
    carried = ["dist.trusted_links=false"] if links == "untrusted" else [f"dist.links={links}"]
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", f"mesh.schedule={schedule}",
                      "train.steps=4", "train.eval_every=2", *carried, *STRATEGIES[strategy])
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(60, f"the {strategy} dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, list((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-5)
    assert a[-1]["bytes_dp"] == b[-1]["bytes_dp"] > 0
    ea, eb = records(tmp_path / "sim", "eval"), records(tmp_path / "dist", "eval")
    assert [r["val_loss"] for r in ea] == pytest.approx([r["val_loss"] for r in eb], abs=1e-5)
    sa = json.loads((tmp_path / "sim" / "summary.json").read_text())
    sb = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert sa["dp_rounds"] == sb["dp_rounds"] > 0
    assert sa["dp_dropped_rounds"] == sb["dp_dropped_rounds"] == 0


def test_a_straggler_of_a_dropped_round_does_not_break_evaluation(tiny_corpus, tmp_path):
    """Rounds whose deadline is ~0 are dropped, and their late parts arrive while replica 0's stages
    evaluate: they go to the strategy, never into the validation pipeline (that crashed once)."""
    # The demo model: its rounds are large enough that their parts still travel at evaluation.
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
    cfg = load_config(demo, ["mesh.stages=2", "mesh.replicas=2", "mesh.schedule=async", "optim.name=nadamw",
                             "dp.name=sparse", "dp.delay=1", "dp.deadline_s=0.000001", "train.steps=2",
                             "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=0",
                             "dist.threads=1", f"data.corpus={tiny_corpus}", "model.seq_len=16"])
    try:
        with deadline(60, "the dist run with dropped rounds"):
            assert launch(cfg, tmp_path / "dist") == 0, list((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    assert len(records(tmp_path / "dist", "eval")) == 1
