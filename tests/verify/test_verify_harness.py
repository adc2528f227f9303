"""The grown attack harness on a tiny mesh: wire forgeries are refused without a crash, and the new
tensor attacks (permute, drift, warm-up start, intermittent, colluding) do what their settings say."""

from __future__ import annotations

import json
import math

import pytest
from tiny import tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer
from meshlearn.verify.forgeries import FORGERIES

ATTACKER = WorkerId(1, 1)
MESH = ["mesh.stages=4", "mesh.replicas=2"]
VERIFY = ["verify.name=sentinel", "verify.warmup_steps=10", "verify.window=32"]  # as test_verify_mesh
SUBSPACE = ["model.subspace_rank=8", "codec.name=subspace"]  # token ids on the wire
REASONS = {"forge_ids": "index: ids", "forge_shape": "shape: coeffs", "forge_dtype": "dtype: coeffs",
           "forge_nonfinite": "nonfinite: coeffs", "forge_oversize": "oversized:",
           "forge_stale": "stale step:", "forge_src": "route: claims to come from r2s1, sent by r1s1",
           "forge_kind": "route: a "}


def trainer(tiny_corpus, tmp_path, steps: int, *overrides: str) -> Trainer:
    return Trainer(tiny_config(tiny_corpus, *MESH, f"train.steps={steps}", *overrides), tmp_path,
                   progress=False)


@pytest.mark.parametrize("verify", ["none", "sentinel"])
@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forging_attacker_is_refused_with_a_record_and_the_run_completes(tiny_corpus, tmp_path,
                                                                           forgery, verify):
    t = trainer(tiny_corpus, tmp_path, 6, *SUBSPACE, *VERIFY, f"verify.name={verify}",
                f"attack.kind={forgery}", f"attack.workers={ATTACKER}", "attack.start_step=2",
                "attack.replay_delay=1")
    summary = t.train()  # forgeries leave the attacker as it sends; every receiver guards itself
    assert math.isfinite(summary["final_train_loss"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rejections = [r for r in map(json.loads, lines) if r["kind"] == "wire_reject"]
    [attacker] = summary["trust"]["attackers"]
    assert attacker["changed_messages"] == len(rejections) == summary["wire_rejections"] > 0
    assert {r["src"] for r in rejections} == {str(ATTACKER)}  # every forged message, and only those
    assert all(r["reason"].startswith(REASONS[forgery]) and r["step"] >= 3 for r in rejections)



def test_a_message_claiming_another_sender_still_crosses_the_senders_own_link(tiny_corpus, tmp_path):
    """The simulator routes a message by the worker that sent it, as a network does, never by its
    header: forge_src's messages (honest payloads) cost the bytes and time of an honest run's, on
    the pipeline axis (the claimed sender r2s1's link to r1s2 would be a DP link)."""
    runs = [trainer(tiny_corpus, tmp_path / kind, 4, f"attack.kind={kind}", f"attack.workers={ATTACKER}",
                    "attack.start_step=2").train() for kind in ("none", "forge_src")]
    assert runs[1]["wire_rejections"] > 0
    fields = ("bytes_per_token_pp", "bytes_per_token_dp", "sim_time_s")
    assert [r[f] for f in fields for r in runs[1:]] == [r[f] for f in fields for r in runs[:1]]

def test_without_receiver_checks_forged_ids_crash_the_receiver(tiny_corpus, tmp_path):
    """The harness has teeth: the same forgery on the wire with the receivers' guards taken away."""
    t = trainer(tiny_corpus, tmp_path, 4, *SUBSPACE, "attack.kind=forge_ids", f"attack.workers={ATTACKER}")
    for worker in t.workers.values():
        worker.guard = None
    with pytest.raises(IndexError):
        t.train()


def test_an_attack_can_start_during_the_verifiers_warm_up(tiny_corpus, tmp_path):
    t = trainer(tiny_corpus, tmp_path, 12, *VERIFY, "attack.kind=bias", f"attack.workers={ATTACKER}",
                "attack.start_step=3", "verify.decision_log=all")
    for _ in range(10):  # the warm-up: the attack runs, the verifier only learns
        t.step()
    attack = t.plugins["trust"].trust.attacks[ATTACKER]
    summary = t.train()
    decisions = [line for line in (tmp_path / "verify.jsonl").read_text().splitlines()
                 if f'"src": "{ATTACKER}"' in line and '"action": "warmup"' in line]
    assert len(decisions) == 10 * 2 * 2  # all its warm-up messages (2 microbatches × act + grad) pass
    assert summary["trust"]["attackers"][0]["changed_messages"] >= (10 - 3) * 2 * 2  # attacked from step 3
    assert summary["trust"]["attackers"][0]["start_step"] == 3 + 1  # reports count steps from 1
    assert attack.stopped_at is None or attack.stopped_at >= 10  # nobody is banned during warm-up


def test_an_intermittent_attack_sends_honestly_in_its_off_steps(tiny_corpus, tmp_path):
    summary = trainer(tiny_corpus, tmp_path, 10, "attack.kind=random", f"attack.workers={ATTACKER}",
                      "attack.start_step=2", "attack.period=4", "attack.duty=1").train()
    # On at steps 2 and 6: 2 microbatches × (activation + gradient) each.
    assert summary["trust"]["attackers"][0]["changed_messages"] == 2 * 2 * 2


def test_colluding_attackers_in_different_stages_are_both_banned(tiny_corpus, tmp_path):
    colluders = [WorkerId(1, 1), WorkerId(0, 2)]
    t = trainer(tiny_corpus, tmp_path, 16, *VERIFY, "attack.kind=zeros", "attack.start_step=12",
                f"attack.workers={','.join(map(str, colluders))}")
    assert t.plugins["trust"].trust.attacks[colluders[0]].generator.initial_seed() != \
        t.plugins["trust"].trust.attacks[colluders[1]].generator.initial_seed()
    summary = t.train()
    # 2 replicas per stage: no honest majority, so the ban budget is 0 — both are caught and
    # quarantined with an alert naming them, and nobody (honest or not) is banned.
    assert summary["banned_workers"] == []
    assert {a["worker"] for a in summary["trust"]["alerts"]} == set(map(str, colluders))
    assert summary["trust"]["workers"]["fp"] == 0


@pytest.mark.parametrize("attack", [
    ["attack.kind=permute", "attack.target=gradients"],
    ["attack.kind=bias", "attack.bias=3", "attack.ramp_steps=6"],
    ["attack.kind=invisible_noise", "attack.noise_rho=2", "attack.ramp_steps=6"],
])
def test_the_new_attacks_change_training(tiny_corpus, tmp_path, attack):
    clean = trainer(tiny_corpus, tmp_path / "clean", 8).train()
    hit = trainer(tiny_corpus, tmp_path / "hit", 8, f"attack.workers={ATTACKER}", "attack.start_step=2",
                  *attack).train()
    assert hit["trust"]["attackers"][0]["changed_messages"] > 0
    assert abs(hit["final_train_loss"] - clean["final_train_loss"]) > 1e-4
