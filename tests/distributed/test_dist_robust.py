"""DistDriver == SimDriver with a robust DP rule (``dp.robust``, issue 32): the same stacked
contributions reduced the same way give the same losses, over framed streams (untrusted links) and
over a gloo all-gather (trusted); and the DP attack (``attack.target = dp``) lands the same."""

from __future__ import annotations

import json

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.train import Trainer

MESH = ["mesh.stages=1", "mesh.replicas=3", "train.batch_size=12", "train.steps=3"]
ATTACKED = ["mesh.stages=3", "model.n_layer=3", "mesh.replicas=3", "train.batch_size=12", "train.steps=3",
            "attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s1", "attack.target=dp",
            "attack.start_step=1", "verify.name=sentinel"]
CASES = {
    "trimmed_mean": [*MESH, "dp.robust=trimmed_mean", "dist.trusted_links=false"],
    "median": [*MESH, "dp.robust=median", "dist.trusted_links=false"],
    "centered_clip": [*MESH, "dp.robust=centered_clip", "dist.trusted_links=false"],
    "median_gloo": [*MESH, "dp.robust=median"],
    "sparse_median": [*MESH, "dp.robust=median", "dp.name=sparse", "dp.fraction=0.5", "dp.delay=0",
                      "dp.rule=avg"],
    "attacked_clip": [*ATTACKED, "dp.robust=centered_clip", "dist.trusted_links=false"],
}


def sim_and_dist(cfg, tmp_path, what: str) -> None:
    """``cfg`` trained by the simulator (tmp_path/sim) and by real processes (tmp_path/dist)."""
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(90, what):
            assert launch(cfg, tmp_path / "dist") == 0, list((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")


@pytest.mark.parametrize("case", list(CASES))
def test_dist_robust_rule_equals_sim(tiny_corpus, tmp_path, case):
    cfg = tiny_config(tiny_corpus, *CASES[case])
    sim_and_dist(cfg, tmp_path, f"the {case} dist run")
    a, b = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(a, b, strict=True)) <= 1e-5
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-5)


def test_dist_reports_and_evicts_the_dp_outlier_the_simulator_does(tiny_corpus, tmp_path):
    """Attribution (``dp/attribution.py``): every replica scores the same stacked contributions,
    and dist's rows carry each worker's score to every process, so its records are the simulator's;
    the eviction (a ban within the budget: 1 of 3 replicas) comes at the same step, from the same
    donor, and the steps after it train the same."""
    cfg = tiny_config(tiny_corpus, *ATTACKED, "train.steps=6", "dp.robust=median", "dist.trusted_links=false")
    sim_and_dist(cfg, tmp_path, "the attributed dist run")
    timing = ("tokens", "sim_time_s", "wall_time_s", "bytes_pp", "bytes_dp")
    a, b = ([{k: v for k, v in r.items() if k not in timing} for r in records(run, "dp_outlier")]
            for run in (tmp_path / "sim", tmp_path / "dist"))
    assert [(r["worker"], r["step"], r["evicted"]) for r in a] == [("r1s1", 4, True)]
    assert b == a  # the score too, bit for bit
    bans = [[{k: v for k, v in r.items() if k not in timing} for r in records(run, "ban")]
            for run in (tmp_path / "sim", tmp_path / "dist")]
    assert [(r["worker"], r["step"], r["message"]) for r in bans[0]] == [("r1s1", 4, "dp")]
    assert bans[1] == bans[0]
    # The verifier's ledger counts it against stage 1's budget, as the simulator's shared one does.
    verifier_log = (tmp_path / "dist" / "logs" / "verifier.log").read_text()
    assert "step 4: r1s1 was evicted as a DP outlier; it counts against stage 1's ban budget" in verifier_log
    sim, dist = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert [r["dp_score_max"] for r in dist] == [r["dp_score_max"] for r in sim]
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(sim, dist, strict=True)) <= 1e-5


