"""Attribution of the message strategies' robust rounds (issue 32): a sparse slice, PowerSGD's P and
Q factors, a DiLoCo pseudo-gradient (or its factors) are scored as the all-reduce's gradients are
(``Exchange.mean`` keeps every replica's score, ``DPStrategy.note_score`` reports them with the
update that merges the round), so a replica that is repeatedly the outlier is reported and evicted."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.dp.base import DPStrategy, Exchange
from meshlearn.dp.robust import Robust
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer

MESH = ["mesh.stages=3", "mesh.replicas=4", "model.n_layer=3", "train.batch_size=16", "train.steps=8",
        "dp.robust=median"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s1", "attack.target=dp",
          "attack.start_step=1"]
STRATEGIES = {
    "sparse": ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=0", "dp.rule=avg"],
    "powersgd": ["dp.name=powersgd", "dp.rank=2"],
    "diloco": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=1"],
    "diloco_factors": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=1", "dp.compress=powersgd",
                       "dp.rank=2"],
}


# --- one round among 4 replicas ---------------------------------------------------------------

def exchange_round(parts: torch.Tensor, rule: str) -> list[Exchange]:
    """Round (5, 0) among ``len(parts)`` replicas of stage 1, every part delivered and reduced."""
    d = parts.shape[0]
    exchanges = [Exchange(WorkerId(r, 1), d, Robust(rule)) for r in range(d)]
    for m in [m for r, ex in enumerate(exchanges) for m in ex.share((5, 0), parts[r], 5)]:
        exchanges[m.dst.replica].receive(m)
    for ex in exchanges:
        ex.mean((5, 0))
    return exchanges


def honest(d: int, n: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, generator=g) + 0.1 * torch.randn(d, n, generator=g)


@pytest.mark.parametrize("rule", ["trimmed_mean", "median", "centered_clip"])
def test_each_replica_keeps_every_replica_s_score_the_same_and_the_outlier_stands_out(rule):
    """Every member's scores, bit for bit alike on each: the stage's rows vote a worker's score."""
    parts = honest(4)
    parts[2] *= -4
    kept = [ex.scores[(5, 0)] for ex in exchange_round(parts, rule)]
    scores = kept[0]
    assert kept == [scores] * 4 and len(scores) == 4
    assert scores[2] > 10 and max(scores[:2] + scores[3:]) < 3


def test_agreeing_contributions_score_zero_and_the_mean_scores_nothing():
    same = honest(1).expand(4, -1).clone()
    assert [ex.scores[(5, 0)] for ex in exchange_round(same, "median")] == [[0.0] * 4] * 4
    assert all(ex.scores == {} for ex in exchange_round(honest(4), "none"))


def test_a_score_is_reported_once_with_the_merging_update_and_a_dropped_round_reports_none():
    strategy = DPStrategy(WorkerId(1, 1), 4)
    strategy.exchange.scores = {(5, 0): [0.5, 7.5, 0.25, 1.0], (6, 0): [1.0] * 4}
    noted = []
    strategy.scored = lambda u, scores: noted.append((u, scores))
    strategy.note_score(8, (5, 0))
    strategy.note_score(8, (5, 0))  # merged once: nothing left to report
    strategy.exchange.expire((6, 0))
    strategy.note_score(9, (6, 0))
    assert noted == [(8, [0.5, 7.5, 0.25, 1.0])]


def test_a_kept_score_travels_in_the_checkpoint():
    ex = exchange_round(honest(4), "median")[1]
    ex.parts = {}  # as at a drain point: the round is complete, its merge still due
    copy = Exchange(WorkerId(1, 1), 4, Robust("median"))
    copy.load_state_dict(ex.state_dict())
    assert copy.scores == ex.scores != {}


# --- whole runs in the simulator ---------------------------------------------------------------

