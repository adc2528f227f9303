"""SENTINEL in real processes: a verifier process relays the pipeline, and decides as the simulator does.

The simulator with verification is the oracle: the same config over real processes (gloo on
loopback, the verifier an extra rank) must make the same decision on every message (action and
reason, distances to float tolerance), flag the same workers, ban the same worker at the same step
with the same donor, and leave training where the simulator leaves it.
"""

from __future__ import annotations

import json

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from tiny import tiny_config

from meshlearn.compress.wire_checks import Rejection
from meshlearn.distributed.verifier import Slots, evaluates_after
from meshlearn.distributed.wire import message_bound
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.ledger import Alert, Ban, Decision
from meshlearn.verify.sentinel import StepOutcome
from meshlearn.verify.verdicts import RemoteSentinel, decision_from_record, verdict_record

# Three stages (a middle one to attack), a short warm-up so the fences are on for most steps.
MESH = ["model.n_layer=3", "mesh.stages=3", "verify.name=sentinel", "verify.warmup_steps=3",
        "verify.window=16", "verify.decision_log=all"]


def both(cfg, tmp_path, seconds: float = 60) -> tuple:
    """The simulator's run and the dist run of ``cfg``: their folders."""
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    try:
        with deadline(seconds, "the verified dist run"):
            assert launch(cfg, tmp_path / "dist") == 0, sorted((tmp_path / "dist" / "logs").iterdir())
    finally:
        kill_leftovers(tmp_path / "dist")
    return tmp_path / "sim", tmp_path / "dist"


def decisions(run_dir) -> list[dict]:
    lines = (run_dir / "verify.jsonl").read_text().splitlines()
    return sorted(map(json.loads, lines), key=lambda r: (r["step"], r["message"], r["src"], r["microbatch"]))


def assert_same_decisions(sim, dist) -> None:
    a, b = decisions(sim), decisions(dist)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert (x["step"], x["message"], x["src"], x["microbatch"], x["action"], x["reason"],
                x["explained_by"]) == (y["step"], y["message"], y["src"], y["microbatch"], y["action"],
                                       y["reason"], y["explained_by"])
        assert x["distances"] == pytest.approx(y["distances"], rel=1e-4, abs=1e-6)
    assert [r["verify_flags"] for r in records(sim)] == [r["verify_flags"] for r in records(dist)]
    ta, tb = (json.loads((d / "summary.json").read_text())["trust"] for d in (sim, dist))
    assert ta["flags_per_worker"] == tb["flags_per_worker"]
    assert ta["messages"] == tb["messages"] and ta["workers"] == tb["workers"]


def test_a_clean_verified_dist_run_decides_as_the_simulator_and_trains_as_without_verification(
        tiny_corpus, tmp_path):
    # Wide fences (k = 8): scored from step 4 on, yet nothing of this clean run is flagged (at the
    # default k = 3 the fast first steps of the tiny model flag a few honest messages).
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.replicas=2", "train.steps=5", "train.eval_every=5",
                      "verify.fence_k=8", "verify.fence_k_max=16")
    sim, dist = both(cfg, tmp_path)
    assert_same_decisions(sim, dist)
    summary = json.loads((dist / "summary.json").read_text())
    assert summary["banned_workers"] == [] and summary["trust"]["verifier_cost"]["messages"] == 5 * 16
    assert "verifier: done, 80 messages" in (dist / "logs" / "verifier.log").read_text()
    # Nothing flagged, so the verifier delivered every message as sent: the losses are those of
    # the same dist run without verification (train and validation).
    plain = tmp_path / "plain"
    try:
        with deadline(60, "the unverified dist run"):
            assert launch(cfg, plain, "verify.name=none") == 0
    finally:
        kill_leftovers(plain)
    actions = [d["action"] for d in decisions(dist)]
    assert actions.count("accept") == 2 * 16 and actions.count("warmup") == 3 * 16  # no flag
    assert [r["train_loss"] for r in records(dist)] == [r["train_loss"] for r in records(plain)]
    assert records(dist, "eval")[0]["val_loss"] == records(plain, "eval")[0]["val_loss"]
    assert [r["bytes_pp"] for r in records(dist)] == [r["bytes_pp"] for r in records(plain)]


