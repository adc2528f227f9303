"""Attacks: what each sends, when it is active, and that it is reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshlearn.compress.codecs import Encoded, IdentityCodec
from meshlearn.config import load_config
from meshlearn.errors import ConfigError
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import WorkerId
from meshlearn.verify.attacks import ATTACKS, FORGERIES, AttackConfig, build_attack

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the shipped configs, from any cwd
DEMO = str(CONFIGS / "demo.toml")

X = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)) + 0.3


def attack(kind: str, **overrides) -> object:
    return build_attack(kind, AttackConfig(**({"kind": kind} | overrides)), seed=1)


@pytest.mark.parametrize("kind", sorted(set(ATTACKS) - {"adaptive", *FORGERIES}))
def test_every_attack_changes_the_message_only_when_active(kind):
    a = attack(kind, start_step=3, target="activations", replay_delay=2)
    assert a(kind="act", step=2, microbatch=0, x=X) is X  # before start
    later = X + 1.0  # what the worker would honestly send at step 3
    out = a("act", 3, 0, later)
    assert out.shape == X.shape and not torch.equal(out, later)
    assert a("grad", 3, 0, X) is X  # not its target
    assert a.pop_changed() == {("act", 3, 0)} and a.pop_changed() == set()
    a.stop(4)
    assert a("act", 4, 0, X) is X


@pytest.mark.parametrize("kind", ["random", "sign_flip", "bias", "invisible_noise", "permute", "mixed"])
def test_attacks_are_reproducible_from_their_seed(kind):
    a, b = attack(kind), attack(kind)
    for step in range(6):
        assert torch.equal(a("act", step, 0, X), b("act", step, 0, X))


def test_simple_attacks_do_what_their_names_say():
    assert not attack("zeros")("act", 0, 0, X).any()
    assert torch.equal(attack("scaling", scale=-1.0)("grad", 0, 0, X), -X)
    flipped = attack("sign_flip", sign_fraction=0.5)("act", 0, 0, X)
    assert torch.equal(flipped.abs(), X.abs())  # every norm is preserved
    assert (flipped.sign() != X.sign()).float().mean().item() == pytest.approx(0.5)
    noisy = attack("invisible_noise", noise_rho=0.1)("act", 0, 0, X)
    assert (noisy - X).std().item() == pytest.approx(0.1 * X.std().item(), rel=0.15)
    shifted = attack("bias", bias=2.0)("act", 0, 0, X) - X
    assert torch.allclose(shifted, shifted[0, 0].expand_as(shifted))  # one vector per channel


def test_replay_sends_what_it_sent_delay_steps_ago():
    a = attack("replay", start_step=5, replay_delay=3)
    sent = {}
    for step in range(10):
        honest = torch.full((2, 4, 4), float(step))
        sent[step] = a("act", step, 1, honest)
    assert [sent[t][0, 0, 0].item() for t in range(10)] == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]


def test_replay_state_round_trip():
    a = attack("replay", replay_delay=2)
    for step in range(4):
        a("act", step, 0, torch.full((1, 2, 2), float(step)))
    b = attack("replay", replay_delay=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a("act", 4, 0, X), b("act", 4, 0, X))


def test_mixed_switches_among_its_attacks():
    a = attack("mixed", mixed_period=1, mixed_kinds="zeros,scaling")
    outs = [a("act", step, 0, X) for step in range(12)]
    kinds = {"zeros" if not o.any() else "scaling" for o in outs}
    assert kinds == {"zeros", "scaling"}


@pytest.mark.parametrize("override,hint", [
    ("attack.kind=melt", "allowed: ['none', 'adaptive'"),
    ("attack.workers=r0s0", "first and last stages are honest in SENTINEL's threat model at 2 replicas"),
    ("attack.workers=r0s3", "first and last stages are honest"),
    ("mesh.replicas=4 verify.trusted_ends=always attack.workers=r0s3",
     "first and last stages are honest"),
    ("verify.trusted_ends=sometimes", "'sometimes': allowed: ['auto', 'always', 'never']"),
    ("attack.workers=r5s1", "not in the mesh of 2 replicas × 4 stages"),
    ("attack.workers=stage2", "not of the form r<replica>s<stage>"),
    ("attack.target=weights", "allowed: ['activations', 'gradients', 'both', 'dp']"),
    ("attack.mixed_kinds=zeros,adaptive", "attack.mixed_kinds"),
    ("attack.period=-1", "attack.period = -1: must be >= 0"),
    ("attack.period=2 attack.duty=3", "attack.duty = 3: in [1, attack.period = 2]"),
    ("attack.ramp_steps=-2", "attack.ramp_steps = -2: must be >= 0"),
    ("attack.kind=adaptive attack.ramp_steps=5", "attack.ramp_steps = 5: 0 for attack.kind = 'adaptive'"),
    ("attack.kind=forge_stale attack.ramp_steps=5", "0 for attack.kind = 'forge_stale'"),
    ("attack.kind=forge_ids", "attack.kind = 'forge_ids': forges index fields, which only codec.name or "
                              "codec.backward.name in"),
    ("attack.mixed_kinds=zeros,forge_shape", "attack.mixed_kinds"),
    ("attack.oversize_factor=0", "attack.oversize_factor = 0.0: must be > 0"),
    ("verify.name=paranoid", "allowed: ['none', 'sentinel']"),
    ("verify.metrics=l1,l3", "from ['l1', 'l2n', 'sfr', 'swd']"),
    ("verify.min_metrics=5", "in [1, 4]"),
])
def test_bad_attack_and_verify_settings_fail_before_training(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["attack.kind=zeros", "attack.workers=r1s1", *override.split()])
    assert hint in str(err.value)


@pytest.mark.parametrize("overrides", [("mesh.replicas=4",), ("verify.trusted_ends=never",)])
def test_attackers_may_sit_on_ends_the_threat_model_verifies(overrides):
    cfg = load_config(DEMO, ["attack.kind=zeros", "attack.workers=r0s0,r1s3", *overrides])
    assert cfg.attack.workers == "r0s0,r1s3"


def test_forge_ids_is_allowed_where_only_the_gradients_carry_indices():
    cfg = load_config(DEMO, ["attack.kind=forge_ids", "attack.workers=r0s1", "codec.backward.name=topk"])
    assert (cfg.codec.name, cfg.codec.backward.name) == ("identity", "topk")


def test_attack_workers_parse_from_the_command_line():
    cfg = load_config(DEMO, ["attack.kind=replay", "attack.workers=r0s1, r1s2",
                                            "attack.start_step=150", "attack.target=gradients",
                                            "verify.name=sentinel"])
    assert (cfg.attack.workers, cfg.attack.start_step, cfg.verify.name) == ("r0s1, r1s2", 150, "sentinel")


def test_permute_shuffles_whole_sequences_and_keeps_every_batch_statistic():
    x = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(3))
    a = attack("permute")
    for step in range(5):
        out = a("grad", step, 0, x)
        moved = [int(torch.nonzero((out == x[i]).all(dim=(1, 2)))[0]) for i in range(6)]
        assert sorted(moved) == list(range(6)) and all(j != i for i, j in enumerate(moved))  # a derangement
        assert torch.allclose(out.mean(dim=0), x.mean(dim=0), atol=1e-6)
        assert torch.allclose(out.norm(), x.norm())
    single = x[:1]  # one sequence: nothing to permute
    assert attack("permute")("act", 0, 0, single) is single


def test_ramp_fades_an_attack_in_linearly_from_its_start():
    a = attack("bias", start_step=10, ramp_steps=4)
    full = attack("bias")("act", 0, 0, X) - X
    shifts = [a("act", step, 0, X) - X for step in range(10, 16)]
    for k, shift in enumerate(shifts):
        assert torch.allclose(shift, min(1.0, (k + 1) / 4) * full, atol=1e-6)
    assert a("act", 9, 0, X) is X


def test_intermittent_attack_is_on_for_duty_steps_of_every_period():
    a = attack("zeros", start_step=2, period=4, duty=2)
    on = [step for step in range(12) if a("act", step, 0, X) is not X]
    assert on == [2, 3, 6, 7, 10, 11]
    assert a.pop_changed() == {("act", step, 0) for step in on}


def message(kind: str = "act", step: int = 0, microbatch: int = 0) -> Message:
    payload = IdentityCodec().encode(X, kind)
    return Message(kind, step, microbatch, WorkerId(1, 1), WorkerId(1, 2), payload)


@pytest.mark.parametrize("kind", sorted(set(FORGERIES) - {"forge_ids", "forge_stale"}))
def test_wire_forgeries_change_the_message_only_when_active_and_never_the_tensor(kind):
    a = attack(kind, start_step=3, target="activations")
    assert a("act", 3, 0, X) is X  # the tensor travels honestly ...
    honest = message(step=2)
    assert a.forge(honest) is honest  # ... and before its start, the message too
    now = message(step=3)
    forged = a.forge(now)
    assert forged is not now and isinstance(forged.payload, Encoded)
    assert torch.equal(now.payload.tensors["values"], X)  # the original was not modified in place
    assert a.forge(message("grad", step=3)).payload is not None and a.pop_changed() == {("act", 3, 0)}
    a.stop(4)
    later = message(step=4)
    assert a.forge(later) is later


def test_forge_ids_declines_without_index_fields():
    honest = message()
    assert attack("forge_ids").forge(honest) is honest


def test_forge_stale_sends_an_earlier_message_with_its_old_step():
    a = attack("forge_stale", start_step=1, replay_delay=2)
    sent = [a.forge(Message("act", t, 1, WorkerId(1, 1), WorkerId(1, 2),
                            IdentityCodec().encode(torch.full((1, 2, 2), float(t)), "act")))
            for t in range(6)]
    assert [m.step for m in sent] == [0, 0, 0, 1, 2, 3]
    assert [m.payload.tensors["values"][0, 0, 0].item() for m in sent] == [0, 0, 0, 1, 2, 3]
    b = attack("forge_stale", start_step=1, replay_delay=2)
    b.load_state_dict(a.state_dict())
    probe = message(step=6, microbatch=1)
    assert a.forge(probe).step == b.forge(probe).step == 4


def test_the_adaptive_attacker_passes_its_dp_contribution_through():
    """A worker hands its DP contribution to its attack too (``Worker.dp_contribution``, kind
    ``dp``); the adaptive attacker shadows pipeline verifiers only and raised KeyError 'dp' there,
    which crashed every adaptive run (found by bench/sentinel.py at 2 replicas)."""
    a = attack("adaptive", start_step=0)
    flat = torch.randn(50)
    assert a(kind="dp", step=5, microbatch=0, x=flat) is flat
