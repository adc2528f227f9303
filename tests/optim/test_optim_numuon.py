"""NuMuon: rank-k steps, full-rank equivalence with Muon, rank schedules, argument errors."""

from __future__ import annotations

import io
import math

import pytest
import torch

from meshlearn.optim.muon import Muon, lr_scale
from meshlearn.optim.numuon import NuMuon, krylov_seed, matrix_rank, rank_for_fraction


def one_matrix(shape=(48, 32), seed=0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def grad_like(p: torch.Tensor, step: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(500 + step))


def step_delta(opt: torch.optim.Optimizer, p: torch.Tensor, step: int) -> torch.Tensor:
    """Apply one step with a fresh gradient; return W_new − W_old in fp64."""
    before = p.detach().double().clone()
    p.grad = grad_like(p, step)
    opt.step()
    return p.detach().double() - before


# --------------------------------------------------------------------------- the update


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_update_has_rank_exactly_k_with_unit_singular_values(shape, k):
    p = one_matrix(shape)
    opt = NuMuon([p], lr=0.02, rank=k, weight_decay=0.0)
    for t in range(3):  # cold start, then warm starts
        s = torch.linalg.svdvals(step_delta(opt, p, t))
        size = 0.02 * lr_scale(None, shape)  # lr · √max(1, m/n)
        torch.testing.assert_close(
            s[:k] / size, torch.ones(k, dtype=torch.float64), atol=1e-4, rtol=0
        )
        assert s[k:].max() / size < 1e-4


def test_match_muon_rms_scales_by_sqrt_full_over_k():
    p = one_matrix((48, 32))
    opt = NuMuon([p], lr=0.02, rank=8, match_muon_rms=True)
    s = torch.linalg.svdvals(step_delta(opt, p, 0))
    expected = 0.02 * math.sqrt(48 / 32) * math.sqrt(32 / 8)
    torch.testing.assert_close(
        s[:8], torch.full((8,), expected, dtype=torch.float64), rtol=1e-4, atol=0
    )
    # …so the update's Frobenius norm (RMS) equals that of an exactly orthogonal full-rank step.
    assert s.norm().item() == pytest.approx(0.02 * math.sqrt(48 / 32) * math.sqrt(32), rel=1e-4)


@pytest.mark.parametrize("nesterov", [True, False])
def test_full_rank_is_muon_step_for_step(nesterov, make_lm, lm_batches, loss_fn):
    a, b = make_lm(0), make_lm(0)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adamw_lr=1e-3)
    nu = NuMuon(a, rank_fraction=1.0, **kw)
    mu = Muon(b, **kw)
    for batch in lm_batches[:3]:
        for model, opt in ((a, nu), (b, mu)):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)  # both take the Newton–Schulz path: identical


def test_rank_just_below_full_is_exact_svd_and_points_where_muon_does():
    # k = min(m, n) − 1 takes the Krylov path. On the first step the momentum input is a multiple
    # of the gradient, so the step must be the exact top-k factor U_k V_kᵀ of the gradient.
    p, q = one_matrix((48, 32)), one_matrix((48, 32))
    size = 0.02 * lr_scale(None, (48, 32))
    d_nu = step_delta(NuMuon([p], lr=0.02, rank=31, nesterov=True), p, 0)
    U, _, Vh = torch.linalg.svd(grad_like(p, 0).double(), full_matrices=False)
    torch.testing.assert_close(-d_nu / size, U[:, :31] @ Vh[:31], atol=1e-4, rtol=0)
    # Muon's NS direction has cosine ≈ 0.986 with the full polar factor, and dropping one of 32
    # unit directions costs a factor √(31/32) ≈ 0.984: expect ≈ 0.97.
    d_mu = step_delta(Muon([q], lr=0.02), q, 0)
    cos = torch.nn.functional.cosine_similarity(d_nu.flatten(), d_mu.flatten(), dim=0)
    assert cos > 0.95  # measured 0.964


def test_warm_start_basis_is_kept_per_parameter():
    p = one_matrix((48, 32))
    opt = NuMuon([p], lr=0.02, rank_fraction=0.25)
    step_delta(opt, p, 0)
    assert opt.state[p]["basis"].shape == (32, 8)
    opt_cold = NuMuon([one_matrix()], rank_fraction=0.25, warm_start=False)
    step_delta(opt_cold, opt_cold.param_groups[0]["params"][0], 0)
    assert "basis" not in next(iter(opt_cold.state.values()))


# --------------------------------------------------------------------------- rank schedules