def test_an_attacker_is_banned_in_dist_as_in_the_simulator_and_replaced_from_its_donor(tiny_corpus, tmp_path):
    """Three replicas (the ban budget is one of three): zeros from the middle stage's r1s1."""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.replicas=3", "train.batch_size=12", "train.steps=8",
                      "train.eval_every=4", "attack.kind=zeros", "attack.workers=r1s1",
                      "attack.start_step=5")
    sim, dist = both(cfg, tmp_path, seconds=90)
    assert_same_decisions(sim, dist)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (sim, dist))
    assert a["banned_workers"] == b["banned_workers"]
    assert [(x["worker"], x["step"], x["replaced_from"], x["honest"]) for x in b["banned_workers"]] == [
        ("r1s1", 7, "r0s1", False)]
    assert b["trust"]["workers"]["fp"] == 0 and b["trust"]["attackers"] == a["trust"]["attackers"]
    # The replacement trained on from r0s1's state: the runs agree to the end (validation too).
    for ra, rb in zip(records(sim), records(dist), strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], abs=1e-5)
    assert [r["val_loss"] for r in records(sim, "eval")] == pytest.approx(
        [r["val_loss"] for r in records(dist, "eval")], abs=1e-5)
    assert [r["worker"] for r in records(dist, "ban")] == ["r1s1"]


def test_a_forged_message_is_refused_by_the_verifier_with_a_record_not_a_crash(tiny_corpus, tmp_path):
    """Token ids out of range on the subspace codec's wire: unchecked, decoding them raises."""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.replicas=2", "train.steps=5", "model.subspace_rank=8",
                      "codec.name=subspace", "attack.kind=forge_ids", "attack.workers=r1s1",
                      "attack.start_step=2")
    sim, dist = both(cfg, tmp_path)
    fields = ("step", "microbatch", "message", "src", "dst", "reason")
    refused = [tuple(r[f] for f in fields) for r in records(dist, "wire_reject")]
    assert refused == [tuple(r[f] for f in fields) for r in records(sim, "wire_reject")]
    assert len(refused) == (5 - 2) * 2  # r1s1's activations from step 3 (1-based) on
    refused = records(dist, "wire_reject")
    assert {(r["src"], r["dst"], r["reason"].split(":")[0]) for r in refused} == {("r1s1", "r1s2", "index")}
    summary = json.loads((dist / "summary.json").read_text())
    assert summary["wire_rejections"] == 6 == summary["trust"]["attackers"][0]["changed_messages"]
    assert_same_decisions(sim, dist)


def test_a_message_lying_about_its_sender_is_quarantined_by_the_verifier_and_the_run_goes_on(
        tiny_corpus, tmp_path):
    """The header names another sender: the verifier's transport refuses it unread (before, the run
    ended there) and the relay puts a stand-in in its slot, with the microbatch the link's order
    gives (GPipe: gradients in descending order); the simulator's guard refuses the same messages."""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.replicas=2", "train.steps=5", "mesh.schedule=gpipe",
                      "attack.kind=forge_src", "attack.workers=r1s1", "attack.start_step=2")
    sim, dist = both(cfg, tmp_path)
    fields = ("step", "microbatch", "message", "src", "dst")
    refused = sorted(tuple(r[f] for f in fields) for r in records(dist, "wire_reject"))
    assert refused == sorted(tuple(r[f] for f in fields) for r in records(sim, "wire_reject"))
    assert len(refused) == (5 - 2) * 2 * 2  # r1s1's activations and gradients from step 3 (1-based) on
    claim = "route: claims to come from r2s1, sent by r1s1"
    assert {r["reason"] for r in records(sim, "wire_reject")} == {claim}
    # dist: the transport's refusal of the header (the relay records what was wrong with it)
    lies = {f"message from r1s1 claims to be a {kind!r} from r2s1" for kind in ("act", "grad")}
    assert {r["reason"] for r in records(dist, "wire_reject")} == lies
    assert_same_decisions(sim, dist)