@pytest.mark.slow  # two dist launches: about 25 s on a quiet machine (48 s at load 10)
def test_a_dist_run_resumed_after_an_eviction_is_the_simulators_uninterrupted_run(tiny_corpus, tmp_path):
    """Evicted at step 4, checkpoint at step 6, stopped there and resumed to 8: the replaced worker,
    the stopped attack and the spent budget come back (the verifier's state is taken after it
    counted the eviction: ``Relay.answer_state_request``)."""
    sets = [*ATTACKED, "train.steps=8", "dp.robust=median", "dist.trusted_links=false",
            "train.checkpoint_every=3"]
    Trainer(tiny_config(tiny_corpus, *sets), tmp_path / "sim", progress=False).train()
    run = tmp_path / "dist"
    try:
        with deadline(120, "the dist run stopped after its eviction and its resume"):
            assert launch(tiny_config(tiny_corpus, *sets, "train.stop_at_step=6"), run) == 0
            assert launch(tiny_config(tiny_corpus, *sets), run, resume=True) == 0
    finally:
        kill_leftovers(run)
    sim, dist = records(tmp_path / "sim"), records(run)
    assert [r["step"] for r in dist] == list(range(1, 9))
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(sim, dist, strict=True)) <= 1e-5
    keep = ("worker", "step", "message", "replaced_from", "strikes")
    assert ([{k: r[k] for k in keep} for r in records(run, "ban")]
            == [{k: r[k] for k in keep} for r in records(tmp_path / "sim", "ban")] != [])
    summary = json.loads((run / "summary.json").read_text())
    assert [b["worker"] for b in summary["banned_workers"]] == ["r1s1"]



@pytest.mark.parametrize("strategy", [["dp.name=powersgd", "dp.rank=2"],
                                      ["dp.name=diloco", "dp.inner_steps=1", "dp.fragments=1"]],
                         ids=["powersgd", "diloco"])
def test_dist_scores_a_message_strategys_rounds_as_the_simulator_does(tiny_corpus, tmp_path, strategy):
    """A message strategy's robust rounds (PowerSGD's P and Q, a DiLoCo pseudo-gradient) are scored
    in each process from the same stacked parts and reported with the merging update's step
    (``DPStrategy.note_score``), so dist's scores are the simulator's bit for bit. (A DP attack on a
    message strategy cannot run under dist: an attack there needs SENTINEL, which needs the
    all-reduce; the scores are what the same decisions are made from.)"""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.stages=2", "model.n_layer=2", *strategy, "train.steps=4",
                      "dp.robust=median", "dist.trusted_links=false")
    sim_and_dist(cfg, tmp_path, "the scored dist run")
    sim, dist = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert all(isinstance(r.get("dp_score_max"), float) for r in sim) and len(sim) == 4
    assert [r["dp_score_max"] for r in dist] == [r["dp_score_max"] for r in sim]
    assert max(abs(x["train_loss"] - y["train_loss"]) for x, y in zip(sim, dist, strict=True)) <= 1e-5


def test_dist_scores_every_async_update_as_the_simulator_does(tiny_corpus, tmp_path):
    """Under ``async`` a step has M / update_every updates (2 here), each scored: the rows carry
    every update's score (M slots), gathered at the drain points, so dist's ledger sees the
    simulator's scores and counts as many."""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.stages=2", "model.n_layer=2", "mesh.schedule=async",
                      "train.steps=4", "dp.robust=median", "dist.trusted_links=false")
    sim_and_dist(cfg, tmp_path, "the async scored dist run")
    sim, dist = records(tmp_path / "sim"), records(tmp_path / "dist")
    assert all(isinstance(r.get("dp_score_max"), float) for r in sim) and len(sim) == 4
    assert [r["dp_score_max"] for r in dist] == [r["dp_score_max"] for r in sim]
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("sim", "dist")]
    assert summaries[0]["dp_scored"] == summaries[1]["dp_scored"] == 4 * 6 * 2
