"""Robust DP aggregation (``dp.robust``) and the DP attack (``attack.target = dp``), issue 32.

Unit tests check each rule on hand-made contributions; run tests train the tiny model in the
simulator (P = 3 so that stage 1 may attack, D = 4) and compare weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.dp.base import Exchange
from meshlearn.dp.lowrank import LowRankCompressor
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.dp.robust import RULES, Robust
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.train import Trainer

ROBUST = [r for r in RULES if r != "none"]


def honest(d: int, n: int = 200, seed: int = 0, spread: float = 0.1) -> torch.Tensor:
    """``d`` honest contributions: one true gradient plus small per-replica noise."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(n, generator=g)
    return true + spread * torch.randn(d, n, generator=g)


# --- the rules on their own ----------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_the_mean_when_all_contributions_agree(rule):
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    parts = x.expand(4, -1).clone()
    assert torch.equal(Robust(rule).reduce(parts), parts.sum(0) / 4)


@pytest.mark.parametrize("rule", RULES)
def test_two_contributions_give_their_mean_for_every_rule(rule):
    """D = 2: no majority, so nothing better than the mean exists (config refuses it; the
    arithmetic says the same)."""
    parts = honest(2)
    expected = parts.sum(0) / 2
    assert torch.allclose(Robust(rule).reduce(parts), expected, atol=1e-6)


@pytest.mark.parametrize("rule", ROBUST)
@pytest.mark.parametrize("attack", ["scale_-4", "sign_flip", "bias", "huge", "nan", "inf"])
def test_one_outlier_among_four_is_ignored(rule, attack):
    """The aggregate stays within the honest contributions' own spread of their mean, while the
    plain mean is pulled far away (or made non-finite on every replica)."""
    parts = honest(4)
    good = parts[:3].sum(0) / 3
    x = parts[3]
    bad = {"scale_-4": -4 * x, "sign_flip": x * torch.where(torch.arange(x.numel()) % 2 == 0, -1.0, 1.0),
           "bias": x + 3.0, "huge": 1e6 * x, "nan": x.index_fill(0, torch.tensor([5]), torch.nan),
           "inf": x.index_fill(0, torch.tensor([5]), -torch.inf)}[attack]
    parts[3] = bad
    spread = (parts[:3] - good).norm(dim=1).max()
    got = Robust(rule).reduce(parts)
    mean = parts.sum(0) / 4
    assert (got - good).norm() <= 1.5 * spread
    assert not ((mean - good).norm() <= 3 * spread)  # the attack matters without a robust rule


def test_trimmed_mean_drops_trim_values_at_each_end():
    parts = torch.tensor([[1.0], [2.0], [3.0], [4.0], [100.0]])
    assert Robust("trimmed_mean", 1).reduce(parts).item() == 3.0  # (2 + 3 + 4) / 3
    assert Robust("trimmed_mean", 2).reduce(parts).item() == 3.0
    assert Robust("median").reduce(parts[:4]).item() == 2.5


@pytest.mark.parametrize("rule", ROBUST)
def test_exchange_gives_every_replica_the_same_bits(rule):
    """The message strategies' all-gather: each replica reduces the same stacked parts."""
    d, parts = 4, honest(4, n=97)
    parts[2] *= -4
    exchanges = [Exchange(WorkerId(r, 1), d, Robust(rule)) for r in range(d)]
    messages = [m for r, ex in enumerate(exchanges) for m in ex.share((5, 0), parts[r], 5)]
    for m in messages:
        exchanges[m.dst.replica].receive(m)
    results = [ex.mean((5, 0)) for ex in exchanges]
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert torch.equal(results[0], Robust(rule).reduce(parts))


# --- PowerSGD's error feedback under a robust rule ---------------------------------------------------

def outlier_gradients(d: int = 4) -> list[torch.Tensor]:
    """d replicas' (5 × 6) gradients, replica d − 1 far from the others. At rank 5 the
    orthonormal P spans all of R⁵, so compression leaves nothing out of any replica's M."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(5, 6, generator=g)
    grads = [base + 0.1 * torch.randn(5, 6, generator=g) for _ in range(d)]
    grads[-1] = -4 * grads[-1]
    return grads


@pytest.mark.parametrize("rule", ["none", "median"])
def test_at_full_rank_a_robust_powersgd_feeds_back_nothing_the_rule_left_out(rule):
    """Full rank loses nothing to compression: under a robust rule every replica's error is 0, the
    outlier's too (what the median left out of its factors is not fed back into its next round);
    under the mean the errors keep the original M − P·Qᵀ, which sum to 0 over the replicas."""
    grads = outlier_gradients()
    strategies = []
    for r, grad in enumerate(grads):
        module = torch.nn.Linear(6, 5, bias=False)
        module.weight.grad = grad.clone()
        strategy = PowerSGD(WorkerId(r, 1), len(grads), module, rank=5, seed=0)
        strategy.exchange.robust = Robust(rule)
        strategies.append(strategy)
    queue = [m for s in strategies for m in s.pre_step(0)]
    while queue:
        message = queue.pop(0)
        queue += strategies[message.dst.replica].receive(message)
    errors = torch.stack([s.compressor.error[0] for s in strategies])
    if rule == "none":
        assert errors.sum(0).abs().max() < 1e-4 and errors[-1].abs().max() > 1.0
    else:
        assert errors.abs().max() < 1e-4


def test_the_compressor_feeds_back_only_its_own_compression_residual_under_a_robust_rule():
    """``LowRankCompressor.finish(own=True)`` (DiLoCo's pseudo-gradients with dp.compress =
    powersgd): at full rank the error is 0 whatever the aggregate; with the aggregate's Q it is not."""
    grads = outlier_gradients()
    compressors = [LowRankCompressor([torch.Size([5, 6])], rank=5, seed=0) for _ in grads]
    ps = torch.stack([c.phase0((0, 0), [g]) for c, g in zip(compressors, grads, strict=True)])
    qs = torch.stack([c.phase1((0, 0), Robust("median").reduce(ps)) for c in compressors])
    q = Robust("median").reduce(qs)
    compressors[0].finish((0, 0), q, own=True)
    compressors[-1].finish((0, 0), q, own=True)
    assert compressors[0].error[0].abs().max() < 1e-4 and compressors[-1].error[0].abs().max() < 1e-4
    compressors[1].finish((0, 0), q)  # the aggregate's Q: what the median left out stays
    assert compressors[1].error[0].abs().max() > 1e-3