def test_a_buffer_beyond_any_honest_message_is_refused_by_the_verifier_and_the_run_goes_on(
        tiny_corpus, tmp_path):
    """r1s1 pads every message with 40 × its size, beyond what any honest message of the run takes
    (``wire.message_bound``). The verifier's links are tcp (``dist.links = auto`` with SENTINEL):
    it reads the frame's prefix, refuses it before allocating, skips its bytes, and the relay puts a
    stand-in in its slot — the same slots the simulator's guard refuses as oversized. (Over gloo
    such a buffer met a receive it did not fit; a raw one aborts the receiving process.)"""
    cfg = tiny_config(tiny_corpus, *MESH, "mesh.replicas=2", "train.steps=5", "attack.kind=forge_oversize",
                      "attack.workers=r1s1", "attack.start_step=2", "attack.oversize_factor=40")
    honest = cfg.train.batch_size // 2 // cfg.mesh.microbatches * cfg.model.seq_len * cfg.model.d_model * 4
    assert 40 * honest > message_bound(cfg, 0)
    sim, dist = both(cfg, tmp_path)
    fields = ("step", "microbatch", "message", "src", "dst")
    refused = sorted(tuple(r[f] for f in fields) for r in records(dist, "wire_reject"))
    assert refused == sorted(tuple(r[f] for f in fields) for r in records(sim, "wire_reject"))
    assert len(refused) == (5 - 2) * 2 * 2  # r1s1's activations and gradients from step 3 (1-based) on
    assert {r["reason"].split(":")[0] for r in records(sim, "wire_reject")} == {"oversized"}
    reasons = {r["reason"] for r in records(dist, "wire_reject")}
    bound = f"at most {message_bound(cfg, 0)}"
    assert all(r.startswith("a frame of ") and bound in r for r in reasons), reasons
    summary = json.loads((dist / "summary.json").read_text())
    assert summary["wire_rejections"] == 12 == summary["trust"]["attackers"][0]["changed_messages"]
    assert_same_decisions(sim, dist)


# --- the pure parts -----------------------------------------------------------------------------


def test_slots_come_from_the_arrival_count_and_evaluation_follows_its_steps(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "train.steps=5", "train.eval_every=2")
    assert [t for t in range(5) if evaluates_after(cfg, t)] == [1, 3, 4]
    forward, backward = (WorkerId(0, 0), WorkerId(0, 1)), (WorkerId(0, 1), WorkerId(0, 0))
    other = (WorkerId(1, 0), WorkerId(1, 1))
    slots = Slots([forward, backward, other], microbatches=2)
    assert [slots.next(forward) for _ in range(3)] == [0, 0, 1]
    slots.next(forward)
    slots.expect_evaluation(2)  # replica 0's forward links only
    assert [slots.next(forward) for _ in range(3)] == [None, None, 2]
    assert [slots.next(backward) for _ in range(3)] == [0, 0, 1]
    assert [slots.next(other) for _ in range(2)] == [0, 0]


def test_a_published_verdict_is_the_outcome_the_verifier_decided():
    d = Decision(4, 1, "grad", WorkerId(1, 2), WorkerId(1, 1), "flag", "l2n,coh",
                 {"l2n": 1.5, "coh": 0.25}, {"l2n": 1.0, "coh": float("inf")}, "r1s3 act")
    assert decision_from_record(d.record()) == d
    ban = Ban(WorkerId(1, 2), 4, "l2n", "s1|s2", "grad", 3)
    alert = Alert(WorkerId(0, 1), 4, "budget", 3, "no honest majority")
    rejection = Rejection(4, "act", 0, WorkerId(1, 1), WorkerId(1, 2), "index: ids in [-1, 9]")
    outcome = StepOutcome([d], [ban], ["s1|s2 grad"], [alert], ["s1|s2 grad: l2n"])
    record = json.loads(json.dumps(verdict_record(4, outcome, {WorkerId(1, 2): WorkerId(0, 2)}, [rejection],
                                                  {"cpu_s": 0.5})))
    remote = RemoteSentinel(lambda step: record if step == 4 else {})
    assert remote.end_step(4) == outcome
    assert remote.donor(WorkerId(1, 2)) == WorkerId(0, 2)
    assert remote.pop_rejections() == [rejection] and remote.pop_rejections() == []
    assert remote.clock.summary() == {"cpu_s": 0.5}


def test_the_verifier_relays_both_evaluation_passes_of_the_mask_codec(tiny_corpus, tmp_path):
    """Under the mask codec every evaluation is two pipeline passes (unmasked, then masked as in
    training): the relay carries both (it counts the batches it lets through unverified), and both
    losses are the simulator's."""
    cfg = tiny_config(tiny_corpus, *MESH, "codec.name=mask", "codec.keep=0.25", "train.steps=2",
                      "train.eval_every=2")
    sim, dist = both(cfg, tmp_path)
    (a,), (b,) = records(sim, "eval"), records(dist, "eval")
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5
    assert abs(a["val_loss_masked"] - b["val_loss_masked"]) <= 1e-5
