"""Attribution of DP outliers (issue 32, step 3): each robust reduce scores every replica's row,
and a replica marked in COUNT of its last WINDOW updates is reported (``dp/attribution.py``)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.dp.attribution import COUNT, WINDOW, AttributionCallback, OutlierLedger
from meshlearn.dp.robust import Robust, outlier_scores
from meshlearn.errors import ConfigError
from meshlearn.report.progress import ProgressLine
from meshlearn.train import Trainer

MESH = ["mesh.stages=3", "mesh.replicas=4", "model.n_layer=3", "train.batch_size=16", "train.steps=8",
        "dp.robust=median"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s1", "attack.target=dp",
          "attack.start_step=1"]


def honest(d: int, n: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) + 0.1 * torch.randn(d, n, generator=g)


# --- the score -------------------------------------------------------------------------------------

def test_the_score_singles_out_a_scaled_row_and_ignores_the_gradient_scale():
    parts = honest(4)
    parts[2] *= -4
    center = Robust("median").reduce(parts)
    scores = outlier_scores(parts, center)
    assert scores.argmax().item() == 2 and scores[2] > 10 and (scores[[0, 1, 3]] < 3).all()
    assert torch.allclose(outlier_scores(1000 * parts, 1000 * center), scores)  # scale-free


def test_a_non_finite_row_scores_infinity_and_agreement_scores_zero():
    parts = honest(4)
    parts[1, 7] = torch.nan
    scores = outlier_scores(parts, Robust("median").reduce(parts))
    assert scores[1] == torch.inf and scores.isfinite().sum() == 3
    same = honest(1).expand(4, -1).clone()
    assert outlier_scores(same, same[0]).tolist() == [0.0] * 4


def test_the_mean_scores_nothing():
    assert Robust("none").reduce_scored(honest(4))[1] is None


# --- the ledger ----------------------------------------------------------------------------------

def test_count_marks_within_the_window_report_once():
    ledger = OutlierLedger(threshold=3.0)
    records = []
    for step in range(12):
        # r1s1 marked at every other step; r2s1 once only
        scores = {"r0s1": [1.0], "r1s1": [9.0 if step % 2 == 0 else 1.0], "r2s1": [5.0 if step == 3 else 1.0]}
        records += ledger.observe(step, scores)
    assert [(r["worker"], r["step"], r["count"]) for r in records] == [("r1s1", 5, COUNT)]
    assert records[0]["stage"] == 1 and records[0]["score"] == 9.0
    assert ledger.marks == {"r1s1": 6, "r2s1": 1} and ledger.scored == 36


def test_marks_older_than_the_window_do_not_count():
    ledger = OutlierLedger(threshold=3.0)
    records = []
    for step in range(4 * WINDOW):  # one mark per WINDOW steps: never COUNT of them within one window
        records += ledger.observe(step, {"r1s1": [9.0 if step % WINDOW == 0 else 1.0]})
    assert records == [] and ledger.marks == {"r1s1": 4}


# --- whole runs in the simulator -------------------------------------------------------------------

def train(tiny_corpus, tmp_path, name, *sets) -> tuple[list[dict], dict]:
    cfg = tiny_config(tiny_corpus, *MESH, *sets)
    summary = Trainer(cfg, tmp_path / name, progress=False).train()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return records, summary


def test_a_clean_run_reports_nobody(tiny_corpus, tmp_path):
    records, summary = train(tiny_corpus, tmp_path, "clean")
    assert [r for r in records if r["kind"] == "dp_outlier"] == []
    assert summary["dp_outlier_reports"] == {} and summary["dp_scored"] == 8 * 12
    assert all("dp_score_max" in r for r in records if r["kind"] == "train")


def test_the_dp_attacker_is_reported_and_nobody_else(tiny_corpus, tmp_path):
    records, summary = train(tiny_corpus, tmp_path, "hit", *ATTACK)
    reports = [r for r in records if r["kind"] == "dp_outlier"]
    assert [(r["worker"], r["stage"]) for r in reports] == [("r1s1", 1)]
    assert reports[0]["step"] <= 1 + WINDOW and reports[0]["count"] >= COUNT
    assert summary["dp_outlier_reports"] == {"r1s1": reports[0]["step"]}
    assert summary["dp_outliers"]["r1s1"] >= COUNT


def test_the_report_is_a_console_line_of_its_own():
    out = io.StringIO()
    line = ProgressLine(10, stream=out)
    line.update({"kind": "dp_outlier", "step": 4, "worker": "r1s1", "stage": 1, "score": 8.27, "count": 3})
    assert out.getvalue() == ("! step 4: DP outlier: r1s1 (stage 1: 3 of its last updates far from the "
                              "aggregate, score 8.27); reported, not evicted\n")


@pytest.mark.parametrize("value", ["1", "0.5", "nan", "inf"])
def test_a_bad_outlier_score_is_one_line_naming_the_key(tiny_corpus, value):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *MESH, f"dp.outlier_score={value}")
    assert "dp.outlier_score" in str(err.value) and "\n" not in str(err.value)


def test_a_resumed_run_reports_as_an_uninterrupted_one(tiny_corpus, tmp_path):
    """The marks of the window travel in the checkpoint: a resume between the attacker's marks
    (steps 2 and 3 marked before the stop, 4 after) still reports it at step 4, once."""
    whole, whole_summary = train(tiny_corpus, tmp_path, "whole", *ATTACK, "train.checkpoint_every=3")
    cfg = tiny_config(tiny_corpus, *MESH, *ATTACK, "train.checkpoint_every=3")
    Trainer(tiny_config(tiny_corpus, *MESH, *ATTACK, "train.checkpoint_every=3", "train.stop_at_step=3"),
            tmp_path / "split", progress=False).train()
    split_summary = Trainer(cfg, tmp_path / "split", progress=False, resume=True).train()
    split = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    keep = ("kind", "step", "worker", "stage", "score", "count")
    reports = [[{k: r[k] for k in keep} for r in run if r["kind"] == "dp_outlier"] for run in (whole, split)]
    assert reports[0] == reports[1] and [r["step"] for r in reports[0]] == [4]
    for key in ("dp_outliers", "dp_outlier_reports", "dp_scored"):
        assert whole_summary[key] == split_summary[key], key


ASYNC = ["mesh.schedule=async", "dp.robust=centered_clip"]  # M = 2, update_every = 1: 2 updates a step


def test_attribution_counts_marks_per_update_under_the_async_schedule(tiny_corpus, tmp_path):
    """Calibrated per update: a clean async run reports nobody; an attacked one (×−4 from step 2)
    reports the attacker at its sixth attacked update (2·COUNT marks: 2 updates a step), in step
    4, nobody else; every update is scored (2 per step)."""
    clean, clean_summary = train(tiny_corpus, tmp_path, "async_clean", *ASYNC)
    hit, hit_summary = train(tiny_corpus, tmp_path, "async_hit", *ASYNC, *ATTACK)
    assert not any(r["kind"] == "dp_outlier" for r in clean) and clean_summary["dp_outlier_reports"] == {}
    assert clean_summary["dp_scored"] == 8 * 12 * 2
    assert all("dp_score_max" in r for r in clean if r["kind"] == "train")
    reports = [r for r in hit if r["kind"] == "dp_outlier"]
    assert [(r["worker"], r["step"], r["count"], r["evicted"]) for r in reports] == [
        ("r1s1", 4, 2 * COUNT, False)]
    assert hit_summary["dp_outlier_reports"] == {"r1s1": 4}


def test_marks_are_counted_per_update_in_a_window_of_steps():
    """Two updates a step (``per_step = 2``: 2·COUNT marks in the last 2·WINDOW updates): an honest
    burst, a spike in one update of each of 3 steps, reports nobody — a step's largest score (3
    marked steps of 3) or COUNT marks in WINDOW updates would report it; a replica marked in every
    update is reported at its sixth, in the third step."""
    def scores(step):
        return {"r0s1": [1.0, 1.0], "r1s1": [9.0, 9.0], "r2s1": [9.0 if step < 3 else 1.0, 1.0]}
    calibrated, per_update, per_step = OutlierLedger(3.0, per_step=2), OutlierLedger(3.0), OutlierLedger(3.0)
    records = []
    for step in range(8):
        records += calibrated.observe(step, scores(step))
        per_update.observe(step, scores(step))
        per_step.observe(step, {w: [max(s)] for w, s in scores(step).items()})
    assert [(r["worker"], r["step"], r["count"]) for r in records] == [("r1s1", 3, 2 * COUNT)]
    assert calibrated.marks == {"r1s1": 16, "r2s1": 3} and calibrated.scored == 8 * 3 * 2
    assert "r2s1" in per_update.reported and "r2s1" in per_step.reported


@pytest.mark.slow
def test_a_longer_clean_async_run_reports_nobody_where_a_step_s_largest_score_would(tiny_corpus, tmp_path,
                                                                                     monkeypatch):
    """24 clean async steps (seed 0, centered clipping): the run, counting per update, reports
    nobody; the same scores counted per step (a step's largest) report two honest replicas, the
    uncalibrated rule this replaced."""
    seen: list[dict[str, list[float]]] = []
    on_step_end = AttributionCallback.on_step_end

    def keep(self, step, report):
        seen.append(report.dp_scores)
        return on_step_end(self, step, report)
    monkeypatch.setattr(AttributionCallback, "on_step_end", keep)
    records, summary = train(tiny_corpus, tmp_path, "long", *ASYNC, "train.steps=24", "seed=0")
    assert not any(r["kind"] == "dp_outlier" for r in records) and summary["dp_scored"] == 24 * 12 * 2
    per_step = OutlierLedger(threshold=3.0)
    for step, scores in enumerate(seen):
        per_step.observe(step, {w: [max(s)] for w, s in scores.items()})
    assert per_step.reported == {"r2s0": 12, "r2s1": 12}
