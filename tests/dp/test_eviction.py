"""Eviction of a DP outlier (issue 32, step 3): a reported replica is banned like a SENTINEL ban,
within the same budget (``TrustLayer.evict``, ``Ledger.decide``), and carried out the same way."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from tiny import tiny_config

from meshlearn.dp.attribution import OutlierLedger
from meshlearn.entry.plugins import register_builtin_plugins
from meshlearn.mesh import sim
from meshlearn.mesh.topology import WorkerId
from meshlearn.report.plugins import scalars
from meshlearn.report.progress import ProgressLine
from meshlearn.train import Trainer

MESH = ["mesh.stages=3", "mesh.replicas=4", "model.n_layer=3", "train.batch_size=16", "train.steps=8",
        "dp.robust=median"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s1", "attack.target=dp",
          "attack.start_step=1"]
TIMING = ("tokens", "sim_time_s", "wall_time_s", "step_wall_s", "bytes_pp", "bytes_dp")


def run(tiny_corpus, run_dir, *sets, resume: bool = False) -> tuple[list[dict], dict]:
    summary = Trainer(tiny_config(tiny_corpus, *MESH, *sets), run_dir, progress=False, resume=resume).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, summary


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records if r["kind"] == kind]


def trust_layer(tiny_corpus, tmp_path, *sets):
    """A run's trust layer, before any step (the budget's decisions need no training)."""
    register_builtin_plugins()
    return Trainer(tiny_config(tiny_corpus, *sets), tmp_path, progress=False).plugins["trust"].trust


# --- whole runs ----------------------------------------------------------------------------------

def test_the_dp_attacker_is_evicted_at_its_report_and_replaced(tiny_corpus, tmp_path):
    """×−4 at r1s1 from step 2 (1-based): marked at steps 2, 3, 4, so reported and evicted at step 4;
    the honest replica least marked gives its state, the attack ends there."""
    records, summary = run(tiny_corpus, tmp_path / "hit", *ATTACK)
    [report] = of_kind(records, "dp_outlier")
    assert (report["worker"], report["step"], report["evicted"]) == ("r1s1", 4, True)
    [ban] = of_kind(records, "ban")
    assert ban == {"kind": "ban", "worker": "r1s1", "step": 4, "metric": "dp_score", "boundary": "s1 dp",
                   "message": "dp", "strikes": report["count"], "replaced_from": "r0s1", "honest": False}
    assert summary["banned_workers"] == [{k: v for k, v in ban.items() if k != "kind"}]
    [attacker] = summary["trust"]["attackers"]
    assert attacker["ban_step"] == 4 and summary["trust"]["workers"]["fp"] == 0
    assert summary["dp_outlier_reports"] == {"r1s1": 4}


def test_the_attacker_s_own_row_saying_no_score_changes_nothing(tiny_corpus, tmp_path, monkeypatch):
    """Under dist each process writes its own row of a step (``ProcessRow``), so the attacker can
    write "no score" (``NO_SCORE``) into its own. Its stage's rows vote its score
    (``mesh/report.voted_scores``): at D = 3 the two honest rows outvote it, so it is reported and
    evicted at the step it is when its row tells the truth, and every score and loss is the same.
    The row is doctored where the simulator hands the rows to the report, the function dist's
    gathered rows go through too (``ProcessRows.report``)."""
    d3 = ["mesh.replicas=3", "train.batch_size=12", "train.steps=6", *ATTACK]
    told, _ = run(tiny_corpus, tmp_path / "told", *d3)
    real = sim.mesh_report

    def lying(step, mesh, rows, *rest):
        rows[WorkerId(1, 1)] = dataclasses.replace(rows[WorkerId(1, 1)], dp_scores={})
        return real(step, mesh, rows, *rest)

    monkeypatch.setattr(sim, "mesh_report", lying)
    lied, _ = run(tiny_corpus, tmp_path / "lied", *d3)
    reports = of_kind(lied, "dp_outlier")
    assert [(r["worker"], r["step"], r["evicted"]) for r in reports] == [("r1s1", 4, True)]
    for kind in ("train", "dp_outlier", "ban"):
        assert of_kind(lied, kind) == of_kind(told, kind), kind


def test_a_clean_run_of_the_same_length_evicts_nobody(tiny_corpus, tmp_path):
    records, summary = run(tiny_corpus, tmp_path / "clean")
    assert of_kind(records, "ban") == [] and of_kind(records, "alert") == []
    assert summary["banned_workers"] == [] and summary["trust"]["bans"] == 0


def test_verify_ban_false_reports_without_evicting(tiny_corpus, tmp_path):
    records, summary = run(tiny_corpus, tmp_path / "report_only", *ATTACK, "verify.ban=false")
    assert [(r["worker"], r["evicted"]) for r in of_kind(records, "dp_outlier")] == [("r1s1", False)]
    assert of_kind(records, "ban") == [] and "banned_workers" not in summary


def test_a_run_resumed_after_an_eviction_is_the_uninterrupted_run(tiny_corpus, tmp_path):
    """The eviction (step 4) lies before the checkpoint (step 6): the replaced worker's state, the
    stopped attack, the spent budget and the restarted window all travel in it."""
    sets = [*ATTACK, "train.checkpoint_every=3"]
    whole, whole_summary = run(tiny_corpus, tmp_path / "whole", *sets)
    run(tiny_corpus, tmp_path / "split", *sets, "train.stop_at_step=6")
    split, split_summary = run(tiny_corpus, tmp_path / "split", *sets, resume=True)
    for kind in ("train", "ban", "dp_outlier"):
        assert of_kind(split, kind) == of_kind(whole, kind), kind
    assert [r["step"] for r in of_kind(split, "ban")] == [4]
    for key in ("banned_workers", "dp_outliers", "dp_outlier_reports", "dp_scored"):
        assert split_summary[key] == whole_summary[key], key


def test_two_replicas_never_evict_anybody(tiny_corpus, tmp_path):
    """D = 2: no robust rule (config refuses it), so nothing is scored, reported or evicted: the
    attacker's ×−4 reaches the mean. That is all that holds at two replicas."""
    records, summary = run(tiny_corpus, tmp_path / "two", *ATTACK, "mesh.replicas=2", "dp.robust=none",
                           "train.batch_size=8")
    assert of_kind(records, "dp_outlier") == [] and of_kind(records, "ban") == []
    assert "dp_outliers" not in summary


