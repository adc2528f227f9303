"""Muon: step-for-step match with torch.optim.Muon / AdamW, routing, state_dict, LR schedules."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from meshlearn.optim.muon import Muon, lr_scale

SHAPES = [(64, 32), (32, 48), (40, 40)]


def grads_for(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def run_pair(opt_a, opt_b, params_a, params_b, steps: int) -> float:
    for t in range(steps):
        for pa, pb, g in zip(params_a, params_b, grads_for(t), strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    return max((a - b).abs().max().item() for a, b in zip(params_a, params_b, strict=True))


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_step_for_step(adjust_lr_fn, nesterov):
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in SHAPES]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    kw = dict(
        lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    # torch.optim.Muon runs Newton–Schulz in bf16; so must we to compare bit for bit.
    a = Muon(ours, ns_dtype=torch.bfloat16, **kw)
    b = torch.optim.Muon(ref, **kw)
    diff = run_pair(a, b, ours, ref, steps=4)
    assert diff <= 1e-6  # measured: 0.0 (bit-identical)
    assert max((w - p).abs().max().item() for w, p in zip(init, ours, strict=True)) > 1e-3


def test_fp32_newton_schulz_stays_close_to_torch_muon():
    # Our CPU default computes NS in fp32; it differs from torch's bf16 only by bf16 rounding.
    torch.manual_seed(0)
    init = [torch.randn(*s) for s in SHAPES]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    ref = [torch.nn.Parameter(w.clone()) for w in init]
    diff = run_pair(
        Muon(ours, lr=0.02), torch.optim.Muon(ref, lr=0.02, weight_decay=0.0), ours, ref, 3
    )
    assert diff < 2e-3  # measured 4e-4; three steps of size 0.02 each


def test_scale_factors_on_tall_and_wide_shapes():
    assert lr_scale(None, (1024, 512)) == pytest.approx(math.sqrt(2))
    assert lr_scale("original", (512, 1024)) == 1.0
    assert lr_scale("match_rms_adamw", (1024, 512)) == pytest.approx(0.2 * 32)
    assert lr_scale("match_rms_adamw", (512, 1024)) == pytest.approx(0.2 * 32)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        lr_scale("rms", (4, 4))


def test_mixed_module_equals_torch_muon_plus_torch_adamw(make_lm, lm_batches, loss_fn):
    ours_model, ref_model = make_lm(0), make_lm(0)
    opt = Muon(
        ours_model, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16,
        adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.01,
    )  # fmt: skip
    muon_groups = [g for g in opt.param_groups if g["use_muon"]]
    adamw_groups = [g for g in opt.param_groups if not g["use_muon"]]
    assert [g["param_names"] for g in muon_groups] == [["up.weight", "down.weight"]]
    assert [g["param_names"] for g in adamw_groups] == [
        ["tok_emb.weight", "up.bias", "norm.weight", "norm.bias", "lm_head.weight"]
    ]
    assert adamw_groups[0]["lr"] == 3e-3 and adamw_groups[0]["weight_decay"] == 0.01

    named = dict(ref_model.named_parameters())
    ref_muon = torch.optim.Muon(
        [named["up.weight"], named["down.weight"]], lr=0.02, weight_decay=0.1
    )
    ref_adamw = torch.optim.AdamW(
        [named[n] for n in adamw_groups[0]["param_names"]],
        lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False,
    )  # fmt: skip
    for batch in lm_batches[:3]:
        for model, opts in ((ours_model, [opt]), (ref_model, [ref_muon, ref_adamw])):
            loss_fn(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-6, name  # measured: 0.0


def test_state_dict_round_trips_and_resumed_steps_are_identical(make_lm, lm_batches, loss_fn):
    model = make_lm(0)
    opt = Muon(model, lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    for batch in lm_batches[:2]:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = make_lm(1)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_opt = Muon(resumed, lr=0.5, weight_decay=0.0, adamw_lr=0.5)  # overwritten by load
    resumed_opt.load_state_dict(saved["optim"])
    assert resumed_opt.param_groups[0]["lr"] == 0.02 and resumed_opt.param_groups[1]["lr"] == 1e-3
    states = list(resumed_opt.state.values())
    assert {"momentum_buffer"} in [set(s) for s in states]
    assert {"step", "exp_avg", "exp_avg_sq"} in [set(s) for s in states]

    for batch in lm_batches[2:]:
        for m, o in ((model, opt), (resumed, resumed_opt)):
            loss_fn(m, batch).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_every_group_follows_an_lr_schedule_from_its_own_base(make_lm, lm_batches, loss_fn):
    model = make_lm(0)
    opt = Muon(model, lr=0.02, adamw_lr=3e-4)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.02, 3e-4]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    opt.step()  # no gradients yet: a no-op, but schedulers expect it before their own step
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 1.5e-4])
    # A trainer that sets lr = initial_lr * factor itself; factor 0 freezes every parameter.
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * 0.0
    before = copy.deepcopy(model.state_dict())
    loss_fn(model, lm_batches[0]).backward()
    opt.step()
    for name, p in model.state_dict().items():
        assert torch.equal(p, before[name]), name


def test_plain_params_and_explicit_groups():
    w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8))
    opt = Muon([w, b])
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert "momentum" not in opt.param_groups[1] and "betas" not in opt.param_groups[0]
    opt = Muon([{"params": [w], "lr": 0.1}, {"params": [b], "use_muon": False, "lr": 1e-2}])
    assert [(g["use_muon"], g["lr"], g["initial_lr"]) for g in opt.param_groups] == [
        (True, 0.1, 0.1),
        (False, 1e-2, 1e-2),
    ]
    with pytest.raises(ValueError, match="use_muon"):
        Muon([{"params": [w, b]}])
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [b], "use_muon": True}])


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"lr": -1.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"adjust_lr_fn": "rms"}, "adjust_lr_fn"),
        ({"adamw_betas": (0.9, 1.0)}, "adamw_betas"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