def test_fixed_rank_and_fraction():
    assert matrix_rank(0, (64, 32), rank=5, rank_fraction=None) == 5
    assert matrix_rank(0, (64, 32), rank=100, rank_fraction=None) == 32  # clamped
    assert matrix_rank(0, (64, 32), rank=None, rank_fraction=0.25) == 8
    assert matrix_rank(0, (64, 32), rank=None, rank_fraction=0.3) == 10  # ⌈9.6⌉
    assert matrix_rank(0, (64, 32), rank=None, rank_fraction=0.001) == 1  # at least 1
    assert rank_for_fraction(0.07, (100, 100)) == 7  # 0.07·100 = 7.000000000000001 in floats


def test_piecewise_schedule():
    kw = {"milestones": [(10, 0.5), (20, 0.25)]}
    ks = {t: matrix_rank(t, (64, 32), None, 1.0, "piecewise", kw) for t in (0, 9, 10, 19, 20, 999)}
    assert ks == {0: 32, 9: 32, 10: 16, 19: 16, 20: 8, 999: 8}


def test_cosine_schedule():
    kw = {"end_fraction": 0.25, "total_steps": 110, "start_step": 10}
    ks = {t: matrix_rank(t, (64, 32), None, 1.0, "cosine", kw) for t in (0, 10, 60, 110, 500)}
    # midpoint: 0.25 + 0.75·0.5 = 0.625 → ⌈20⌉ = 20
    assert ks == {0: 32, 10: 32, 60: 20, 110: 8, 500: 8}
    quarter = matrix_rank(35, (64, 32), None, 1.0, "cosine", kw)
    assert quarter == math.ceil(32 * (0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi / 4))))


def test_the_optimizer_applies_the_scheduled_rank_each_step():
    p = one_matrix((48, 32))
    opt = NuMuon(
        [p], lr=0.02, rank_fraction=1.0, rank_schedule="piecewise",
        rank_schedule_kwargs={"milestones": [(2, 0.5), (4, 0.125)]},
    )  # fmt: skip
    ranks = []
    for t in range(5):
        s = torch.linalg.svdvals(step_delta(opt, p, t))
        ranks.append(int((s > 1e-3 * s[0]).sum()))
    assert ranks == [32, 32, 16, 16, 4]
    assert opt.state[p]["step"] == 5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "rank=None, rank_fraction=None"),
        ({"rank": 4, "rank_fraction": 0.5}, "exactly one of rank"),
        ({"rank": 0}, "rank must be an int >= 1, got rank=0"),
        ({"rank": 2.5}, "rank must be an int"),
        ({"rank": True}, "rank must be an int"),
        ({"rank_fraction": 0.0}, r"rank_fraction must be a float in \(0, 1\], got 0.0"),
        ({"rank_fraction": 1.5}, "rank_fraction must be"),
        ({"rank_fraction": 0.5, "rank_schedule": "linear"}, "rank_schedule must be one of"),
        ({"rank": 4, "rank_schedule": "cosine"}, "pass rank_fraction"),
        ({"rank_fraction": 1.0, "rank_schedule": "cosine"}, "rank_schedule_kwargs for 'cosine'"),
        (
            {"rank_fraction": 1.0, "rank_schedule": "piecewise",
             "rank_schedule_kwargs": {"milestones": [(20, 0.5), (10, 0.25)]}},
            "milestones",
        ),
        (
            {"rank_fraction": 1.0, "rank_schedule": "cosine",
             "rank_schedule_kwargs": {"end_fraction": 0.25, "total_steps": 0}},
            "total_steps",
        ),
        ({"rank_fraction": 0.5, "krylov_iters": 0}, "krylov_iters"),
    ],
)  # fmt: skip
def test_bad_rank_arguments_raise_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NuMuon([one_matrix()], **kwargs)


# --------------------------------------------------------------------------- state and seeding


