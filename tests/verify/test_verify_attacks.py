"""Attacks: what each sends, when it is active, and that it is reproducible."""

from __future__ import annotations

import pytest
import torch

from meshlearn.config import ConfigError, load_config
from meshlearn.verify.attacks import ATTACKS, AttackConfig, build_attack

X = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)) + 0.3


def attack(kind: str, **overrides) -> object:
    return build_attack(kind, AttackConfig(**({"kind": kind} | overrides)), seed=1)


@pytest.mark.parametrize("kind", sorted(set(ATTACKS) - {"adaptive"}))
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


@pytest.mark.parametrize("kind", ["random", "sign_flip", "bias", "invisible_noise", "mixed"])
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
    ("attack.workers=r0s0", "first and last stages are honest"),
    ("attack.workers=r0s3", "first and last stages are honest"),
    ("attack.workers=r5s1", "not in the mesh of 2 replicas × 4 stages"),
    ("attack.workers=stage2", "not of the form r<replica>s<stage>"),
    ("attack.target=weights", "allowed: ['activations', 'gradients', 'both']"),
    ("attack.mixed_kinds=zeros,adaptive", "attack.mixed_kinds"),
    ("verify.name=paranoid", "allowed: ['none', 'sentinel']"),
    ("verify.metrics=l1,l3", "from ['l1', 'l2n', 'sfr', 'swd']"),
    ("verify.min_metrics=5", "in [1, 4]"),
])
def test_bad_attack_and_verify_settings_fail_before_training(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.toml", ["attack.kind=zeros", "attack.workers=r1s1", override])
    assert hint in str(err.value)


def test_attack_workers_parse_from_the_command_line():
    cfg = load_config("configs/demo.toml", ["attack.kind=replay", "attack.workers=r0s1, r1s2",
                                            "attack.start_step=150", "attack.target=gradients",
                                            "verify.name=sentinel"])
    assert (cfg.attack.workers, cfg.attack.start_step, cfg.verify.name) == ("r0s1, r1s2", 150, "sentinel")
