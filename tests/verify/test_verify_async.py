"""SENTINEL under mesh.schedule = async: steps overlap, decisions must not depend on the interleaving,
and bans are carried out at drain points."""

from __future__ import annotations

import json

import pytest
import torch
from test_verify_sentinel import CODEC, SHAPE, Stream, message, sentinel
from tiny import tiny_config

from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.wire import wire_values

MESH3 = MeshShape(replicas=3, stages=3)
LAG = 2


def traffic(steps: int) -> dict[int, list]:
    """Stage-1 activations of 3 replicas: honest, r1 sends zeros at steps 30-31, every sender's
    traffic doubles from step 40 on (a regime change: rebase, then re-warm)."""
    stream = Stream(0)
    out = {}
    for step in range(steps):
        out[step] = []
        for mb in range(4):
            for r in range(3):
                x = stream() * (2.0 if step >= 40 else 1.0)
                if r == 1 and step in (30, 31):
                    x = torch.zeros(SHAPE)
                out[step].append(message("act", step, mb, WorkerId(r, 1), x))
    return out


def decisions_of(outcomes) -> list[list[str]]:
    return [sorted(json.dumps(d.record(), sort_keys=True) for d in o.decisions) for o in outcomes]


def test_decisions_do_not_depend_on_when_later_steps_arrive():
    """In order (each step inspected, then closed) or overlapped (step t + LAG inspected before
    step t closes, the deepest overlap the driver allows): the same decisions, rebases, re-warm-ups."""
    steps = 60
    messages = traffic(steps)
    in_order, overlapped = (sentinel(MESH3, warmup_steps=20, ban=False) for _ in range(2))
    for s in (in_order, overlapped):
        s.set_lag(LAG)
    a = []
    for t in range(steps):
        for m in messages[t]:
            in_order.inspect(m)
        a.append(in_order.end_step(t))
    b = []
    for t in range(LAG):
        for m in messages[t]:
            overlapped.inspect(m)
    for t in range(steps):
        for m in messages.get(t + LAG, []):
            overlapped.inspect(m)
        b.append(overlapped.end_step(t))  # closes step t only: steps t+1 … t+LAG stay pending
    assert decisions_of(a) == decisions_of(b)
    assert [(o.rebased, o.rewarmed) for o in a] == [(o.rebased, o.rewarmed) for o in b]
    assert any(o.rebased for o in a) and any(o.rewarmed for o in a)
    flagged = {d.step for o in a for d in o.decisions if d.flagged}
    assert {30, 31} <= flagged
    # The fences open LAG steps after warm-up (the view must be calibrated): no flags before.
    assert min(d.step for o in a for d in o.decisions if d.action != "warmup") == 20 + LAG
    # The regime change: the lock bound grows by the lag (reactions reach the view LAG steps later).
    locked = [t for t, o in enumerate(a) if o.rebased]
    assert locked and max(locked) - 40 <= (1 + LAG) * 3


def test_end_step_closes_only_its_own_step():
    s = sentinel(MESH3, warmup_steps=3)
    s.set_lag(LAG)
    stream = Stream(1)
    for t in range(6):
        for m in traffic(1)[0]:
            s.inspect(message("act", t, m.microbatch, m.src, stream()))
        s.end_step(t)
    attacker = WorkerId(1, 1)
    # Step 7's first activation (flagged: its microbatch is dropped) arrives before step 6 closes.
    s.inspect(message("act", 6, 0, WorkerId(0, 1), stream()))
    early = s.inspect(message("act", 7, 0, attacker, torch.zeros(SHAPE)))
    assert early.skip
    outcome = s.end_step(6)
    assert [(d.step, d.action) for d in outcome.decisions] == [(6, "accept")]
    # Step 7 is still open: the dropped microbatch's gradient is neutralized, not scored.
    grad = s.inspect(message("grad", 7, 0, WorkerId(1, 2), Stream(2)()))
    assert grad.skip and torch.count_nonzero(wire_values(grad.payload, "grad", CODEC, "auto")) == 0
    closed = s.end_step(7)
    assert [(d.step, d.action, d.reason) for d in closed.decisions] == [(7, "flag", "norm"),
                                                                        (7, "skip", "dropped")]


def test_a_message_too_early_for_its_view_is_refused():
    s = sentinel(MESH3)
    s.set_lag(1)
    s.inspect(message("act", 1, 0, WorkerId(0, 1), Stream(0)()))  # view: before step 0, fine
    with pytest.raises(RuntimeError, match="arrived before step 2 was closed"):
        s.inspect(message("act", 3, 0, WorkerId(0, 1), Stream(0)()))


# --- on a real (tiny) async mesh -------------------------------------------------------------

