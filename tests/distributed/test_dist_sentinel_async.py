"""SENTINEL in real processes under ``mesh.schedule = async``: steps overlap, the simulator decides.

The same config in the simulator and over real processes (gloo on loopback, the verifier an extra
rank) must make the same decision on every message, ban the same worker at the same step, carry
the ban out at the same drain point from the same donor, and train to the same losses. One
difference is allowed, the one the simulator itself has between two timings (docs/sentinel.md,
"Under the asynchronous schedule"): a banned worker's messages of the steps between the decision
and its replacement are quarantined either way, as ``flag`` when inspected before the ban was
decided and as ``banned`` after.
"""

from __future__ import annotations

import json

import pytest
from dist_helpers import deadline, kill_leftovers, launch, records
from test_dist_sentinel import MESH, both, decisions
from tiny import tiny_config

from meshlearn.train import Trainer
from meshlearn.verify.verdicts import RemoteSentinel

ASYNC = [*MESH, "mesh.schedule=async"]


def assert_same_async_decisions(sim, dist) -> None:
    """Every decision equal (distances to 1e-4), but flag ≡ banned for a banned worker's messages
    after its ban's step and up to its replacement."""
    banned = {}  # worker → (decided at, replaced after), 1-based steps
    for ban in records(sim, "ban"):  # (flushing schedules: replaced at the ban's own step)
        banned[ban["worker"]] = (ban["step"], ban.get("replaced_after_step", ban["step"]))

    def action(d: dict) -> tuple:
        window = banned.get(d["src"])
        if window and window[0] < d["step"] <= window[1] and d["action"] in ("flag", "banned"):
            return ("quarantined",)
        return d["action"], d["reason"]

    a, b = decisions(sim), decisions(dist)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        key = ("step", "message", "src", "microbatch", "explained_by")
        assert ([x[k] for k in key], action(x)) == ([y[k] for k in key], action(y))
        if action(x) == action(y) and x["action"] == y["action"]:
            assert x["distances"] == pytest.approx(y["distances"], rel=1e-4, abs=1e-6)
    # "banned" counts as flagged: the per-step flag counts and the scorecard agree exactly.
    assert [r["verify_flags"] for r in records(sim)] == [r["verify_flags"] for r in records(dist)]
    ta, tb = (json.loads((d / "summary.json").read_text())["trust"] for d in (sim, dist))
    assert ta["flags_per_worker"] == tb["flags_per_worker"]
    assert ta["messages"] == tb["messages"] and ta["workers"] == tb["workers"]


def test_a_clean_async_verified_dist_run_decides_as_the_simulator_and_trains_as_without_verification(
        tiny_corpus, tmp_path):
    # Wide fences (k = 8), as in the flushing test: scored from step 4 on, nothing flagged.
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.replicas=2", "train.steps=6", "train.eval_every=3",
                      "verify.fence_k=8", "verify.fence_k_max=16")
    sim, dist = both(cfg, tmp_path)
    assert_same_async_decisions(sim, dist)
    actions = [d["action"] for d in decisions(dist)]
    assert actions.count("accept") == 3 * 16 and actions.count("warmup") == 3 * 16  # no flag
    plain = tmp_path / "plain"
    try:
        with deadline(60, "the unverified async dist run"):
            assert launch(cfg, plain, "verify.name=none") == 0
    finally:
        kill_leftovers(plain)
    # Every message delivered as sent: the losses of the same dist run without verification.
    assert [r["train_loss"] for r in records(dist)] == [r["train_loss"] for r in records(plain)]
    assert [r["val_loss"] for r in records(dist, "eval")] == [r["val_loss"] for r in records(plain, "eval")]
    for ra, rb in zip(records(sim), records(dist), strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], abs=1e-5)