def train(tiny_corpus, tmp_path, name, *sets) -> tuple[list[dict], dict]:
    cfg = tiny_config(tiny_corpus, *MESH, *sets)
    summary = Trainer(cfg, tmp_path / name, progress=False).train()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, summary


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_strategys_dp_attacker_is_reported_and_nobody_else(tiny_corpus, tmp_path, strategy):
    """Evicted where the scores are calibrated; reported only where its rounds carry PowerSGD
    factors with error feedback (``dp/settings.evicts_dp_outliers``)."""
    evicts = strategy in ("sparse", "diloco")
    records, summary = train(tiny_corpus, tmp_path, "hit", *STRATEGIES[strategy], *ATTACK)
    reports = [r for r in records if r["kind"] == "dp_outlier"]
    assert [(r["worker"], r["evicted"]) for r in reports] == [("r1s1", evicts)]
    assert ([(b["worker"], b["message"]) for b in summary.get("banned_workers", [])]
            == ([("r1s1", "dp")] if evicts else []))
    assert summary["dp_outliers"]["r1s1"] >= 3


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_clean_run_of_the_strategy_scores_every_replica_and_reports_nobody(tiny_corpus, tmp_path, strategy):
    records, summary = train(tiny_corpus, tmp_path, "clean", *STRATEGIES[strategy])
    rounds_per_step = 0.5 if strategy.startswith("diloco") else 1  # diloco: a sync every 2 updates
    assert summary["dp_scored"] == 8 * rounds_per_step * 12  # 12 workers, one score per synced step
    assert [r for r in records if r["kind"] == "dp_outlier"] == [] and summary.get("banned_workers", []) == []


def test_rounds_behind_the_updates_report_but_never_evict(tiny_corpus, tmp_path):
    """sparse with dp.delay > 0: a round is merged 2 updates after it starts, so no step ends at a
    drain point and no donor's state can be handed over: the attacker is reported, not evicted."""
    records, summary = train(tiny_corpus, tmp_path, "delay", "dp.name=sparse", "dp.fraction=0.5",
                             "dp.delay=2", "dp.rule=avg", *ATTACK)
    reports = [r for r in records if r["kind"] == "dp_outlier"]
    assert [(r["worker"], r["evicted"]) for r in reports] == [("r1s1", False)]
    assert [r for r in records if r["kind"] == "ban"] == [] and summary.get("banned_workers", []) == []
    # scored at the merging update: the first rounds (updates 0, 1) merge at steps 3 and 4
    first = [r["step"] for r in records if r["kind"] == "train" and r.get("dp_score_max") is not None]
    assert first[0] == 3


def test_a_run_resumed_between_a_rounds_completion_and_its_merge_scores_as_an_uninterrupted_one(
        tiny_corpus, tmp_path):
    """sparse with dp.delay = 2, stopped at step 3: the rounds of updates 1 and 2 are complete there
    (the checkpoint is at a drain point) but merge at steps 4 and 5; their scores travel in the
    checkpoint (``Exchange.scores``), so the resumed run scores and reports what the whole run does."""
    sets = ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=2", "dp.rule=avg", *ATTACK,
            "train.checkpoint_every=3"]
    whole, whole_summary = train(tiny_corpus, tmp_path, "whole", *sets)
    Trainer(tiny_config(tiny_corpus, *MESH, *sets, "train.stop_at_step=3"), tmp_path / "split",
            progress=False).train()
    split_summary = Trainer(tiny_config(tiny_corpus, *MESH, *sets), tmp_path / "split", progress=False,
                            resume=True).train()
    split = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    scores = [[(r["step"], r.get("dp_score_max")) for r in run if r["kind"] == "train"]
              for run in (whole, split)]
    assert scores[0] == scores[1] and all(s is not None for _, s in scores[0][2:])
    keep = ("kind", "step", "worker", "score", "count", "evicted")
    assert ([{k: r[k] for k in keep} for r in whole if r["kind"] == "dp_outlier"]
            == [{k: r[k] for k in keep} for r in split if r["kind"] == "dp_outlier"] != [])
    for key in ("dp_outliers", "dp_outlier_reports", "dp_scored"):
        assert whole_summary[key] == split_summary[key], key