def test_state_dict_round_trip_with_schedule_and_warm_start(make_lm, lm_batches, loss_fn):
    kw = dict(
        lr=0.02, rank_fraction=0.5, rank_schedule="piecewise",
        rank_schedule_kwargs={"milestones": [(3, 0.25)]}, adamw_lr=1e-3,
    )  # fmt: skip
    model = make_lm(0)
    opt = NuMuon(model, **kw)
    for batch in lm_batches[:2]:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_lm(1)
    resumed.load_state_dict(saved["model"])
    resumed_opt = NuMuon(resumed, lr=0.02, rank_fraction=1.0)  # schedule comes from the checkpoint
    resumed_opt.load_state_dict(saved["optim"])
    assert resumed_opt.param_groups[0]["rank_schedule"] == "piecewise"
    for batch in lm_batches[2:]:  # steps 2, 3, 4: crosses the milestone, uses the saved bases
        for m, o in ((model, opt), (resumed, resumed_opt)):
            loss_fn(m, batch).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_seed_determinism_and_name_keyed_draws(make_lm, lm_batches, loss_fn):
    def run(seed: int, split: bool) -> dict[str, torch.Tensor]:
        model = make_lm(0)
        named = list(model.named_parameters())
        kw = dict(lr=0.02, rank=3, warm_start=False, seed=seed)
        if split:  # two "pipeline stages", each with its own optimizer
            stage_a = [(n, p) for n, p in named if n.startswith("down")]
            stage_b = [(n, p) for n, p in named if not n.startswith("down")]
            opts = [NuMuon(stage_a, **kw), NuMuon(stage_b, **kw)]
        else:
            opts = [NuMuon(named, **kw)]
        for batch in lm_batches[:3]:
            loss_fn(model, batch).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b, c = run(0, False), run(0, False), run(1, False)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["down.weight"], c["down.weight"])
    # Draws are keyed by parameter name, not position: split optimizers update identically.
    split = run(0, True)
    assert all(torch.equal(a[n], split[n]) for n in a)


def test_krylov_seed_is_a_63_bit_mix():
    seeds = {krylov_seed(s, k, t) for s in range(3) for k in range(3) for t in range(3)}
    assert len(seeds) == 27 and all(0 <= x < 2**63 for x in seeds)


def test_the_config_cosine_schedule_holds_then_anneals_to_the_rank_fraction():
    """optim.numuon_rank_schedule=cosine over train.steps=100: full rank for 10 steps, the target
    fraction from step 80 on (the method note's recipe)."""
    from torch import nn

    from meshlearn.optim import OptimConfig, build_optimizer

    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    cfg = OptimConfig(name="numuon", numuon_rank_fraction=0.25, numuon_rank_schedule="cosine")
    opt = build_optimizer(model, cfg, lr=1e-2, total_steps=100)
    group = next(g for g in opt.param_groups if "rank_schedule" in g)
    ranks = [opt.rank_at(group, step, (32, 64)) for step in (0, 10, 45, 80, 99)]
    assert ranks[0] == ranks[1] == 32 and 8 < ranks[2] < 32 and ranks[3] == ranks[4] == 8
    fixed = build_optimizer(model, OptimConfig(name="numuon", numuon_rank_fraction=0.25), lr=1e-2)
    assert fixed.rank_at(next(g for g in fixed.param_groups if "rank_schedule" in g), 0, (32, 64)) == 8


def _train_through_the_factory(cfg, make_lm, lm_batches, loss_fn) -> list[torch.Tensor]:
    from meshlearn.optim import build_optimizer

    model = make_lm(0)
    opt = build_optimizer(model, cfg, lr=0.02, total_steps=len(lm_batches))
    for batch in lm_batches:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_config_nesterov_makes_full_rank_numuon_muon(make_lm, lm_batches, loss_fn):
    """optim.numuon_nesterov = true at rank fraction 1.0 trains exactly as optim.name = muon (which
    always uses Nesterov) over five steps; without it the same run differs (negative control)."""
    from meshlearn.optim import OptimConfig

    muon = _train_through_the_factory(OptimConfig(name="muon"), make_lm, lm_batches, loss_fn)
    runs = {nesterov: _train_through_the_factory(
        OptimConfig(name="numuon", numuon_rank_fraction=1.0, numuon_nesterov=nesterov),
        make_lm, lm_batches, loss_fn) for nesterov in (True, False)}
    for p, q in zip(runs[True], muon, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert max((p - q).abs().max().item() for p, q in zip(runs[False], muon, strict=True)) > 1e-4


def test_numuon_nesterov_defaults_off_as_the_method_note_says():
    from meshlearn.optim import OptimConfig, build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    opt = build_optimizer(model, OptimConfig(name="numuon"), lr=1e-2)
    assert OptimConfig().numuon_nesterov is False
    assert [g["nesterov"] for g in opt.param_groups if "rank_schedule" in g] == [False]


def test_the_config_key_takes_a_boolean_and_names_itself_otherwise():
    from meshlearn.config import ConfigError, load_config

    assert load_config(None, ["optim.numuon_nesterov=true"]).optim.numuon_nesterov is True
    with pytest.raises(ConfigError, match=r"optim.numuon_nesterov = .*boolean"):
        load_config(None, ["optim.numuon_nesterov=sometimes"])