# --- the budget ----------------------------------------------------------------------------------

def test_one_eviction_per_stage_of_four_replicas_then_an_alert(tiny_corpus, tmp_path):
    trust = trust_layer(tiny_corpus, tmp_path, *MESH, "verify.trusted_ends=always")
    evicted, [ban] = trust.evict(WorkerId(1, 1), 5, 3, WorkerId(0, 1))
    assert evicted and ban["kind"] == "ban" and ban["step"] == 6
    evicted, [alert] = trust.evict(WorkerId(2, 1), 6, 3, WorkerId(0, 1))
    assert not evicted and (alert["kind"], alert["cause"], alert["worker"]) == ("alert", "budget", "r2s1")
    assert "a strict minority" in alert["detail"] and "reduced robustly" in alert["detail"]
    for first_or_last in (WorkerId(3, 0), WorkerId(3, 2)):  # assumed honest: never banned
        evicted, [alert] = trust.evict(first_or_last, 6, 3, WorkerId(0, first_or_last.stage))
        assert not evicted and alert["cause"] == "honest_stage"
    assert len(trust.banned) == 1


def test_first_and_last_stages_verified_from_three_replicas_are_evicted_like_any(tiny_corpus, tmp_path):
    trust = trust_layer(tiny_corpus, tmp_path, *MESH)  # verify.trusted_ends = auto, 4 replicas
    for end in (WorkerId(3, 0), WorkerId(3, 2)):
        evicted, [ban] = trust.evict(end, 6, 3, WorkerId(0, end.stage))
        assert evicted and ban["worker"] == str(end)


@pytest.mark.parametrize(("replicas", "budget"), [(2, 0), (3, 1), (5, 2)])
def test_the_budget_is_a_strict_minority_of_the_stage(tiny_corpus, tmp_path, replicas, budget):
    """At 2 replicas the budget is 0: even a report would not evict (no honest majority)."""
    trust = trust_layer(tiny_corpus, tmp_path, "mesh.stages=3", f"mesh.replicas={replicas}",
                        "model.n_layer=3", f"train.batch_size={4 * replicas}", *ATTACK)
    outcomes = [trust.evict(WorkerId(r, 1), 5, 3, WorkerId(0, 1))[0] for r in range(1, replicas)]
    assert outcomes == [True] * budget + [False] * (replicas - 1 - budget)


def test_sentinel_bans_and_dp_evictions_share_one_budget(tiny_corpus, tmp_path):
    trust = trust_layer(tiny_corpus, tmp_path, *MESH, "verify.name=sentinel")
    ban, _ = trust.sentinel.ledger.decide(WorkerId(2, 1), 5, 3, "l2n", "s1|s2", "act")
    assert ban is not None
    evicted, [alert] = trust.evict(WorkerId(1, 1), 6, 3, WorkerId(0, 1))
    assert not evicted and alert["cause"] == "budget"
    trust = trust_layer(tiny_corpus, tmp_path / "other", *MESH, "verify.name=sentinel")
    assert trust.evict(WorkerId(1, 1), 5, 3, WorkerId(0, 1))[0]
    ban, alert = trust.sentinel.ledger.decide(WorkerId(2, 1), 6, 3, "l2n", "s1|s2", "act")
    assert ban is None and alert.cause == "budget"


# --- records -------------------------------------------------------------------------------------

def test_a_non_finite_score_is_written_as_null_and_shown():
    """∞ (a NaN contribution) has no JSON spelling: ``Infinity`` would break every strict reader."""
    ledger = OutlierLedger(threshold=3.0)
    records = [r for step in range(3) for r in ledger.observe(step, {"r1s1": [float("inf")], "r0s1": [1.0]})]
    assert [r["score"] for r in records] == [None]
    json.dumps(records, allow_nan=False)
    out = io.StringIO()
    ProgressLine(10, stream=out).update(records[0] | {"evicted": True})
    assert out.getvalue().endswith("score non-finite); evicted\n")
    # the train record's dp_score_max is null then: the report's scalars leave it out
    assert scalars({"kind": "train", "step": 3, "train_loss": 2.5, "dp_score_max": None}) == [
        ("train/train_loss", 2.5)]


def test_the_donor_is_the_replica_least_marked():
    ledger = OutlierLedger(threshold=3.0)
    ledger.observe(0, {"r0s1": [5.0], "r1s1": [9.0], "r2s1": [1.0], "r3s1": [1.0]})
    assert ledger.donor("r1s1", ["r0s1", "r1s1", "r2s1", "r3s1"]) == "r2s1"
