"""SENTINEL under elastic membership, with real processes on loopback: a ban is an eviction.

P = 3 (the attacker sits in the middle stage: the first and last are honest in SENTINEL's threat
model) × D = 3 (the ban budget is a strict minority of a stage's replicas: one of three), plus the
verifier process that relays every pipeline message. ``zeros`` from r1s1 is banned by the verifier;
r1s1 leaves its stage's quorum before the next step, its row with it, and rows 0 and 2 train on.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))

from dist_helpers import deadline, kill_leftovers, launch, records  # noqa: E402
from tiny import tiny_config  # noqa: E402

from meshlearn.elastic.membership import GENERATION_ENV, LIGHTHOUSES_ENV, RUN_FILE  # noqa: E402
from meshlearn.entry.launch import WORKERS_FILE  # noqa: E402
from meshlearn.entry.worker import main  # noqa: E402

VERIFIED = ["backend=dist", "model.n_layer=3", "mesh.stages=3", "mesh.replicas=3", "train.batch_size=12",
            "train.steps=8", "train.eval_every=4", "elastic.enabled=true", "dist.timeout_s=5",
            "dist.dead_after_s=2", "verify.name=sentinel", "verify.warmup_steps=3", "verify.window=16"]
ATTACK = ["attack.kind=zeros", "attack.workers=r1s1", "attack.start_step=4"]


def _members(run: Path) -> dict:
    path = run / WORKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _banned(run: Path) -> dict | None:
    return next((e for e in _members(run).get("r1s1", {}).get("events", []) if e["event"] == "banned"), None)


def _start_again(run: Path, monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """``meshlearn worker ARGV`` in this process under r1s1's first identity (rank 4, generation 0,
    the launcher's environment for it): its exit code and what it wrote to stderr."""
    host, port = json.loads((run / RUN_FILE).read_text())["store"].rsplit(":", 1)
    for key, value in {"RANK": "4", "WORLD_SIZE": "10", "MASTER_ADDR": host, "MASTER_PORT": port,
                       GENERATION_ENV: "0", LIGHTHOUSES_ENV: "unused"}.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_an_attacker_is_banned_evicted_and_cannot_rejoin_while_the_others_train_on(tiny_corpus, tmp_path,
                                                                                   monkeypatch, capsys):
    # Steps after the ban (about step 7): the restarts below need the run's store, which goes when
    # the run ends; with 8 steps one step and an evaluation were all the room they had, and with 12
    # a quiet full suite once saw the run end first (the restart then waited its whole
    # dist.init_timeout_s for the store: hence also the restart's short timeout).
    steps = 16
    cfg = tiny_config(tiny_corpus, *VERIFIED, *ATTACK, f"train.steps={steps}")
    run = tmp_path / "run"
    result: dict = {}
    try:
        with deadline(150, "the verified elastic run with an attacker"):
            thread = threading.Thread(target=lambda: result.setdefault("code", launch(cfg, run)))
            thread.start()
            end = time.monotonic() + 120
            while _banned(run) is None and thread.is_alive():
                assert time.monotonic() < end, "no ban in workers.json"
                time.sleep(0.05)
            # While the run goes on (its store answers): the banned identity (r1s1, generation 0)
            # starts again, and a joiner.
            again, refused = _start_again(run, monkeypatch, capsys, "--config", str(run / "config.toml"),
                                          "--out", str(run), "--set", "dist.init_timeout_s=30")
            join, joined = _start_again(run, monkeypatch, capsys, "--join",
                                        json.loads((run / RUN_FILE).read_text())["store"], "--out", str(run))
            thread.join()
    finally:
        kill_leftovers(run)
    assert result["code"] == 0
    refused = refused.strip().splitlines()
    assert again == 2 and len(refused) == 1, refused
    assert refused[0].startswith("meshlearn worker: error: MESHLEARN_GENERATION = 0: the identity r1s1.0 "
                                 "(slot r1s1, generation 0) was banned by SENTINEL at step "), refused
    assert "it cannot rejoin" in refused[0]
    assert join == 2 and joined.strip().splitlines() == [joined.strip()], joined
    assert joined.startswith("meshlearn worker: error: --join = ") and "takes no joiners yet" in joined
    summary = json.loads((run / "summary.json").read_text())
    bans = summary["banned_workers"]
    assert [(b["worker"], b["honest"], b["evicted"], b["replaced_from"]) for b in bans] == [
        ("r1s1", False, True, None)]
    ban_step = bans[0]["step"]  # 1-based; the attack starts at step 5 (attack.start_step = 4)
    assert 5 <= ban_step < 8  # a few strikes after the attack's start
    assert summary["trust"]["workers"]["fp"] == 0  # no honest worker banned
    rows = records(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rows"] == [0, 1, 2] for r in rows[:ban_step])
    assert all(r["rows"] == [0, 2] and r["participants"] == 2 for r in rows[ban_step:])  # evicted next step
    assert all(r["committed"] and math.isfinite(r["train_loss"]) for r in rows)
    assert [r["batch"] for r in rows] == list(range(steps))
    assert all(math.isfinite(r["val_loss"]) for r in records(run, "eval"))
    members = _members(run)
    events = members["r1s1"]["events"]
    assert events[1] == {"event": "banned", "step": ban_step, "generation": 0, "why": events[1]["why"]}
    assert events[1]["why"].startswith(f"banned by SENTINEL at step {ban_step} (s1|s2 act ")
    assert events[2]["event"] == "left" and events[2]["why"] == "evicted: banned by SENTINEL"
    assert events[2]["step"] == ban_step
    for partner in ("r1s0", "r1s2"):
        assert members[partner]["events"][-1] == {"event": "left", "step": ban_step,
                                                  "why": "left: its pipeline row broke"}
    for name in ("r0s0", "r0s1", "r0s2", "r2s0", "r2s1", "r2s2"):
        assert members[name]["events"][-1] == {"event": "finished", "step": steps, "why": "finished"}
    assert members["verifier"]["events"][-1] == {"event": "finished", "why": "finished"}


def test_a_clean_verified_elastic_run_evicts_nobody(tiny_corpus, tmp_path):
    """The negative control: the same mesh without the attacker (wide fences: the tiny model's
    fast first steps flag a few honest messages at the default k = 3). Wider and longer
    sequences than the tiny model's: a validation batch (12 × 64 × 64) no longer fits the
    verifier's training-sized receive buffers with their header room, so evaluation must take the
    oversize path through the relay."""
    cfg = tiny_config(tiny_corpus, *VERIFIED, "verify.fence_k=8", "verify.fence_k_max=16",
                      "model.d_model=64", "model.seq_len=64")
    run = tmp_path / "run"
    try:
        with deadline(120, "the clean verified elastic run"):
            assert launch(cfg, run) == 0
    finally:
        kill_leftovers(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["banned_workers"] == [] and summary["trust"]["bans"] == 0
    assert summary["trust"]["verifier_cost"]["messages"] == 8 * 24  # every message relayed
    rows = records(run)
    assert all(r["rows"] == [0, 1, 2] and r["committed"] for r in rows)
    assert [r["step"] for r in records(run, "eval")] == [4, 8]
    assert all(math.isfinite(r["val_loss"]) for r in records(run, "eval"))
    members = _members(run)
    assert all(m["events"][-1]["event"] == "finished" for m in members.values())
    assert not any(e["event"] == "banned" for m in members.values() for e in m["events"])
