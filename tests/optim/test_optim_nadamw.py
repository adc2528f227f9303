"""NAdamW: step-for-step match with torch.optim.NAdam, state and resume, the factory's routing and
betas, training a tiny Decoder, and mesh = unsplit model."""

from __future__ import annotations

import io
import math

import pytest
import torch
from tiny import reference_run, tiny_config

from meshlearn.config import load_config
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig, init_model, merge_stages
from meshlearn.optim import NAdamW, OptimConfig, build_optimizer
from meshlearn.optim.nadamw import momentum_at
from meshlearn.train import Trainer

SHAPES = [(24, 16), (16,), (3, 4, 5)]
LRS = [1e-2, 8e-3, 5e-3, 5e-3, 2e-3, 1e-3]  # changed between steps, as the trainer's schedule does


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Decay on the first and last tensors, none on the 1-D one (as decay_groups does)."""
    return [{"params": [params[0], params[2]], "weight_decay": 0.1},
            {"params": [params[1]], "weight_decay": 0.0}]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=g)
        if step == 2 and i == 2:
            p.grad = None  # skipped this step: its own step count falls behind the others'


def run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for t in steps:
        set_grads(params, t)
        for group in opt.param_groups:
            group["lr"] = LRS[t]
        opt.step()


def torch_nadamw(params: list[torch.nn.Parameter]) -> torch.optim.NAdam:
    return torch.optim.NAdam(groups(params), lr=LRS[0], betas=(0.99, 0.999), eps=1e-8,
                             momentum_decay=0.004, decoupled_weight_decay=True, foreach=False)


def test_matches_torch_nadam_step_for_step():
    ours, ref = make_params(), make_params()
    a = NAdamW(groups(ours), lr=LRS[0], betas=(0.99, 0.999), eps=1e-8)
    b = torch_nadamw(ref)
    start = [p.detach().clone() for p in ours]
    for t in range(len(LRS)):
        run(a, ours, range(t, t + 1))
        run(b, ref, range(t, t + 1))
        # Bit for bit, not a tolerance: using μ_t for μ_{t+1} in the look-ahead term moves the
        # parameters by only ~1e-7 here (ψ = 0.004 makes μ change slowly), under any 1e-6 bound.
        worst = max((x - y).abs().max().item() for x, y in zip(ours, ref, strict=True))
        assert worst == 0.0, f"step {t + 1}: parameters differ by {worst}"
        for x, y in zip(ours, ref, strict=True):
            assert torch.equal(a.state[x]["exp_avg"], b.state[y]["exp_avg"])
            assert torch.equal(a.state[x]["exp_avg_sq"], b.state[y]["exp_avg_sq"])
    assert [a.state[p]["step"] for p in ours] == [6, 6, 5]
    assert [int(b.state[p]["step"]) for p in ref] == [6, 6, 5]
    assert math.isclose(a.state[ours[0]]["mu_product"], float(b.state[ref[0]]["mu_product"]), rel_tol=1e-6)
    assert min((x - s).abs().max().item() for x, s in zip(ours, start, strict=True)) > 1e-3


def test_momentum_warms_up_from_half_beta1():
    """μ_t = β1(1 − ½·0.96^{tψ}): ≈ 0.495 at the first step, ≈ 0.97 after 20k (the method note)."""
    assert momentum_at(0.99, 1) == pytest.approx(0.495, abs=1e-3)
    assert momentum_at(0.99, 20_000) == pytest.approx(0.971, abs=1e-3)
    assert momentum_at(0.99, 10**7) == pytest.approx(0.99, abs=1e-9)


def test_state_dict_round_trip_resumes_exactly_and_keeps_the_step_count():
    straight, resumed = make_params(), make_params()
    a = NAdamW(groups(straight), lr=LRS[0])
    run(a, straight, range(6))

    first = NAdamW(groups(resumed), lr=LRS[0])
    run(first, resumed, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = NAdamW(groups(resumed), lr=LRS[0])
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert [second.state[p]["step"] for p in resumed] == [3, 3, 2]  # continued, not reset
    run(second, resumed, range(3, 6))

    assert all(torch.equal(x, y) for x, y in zip(straight, resumed, strict=True))
    assert [second.state[p]["step"] for p in resumed] == [6, 6, 5]
    assert second.state[resumed[0]]["mu_product"] == a.state[straight[0]]["mu_product"]


def test_bad_arguments_name_the_argument():
    p = make_params()
    for kwargs, name in [({"lr": -1.0}, "lr"), ({"betas": (0.99, 1.0)}, "betas"),
                         ({"weight_decay": -0.1}, "weight_decay"), ({"eps": -1.0}, "eps")]:
        with pytest.raises(ValueError, match=f"NAdamW: {name} must be"):
            NAdamW(p, **kwargs)


def test_factory_routes_like_adamw_and_defaults_betas_per_optimizer(make_lm):
    model = make_lm(0)
    opt = build_optimizer(model, OptimConfig(name="nadamw", weight_decay=0.05), lr=1e-3)
    assert isinstance(opt, NAdamW)
    decayed, plain = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decayed["params"]} == {
        "tok_emb.weight", "up.weight", "down.weight", "lm_head.weight"}
    assert {names[id(p)] for p in plain["params"]} == {"up.bias", "norm.weight", "norm.bias"}
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.05, 0.0)
    assert decayed["betas"] == (0.99, 0.999) and decayed["momentum_decay"] == 0.004

    def betas(name: str, **keys: float) -> tuple[float, float]:
        return build_optimizer(model, OptimConfig(name=name, **keys), lr=1e-3).param_groups[0]["betas"]

    assert betas("nadamw", beta1=0.95) == (0.95, 0.999)
    assert betas("adamw") == (0.9, 0.95)  # unchanged defaults of the other optimizers
    assert betas("adamw", beta2=0.99) == (0.9, 0.99)
    assert betas("adamw", beta1=0.8, beta2=0.9) == (0.8, 0.9)
    assert build_optimizer(model, OptimConfig(name="sgd"), lr=1e-3).param_groups[0]["momentum"] == 0.9
    muon = build_optimizer(model, OptimConfig(name="muon", beta1=0.85), lr=1e-3)
    assert next(g for g in muon.param_groups if not g["use_muon"])["betas"] == (0.85, 0.95)


@pytest.mark.parametrize("override,value,allowed", [
    ("optim.beta1=1.0", "1.0", "in (0, 1), or 0 for the optimizer's own default"),
    ("optim.beta2=-0.5", "-0.5", "in (0, 1), or 0 for the optimizer's own default"),
    ("optim.beta1=nan", "nan", "must be a finite number"),  # the loader's check of every number
])
def test_bad_betas_fail_in_one_line_naming_field_value_and_range(override, value, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optim.name=nadamw", override])
    assert str(err.value) == f"{override.split('=')[0]} = {value}: {allowed}"


def test_config_accepts_nadamw_and_explicit_betas():
    cfg = load_config(None, ["optim.name=nadamw", "optim.beta1=0.97"]).optim
    assert (cfg.name, cfg.beta1, cfg.beta2) == ("nadamw", 0.97, 0.0)
    with pytest.raises(ConfigError, match=r"^optim.no_ws_lr_anneal = -0.1: "):
        load_config(None, ["optim.no_ws_lr_anneal=-0.1"])


def test_nadamw_trains_a_tiny_decoder_through_the_factory():
    cfg = DecoderConfig(vocab_size=32, n_layer=2, d_model=32, n_head=2, seq_len=16)
    model = init_model(cfg, 0)
    opt = build_optimizer(model, OptimConfig(name="nadamw"), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (4, 16), generator=g)
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(40):
        loss = Decoder.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(32), abs=0.2)  # starts at chance
    assert losses[-1] < 0.25 * losses[0], losses[::8]  # and learns the fixed batch (measured 0.10)
    assert all(opt.state[p]["step"] == 40 for p in model.parameters())


def test_mesh_matches_unsplit_model_with_nadamw(tiny_corpus, tmp_path):
    """NAdamW acts per parameter, so 2 stages × 2 replicas reproduce the unsplit model."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", "optim.name=nadamw")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = reference_run(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    states = [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(2)]
    merged = merge_stages(trainer.cfg.model, states).state_dict()
    reference = ref_model.state_dict()
    assert max((merged[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5
    # The stage optimizers really moved the weights (a no-op optimizer would also "match").
    start = init_model(trainer.cfg.model, trainer.cfg.seed).state_dict()
    assert max((merged[k] - start[k]).abs().max().item() for k in reference) > 1e-3