ATTACKER = WorkerId(1, 1)
START = 12
VERIFY = ["mesh.stages=4", "mesh.replicas=4", "train.batch_size=16", "verify.name=sentinel",
          "verify.warmup_steps=10", "verify.window=32", "mesh.schedule=async", "optim.name=nadamw"]
ATTACK = ["attack.kind=zeros", f"attack.workers={ATTACKER}", f"attack.start_step={START}"]


def records(run_dir, kind=None) -> list[dict]:
    out = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if kind is None or r["kind"] == kind]


def test_an_async_attacker_is_banned_at_a_drain_point_after_the_fed_work(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, *VERIFY, *ATTACK, "train.steps=24")
    trainer = Trainer(cfg, tmp_path, progress=False)
    assert trainer.plugins["trust"].trust.sentinel.lag == trainer.driver.lookahead > 0
    summary = trainer.train()
    [pending], [ban] = records(tmp_path, "ban_pending"), records(tmp_path, "ban")
    assert pending["worker"] == ban["worker"] == str(ATTACKER) and not ban["honest"]
    # Decided at the end of a step while later steps were fed; carried out only after those.
    assert pending["fed_step"] > pending["step"]
    assert ban["replaced_after_step"] == pending["drain_after_step"] == pending["fed_step"]
    assert summary["trust"]["workers"]["fp"] == 0 and summary["trust"]["workers"]["f1"] == 1.0
    assert summary["steps"] == 24 and summary["final_val_loss"] is not None
    # Between the decision and the replacement every message of the attacker is quarantined.
    decisions = [json.loads(x) for x in (tmp_path / "verify.jsonl").read_text().splitlines()]
    after = [d for d in decisions if d["src"] == str(ATTACKER) and pending["step"] < d["step"]
             <= ban["replaced_after_step"] and d["action"] not in ("skip",)]
    assert after and all(d["action"] in ("banned", "flag") for d in after)
    assert any(d["action"] == "banned" for d in after)
    # After it, the slot is honest (the replacement), and nobody honest was struck out.
    assert trainer.workers[ATTACKER].tamper is None
    late = [d for d in decisions if d["src"] == str(ATTACKER) and d["step"] > ban["replaced_after_step"]]
    assert late and not any(d["action"] == "banned" for d in late)


def test_async_verified_attacked_run_resumes_exactly(tiny_corpus, tmp_path):
    overrides = [*VERIFY, *ATTACK, "train.steps=22", "train.checkpoint_every=18",
                 "verify.charge_time=false"]
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "a", progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides, "train.stop_at_step=18"), tmp_path / "b",
            progress=False).train()
    Trainer(tiny_config(tiny_corpus, *overrides), tmp_path / "b", resume=True, progress=False).train()
    a, b = records(tmp_path / "a", "train"), records(tmp_path / "b", "train")
    assert [r["step"] for r in b] == list(range(1, 23))
    for ra, rb in zip(a, b, strict=True):
        assert (ra["train_loss"], ra["sim_time_s"], ra["verify_flags"]) == \
            (rb["train_loss"], rb["sim_time_s"], rb["verify_flags"])
    assert [r["val_loss"] for r in records(tmp_path / "a", "eval")] == \
        [r["val_loss"] for r in records(tmp_path / "b", "eval")]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert sa["banned_workers"] == sb["banned_workers"] and len(sa["banned_workers"]) == 1
    assert sa["trust"]["messages"] == sb["trust"]["messages"]


def test_a_clean_async_run_decides_the_same_whatever_the_timing(tiny_corpus, tmp_path):
    """Other link latencies and the verifiers' measured CPU time on the virtual clock change the
    order in which messages of overlapping steps arrive; not one decision or loss changes."""
    base = [*VERIFY, "train.steps=16", "verify.decision_log=all"]
    runs = {"a": ["link.latency_ms=10", "verify.charge_time=false"],
            "b": ["link.latency_ms=1", "link.bandwidth_mbit=1000", "verify.charge_time=true"]}
    ahead = {}  # per run: at each step's end, how many later steps' messages were already inspected
    for name, extra in runs.items():
        trainer = Trainer(tiny_config(tiny_corpus, *base, *extra), tmp_path / name, progress=False)
        sentinel_ = trainer.plugins["trust"].trust.sentinel
        close = sentinel_.end_step
        ahead[name] = []

        def end_step(step, close=close, seen=ahead[name], s=sentinel_):
            seen.append(sum(d.step > step for d in s.decisions))
            return close(step)

        sentinel_.end_step = end_step
        trainer.train()
    assert sum(ahead["a"]) > 0 and ahead["a"] != ahead["b"]  # steps overlap, differently
    a, b = (sorted((tmp_path / n / "verify.jsonl").read_text().splitlines()) for n in runs)
    assert a == b and any('"accept"' in line for line in a)
    la, lb = ([r["train_loss"] for r in records(tmp_path / n, "train")] for n in runs)
    assert la == lb