# --- whole runs ------------------------------------------------------------------------------------

MESH = ["mesh.stages=3", "mesh.replicas=4", "model.n_layer=3", "train.batch_size=16", "train.steps=4"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", "attack.workers=r1s1", "attack.target=dp",
          "attack.start_step=1"]
STRATEGIES = {
    "allreduce": [],
    "sparse": ["dp.name=sparse", "dp.fraction=0.5", "dp.delay=0", "dp.rule=avg"],
    "powersgd": ["dp.name=powersgd", "dp.rank=2"],
    "diloco": ["dp.name=diloco", "dp.inner_steps=2", "dp.fragments=1"],
}


def train(tiny_corpus, tmp_path, name, *sets) -> tuple[Trainer, dict]:
    cfg = tiny_config(tiny_corpus, *MESH, *sets)
    trainer = Trainer(cfg, tmp_path / name, progress=False)
    return trainer, trainer.train()


def stage_params(trainer: Trainer, replica: int, stage: int) -> torch.Tensor:
    module = trainer.workers[WorkerId(replica, stage)].module
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_dp_attack_changes_what_the_victim_stage_applies(tiny_corpus, tmp_path, strategy):
    """``attack.target = dp`` reaches every strategy's contribution: the attacked stage's honest
    replica 0 ends elsewhere than without it (its own forward and backward are honest)."""
    clean, _ = train(tiny_corpus, tmp_path, "clean", *STRATEGIES[strategy])
    hit, _ = train(tiny_corpus, tmp_path, "hit", *STRATEGIES[strategy], *ATTACK)
    moved = (stage_params(clean, 0, 1) - stage_params(hit, 0, 1)).abs().max().item()
    assert moved > 1e-4


@pytest.mark.parametrize("rule", ROBUST)
def test_replicas_stay_bit_identical_after_robust_rounds(tiny_corpus, tmp_path, rule):
    trainer, _ = train(tiny_corpus, tmp_path, rule, f"dp.robust={rule}", *ATTACK)
    for stage in range(3):
        first = stage_params(trainer, 0, stage)
        assert all(torch.equal(first, stage_params(trainer, r, stage)) for r in range(1, 4))


@pytest.mark.parametrize("rule", ROBUST)
def test_a_robust_rule_keeps_the_attacked_stage_near_clean(tiny_corpus, tmp_path, rule):
    """Under a ×−4 DP attack the robust stage stays far closer to the clean run's than the mean."""
    clean, _ = train(tiny_corpus, tmp_path, "clean", f"dp.robust={rule}")
    plain, _ = train(tiny_corpus, tmp_path, "plain", *ATTACK)
    robust, _ = train(tiny_corpus, tmp_path, "robust", f"dp.robust={rule}", *ATTACK)
    ref = stage_params(clean, 0, 1)
    assert (stage_params(robust, 0, 1) - ref).norm() < 0.5 * (stage_params(plain, 0, 1) - ref).norm()


def test_a_robust_allreduce_is_charged_as_an_all_gather(tiny_corpus, tmp_path):
    """(D − 1)·N bytes per replica instead of the ring's 2(D − 1)/D·N: twice as many at D = 4."""
    _, ring = train(tiny_corpus, tmp_path, "ring")
    _, gather = train(tiny_corpus, tmp_path, "gather", "dp.robust=median")
    ring_dp = json.loads((tmp_path / "ring" / "summary.json").read_text())["bytes_per_token_dp"]
    gather_dp = json.loads((tmp_path / "gather" / "summary.json").read_text())["bytes_per_token_dp"]
    assert gather_dp == pytest.approx(2 * ring_dp, rel=1e-3)


@pytest.mark.parametrize(("sets", "key"), [
    (["dp.robust=mean"], "dp.robust"),
    (["mesh.replicas=2", "train.batch_size=8", "dp.robust=median"], "dp.robust"),
    (["dp.robust=trimmed_mean", "dp.trim=2"], "dp.trim"),
    (["dp.trim=0"], "dp.trim"),
    (["attack.kind=forge_shape", "attack.workers=r1s1", "attack.target=dp"], "attack.kind"),
    (["mesh.replicas=1", "train.batch_size=8", *ATTACK], "attack.target"),
])
def test_bad_robust_settings_are_one_line_naming_the_key(tiny_corpus, sets, key):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *MESH, *sets)
    assert key in str(err.value) and "\n" not in str(err.value)