def test_an_async_attacker_is_banned_in_dist_at_the_simulators_step_and_drain_point(tiny_corpus, tmp_path):
    """Zeros from r1s1 (3 replicas: a ban budget of one). The ban is decided at a step's end while
    later steps run, and carried out at the drain point it asks for (L = 3 steps later here), not
    at the next evaluation: every process has to agree on that drain before it feeds past it."""
    cfg = tiny_config(tiny_corpus, *ASYNC, "mesh.replicas=3", "train.batch_size=12", "train.steps=12",
                      "train.eval_every=6", "attack.kind=zeros", "attack.workers=r1s1",
                      "attack.start_step=5")
    sim, dist = both(cfg, tmp_path, seconds=90)
    assert_same_async_decisions(sim, dist)
    [pending], [ban] = records(dist, "ban_pending"), records(dist, "ban")
    assert (pending["step"], pending["fed_step"], pending["drain_after_step"]) == (7, 10, 10)
    assert (ban["worker"], ban["replaced_from"], ban["replaced_after_step"], ban["honest"]) == (
        "r1s1", "r0s1", 10, False)
    for kind in ("ban_pending", "ban", "rebase", "rewarm", "alert"):
        drop = ("wall_time_s", "sim_time_s", "bytes_pp", "bytes_dp", "tokens")
        assert [{k: v for k, v in r.items() if k not in drop} for r in records(sim, kind)] == \
            [{k: v for k, v in r.items() if k not in drop} for r in records(dist, kind)], kind
    a, b = (json.loads((d / "summary.json").read_text()) for d in (sim, dist))
    assert a["banned_workers"] == b["banned_workers"]
    assert b["trust"]["workers"]["fp"] == 0 and b["trust"]["attackers"] == a["trust"]["attackers"]
    for ra, rb in zip(records(sim), records(dist), strict=True):  # D = 3: the ring sums in its order
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], abs=1e-5)
    assert [r["val_loss"] for r in records(sim, "eval")] == pytest.approx(
        [r["val_loss"] for r in records(dist, "eval")], abs=1e-5)
    log = (dist / "logs" / "verifier.log").read_text()
    assert "drain point after step 10: r1s1 (banned at step 7) replaced, loading r0s1's state" in log


# --- the pure part ------------------------------------------------------------------------------


def test_a_ban_asks_for_the_simulators_drain_point_once_its_verdict_is_read():
    """A ban at step b (0-based) drains after b + lag unless a drain point came first."""
    verdicts = {t: {"bans": [{"worker": "r1s1"}] if t in (4, 20) else []} for t in range(30)}
    fetched = []
    remote = RemoteSentinel(lambda t: fetched.append(t) or verdicts[t], lag=3)
    remote.learn_through(5)
    assert fetched == [0, 1, 2, 3, 4, 5] and remote.ban_steps == [4]
    assert [d for d in range(1, 12) if remote.ban_drain_due(d)] == [8, 9, 10, 11]
    remote.drained(8)  # carried out there
    assert not any(remote.ban_drain_due(d) for d in range(30))
    remote.learn_through(20)
    remote.drained(22)  # a drain point between the ban (step 20) and 20 + lag came first
    assert not any(remote.ban_drain_due(d) for d in range(30))
    remote.learn_through(5)  # nothing fetched twice
    assert fetched == list(range(21))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["async", "1f1b"])
def test_an_attacked_verified_dist_run_resumes_exactly(tiny_corpus, tmp_path, schedule):
    """Stopped at a checkpoint after the ban was carried out, resumed: the verifier's state (its
    references, fences, ledger) comes back from rank 0's shard, and the run ends where the
    simulator's uninterrupted run ends (about 25 s each)."""
    overrides = [*MESH, f"mesh.schedule={schedule}", "mesh.replicas=3", "train.batch_size=12",
                 "train.steps=12", "train.eval_every=6", "train.checkpoint_every=9", "attack.kind=zeros",
                 "attack.workers=r1s1", "attack.start_step=5"]
    cfg = tiny_config(tiny_corpus, *overrides)
    Trainer(cfg, tmp_path / "sim", progress=False).train()
    dist = tmp_path / "dist"
    try:
        with deadline(150, "the stopped and the resumed dist runs"):
            assert launch(cfg, dist, "train.stop_at_step=9") == 0
            assert launch(cfg, dist, "train.stop_at_step=0", resume=True) == 0
    finally:
        kill_leftovers(dist)
    sim = tmp_path / "sim"
    assert [r["step"] for r in records(dist)] == list(range(1, 13))
    assert_same_async_decisions(sim, dist)
    [ban] = records(dist, "ban")
    # Under async the replacement waits for the drain point; a flushing step replaces at once
    # (no key).
    assert (ban["worker"], ban["step"], ban.get("replaced_after_step")) == (
        "r1s1", 7, 9 if schedule == "async" else None)
    for ra, rb in zip(records(sim), records(dist), strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], abs=1e-5)
    assert [r["val_loss"] for r in records(sim, "eval")] == pytest.approx(
        [r["val_loss"] for r in records(dist, "eval")], abs=1e-5)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (sim, dist))
    assert a["banned_workers"] == b["banned_workers"] and a["trust"]["messages"] == b["trust"]["messages"]
