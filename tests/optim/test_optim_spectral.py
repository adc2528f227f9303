"""Spectral correction: the filter's algebra (norm never grows, linear, identity at τ = 0 on a full
basis), the anchor EMA, α = 1 as the base optimizer bit for bit, and its config checks."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_config

from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig
from meshlearn.optim import SpectralConfig, SpectralCorrection, build_optimizer, filter_gradient
from meshlearn.optim.factory import OptimConfig
from meshlearn.optim.spectral import AnchorBasis, damping
from meshlearn.train import Trainer

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def low_rank(m: int, n: int, rank: int) -> torch.Tensor:
    return randn(m, rank) @ randn(rank, n)


@pytest.mark.parametrize(("m", "n", "rank"), [(12, 12, 12), (16, 8, 8), (8, 20, 3), (10, 10, 1)])
@pytest.mark.parametrize("tau", [0.0, 1e-3, 0.5, 10.0])
def test_the_filter_never_increases_the_frobenius_norm(m, n, rank, tau):
    basis = AnchorBasis.of(low_rank(m, n, rank))
    for _ in range(5):
        grad = randn(m, n) * 3
        filtered = filter_gradient(grad, basis, tau)
        assert filtered.norm() <= grad.norm() * (1 + 1e-6)
        for alpha in (0.0, 0.3, 0.7):  # and so neither does the blend (a convex combination)
            assert torch.lerp(filtered, grad, alpha).norm() <= grad.norm() * (1 + 1e-6)


def test_tau_zero_on_a_full_rank_square_basis_is_the_identity():
    basis = AnchorBasis.of(randn(10, 10))
    grad = randn(10, 10)
    assert torch.allclose(filter_gradient(grad, basis, 0.0), grad, atol=1e-5)


def test_the_filter_is_linear_and_damps_entry_ij_by_di_dj():
    basis = AnchorBasis.of(low_rank(9, 7, 5))
    g1, g2 = randn(9, 7), randn(9, 7)
    tau = 0.3
    combined = filter_gradient(2.0 * g1 - 0.5 * g2, basis, tau)
    separate = 2.0 * filter_gradient(g1, basis, tau) - 0.5 * filter_gradient(g2, basis, tau)
    assert torch.allclose(combined, separate, atol=1e-5)
    d = damping(basis.s, tau)
    core = basis.u.T @ g1 @ basis.vh.T
    filtered_core = basis.u.T @ filter_gradient(g1, basis, tau) @ basis.vh.T
    assert torch.allclose(filtered_core, d[:, None] * core * d[None, :], atol=1e-5)


def test_damping_is_zero_on_a_zero_direction_at_tau_zero():
    assert damping(torch.tensor([2.0, 0.0]), 0.0).tolist() == [1.0, 0.0]


# --- the strategy --------------------------------------------------------------------------------

MODEL = DecoderConfig(vocab_size=40, n_layer=2, d_model=16, n_head=2, seq_len=8)
TARGETED = [f"layers.{i}.{part}.weight" for i in range(2)
            for part in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")]


def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(MODEL)


def test_only_the_named_block_matrices_are_targeted():
    correction = SpectralCorrection(model().named_parameters(), SpectralConfig(enabled=True))
    assert sorted(correction.params) == sorted(TARGETED)  # no norms, embedding or head
    only_q = SpectralCorrection(model().named_parameters(), SpectralConfig(targets="q, up"))
    assert sorted(only_q.params) == ["layers.0.attn.q.weight", "layers.0.mlp.up.weight",
                                     "layers.1.attn.q.weight", "layers.1.mlp.up.weight"]


def test_the_anchor_ema_follows_the_formula_and_its_basis_reconstructs_it():
    correction = SpectralCorrection(model().named_parameters(), SpectralConfig(beta_anc=0.9))
    name = "layers.0.attn.q.weight"
    g = [randn(16, 16) for _ in range(3)]
    for t, grad in enumerate(g):
        assert correction.receive_anchor(name, grad, step=t, now=t + 2)
    expected = 0.9 * (0.9 * g[0] + 0.1 * g[1]) + 0.1 * g[2]  # the first arrival starts the EMA
    prior = correction.priors[name]
    assert torch.allclose(prior.ema, expected, atol=1e-6)
    b = prior.basis
    assert torch.allclose(b.u @ torch.diag(b.s) @ b.vh, expected, atol=1e-5)
    assert (prior.last_step, prior.arrivals) == (2, 3)


def test_stale_and_out_of_order_arrivals_are_dropped():
    correction = SpectralCorrection(model().named_parameters(), SpectralConfig(max_staleness=30))
    name = "layers.1.mlp.down.weight"
    shape = tuple(correction.params[name].shape)
    assert not correction.receive_anchor(name, randn(*shape), step=10, now=41)  # 31 steps old
    assert correction.receive_anchor(name, randn(*shape), step=20, now=50)  # exactly 30: kept
    assert not correction.receive_anchor(name, randn(*shape), step=19, now=49)  # older than the last
    assert correction.summary() == {"spectral_anchor_accepted": 1, "spectral_anchor_dropped_stale": 1,
                                    "spectral_anchor_dropped_out_of_order": 1, "spectral_corrected_steps": 0}
    with pytest.raises(KeyError, match="not a targeted matrix"):
        correction.receive_anchor("norm.weight", randn(16), step=20, now=20)
    with pytest.raises(ValueError, match="has shape"):
        correction.receive_anchor(name, randn(3, 3), step=20, now=20)


def test_an_installed_full_basis_filters_as_the_local_ema_does():
    """receive_basis with the full thin SVD of M filters as receive_anchor(M) does (the factors
    are re-orthonormalized on receipt: equal up to rounding); a top-r basis keeps the leading
    directions; a basis rounded to bf16 still never increases the norm; the staleness rules and
    the checkpoint are those of receive_anchor."""
    name = "layers.0.mlp.up.weight"  # (64, 16)
    local = SpectralCorrection(model().named_parameters(), SpectralConfig())
    sent = SpectralCorrection(model().named_parameters(), SpectralConfig())
    ema = low_rank(64, 16, 16)
    assert local.receive_anchor(name, ema, step=3, now=5)
    assert sent.receive_basis(name, AnchorBasis.of(ema), step=3, now=5)
    assert sent.priors[name].ema is None
    for _ in range(3):
        grad = randn(64, 16)
        torch.testing.assert_close(filter_gradient(grad, sent.priors[name].basis, 1e-3),
                                   filter_gradient(grad, local.priors[name].basis, 1e-3),
                                   rtol=1e-5, atol=1e-5)
    top = AnchorBasis.of(ema).top(4)
    assert (top.u.shape, top.s.shape, top.vh.shape) == ((64, 4), (4,), (4, 16))
    rounded = AnchorBasis(*(t.to(torch.bfloat16).float() for t in (top.u, top.s, top.vh)))
    assert sent.receive_basis(name, rounded, step=4, now=5)
    installed = sent.priors[name].basis
    torch.testing.assert_close(installed.u.T @ installed.u, torch.eye(4), rtol=0, atol=1e-5)
    for _ in range(5):
        grad = randn(64, 16)
        assert filter_gradient(grad, installed, 0.0).norm() <= grad.norm() * (1 + 1e-6)
    assert not sent.receive_basis(name, top, step=3, now=5)  # older than the last installed
    assert not sent.receive_basis(name, top, step=4, now=40)  # 36 steps old
    with pytest.raises(ValueError, match="anchor basis of"):
        sent.receive_basis(name, AnchorBasis.of(randn(16, 64)), step=5, now=5)
    restored = SpectralCorrection(model().named_parameters(), SpectralConfig())
    restored.load_state_dict(copy.deepcopy(sent.state_dict()))
    assert torch.equal(restored.priors[name].basis.u, installed.u)
    assert restored.summary() == sent.summary() and restored.priors[name].last_step == 4


def train(alpha: float | None, anchors: bool, steps: int = 3) -> Decoder:
    """AdamW on a fixed batch; ``alpha`` None: no correction attached."""
    net = model()
    optimizer = build_optimizer(net, OptimConfig(), lr=1e-2)
    if alpha is not None:
        correction = SpectralCorrection(net.named_parameters(), SpectralConfig(alpha=alpha, tau=1e-3))
        correction.attach(optimizer)
        if anchors:
            for name, p in correction.params.items():
                correction.receive_anchor(name, low_rank(*p.shape, 2), step=0, now=0)
    x = torch.randint(40, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        Decoder.loss(net(x), x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return net


def same_weights(a: Decoder, b: Decoder) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_alpha_one_is_the_base_optimizer_bit_for_bit():
    base = train(None, anchors=False)
    assert same_weights(train(1.0, anchors=True), base)
    assert same_weights(train(0.3, anchors=False), base)  # inert without anchors
    assert not same_weights(train(0.3, anchors=True), base)  # and live with them


def test_the_correction_rewrites_only_targeted_gradients_with_the_blend():
    net = model()
    correction = SpectralCorrection(net.named_parameters(), SpectralConfig(alpha=0.25, tau=0.1))
    name = "layers.0.mlp.gate.weight"
    param = correction.params[name]
    correction.receive_anchor(name, low_rank(*param.shape, 3), step=0, now=0)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=GEN)
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    correction.correct()
    basis = correction.priors[name].basis
    expected = 0.25 * before[name] + 0.75 * filter_gradient(before[name], basis, 0.1)
    assert torch.allclose(param.grad, expected, atol=1e-6)
    assert all(torch.equal(p.grad, before[n]) for n, p in net.named_parameters() if n != name)


def test_relative_tau_scales_with_the_largest_singular_value():
    net = model()
    name = "layers.0.attn.v.weight"
    anchor = low_rank(16, 16, 3)
    grads = []
    for scale in (1.0, 100.0):
        correction = SpectralCorrection(net.named_parameters(), SpectralConfig(alpha=0.0, tau=0.5,
                                                                              tau_mode="relative"))
        correction.receive_anchor(name, anchor * scale, step=0, now=0)
        correction.params[name].grad = torch.ones_like(anchor)
        correction.correct()
        grads.append(correction.params[name].grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-5)  # the same filter at any gradient scale
    absolute = SpectralCorrection(net.named_parameters(), SpectralConfig(alpha=0.0, tau=0.5))
    absolute.receive_anchor(name, anchor * 100.0, step=0, now=0)
    absolute.params[name].grad = torch.ones_like(anchor)
    absolute.correct()
    assert not torch.allclose(absolute.params[name].grad, grads[0], atol=1e-3)  # absolute τ does not


# --- in the mesh and the config ------------------------------------------------------------------


def test_a_mesh_run_with_the_correction_on_and_no_anchor_equals_one_without(tiny_corpus, tmp_path):
    """Inert without an anchor circuit; checkpoints carry the EMAs once something arrives."""
    base = ["mesh.stages=2", "mesh.replicas=2", "train.steps=2"]
    plain = Trainer(tiny_config(tiny_corpus, *base), tmp_path / "plain", progress=False)
    on = Trainer(tiny_config(tiny_corpus, *base, "optim.spectral.enabled=true"), tmp_path / "on",
                 progress=False)
    assert [plain.step() for _ in range(2)] == [on.step() for _ in range(2)]
    worker = on.workers[WorkerId(0, 1)]
    assert plain.workers[WorkerId(0, 1)].spectral is None and worker.spectral is not None
    name = "layers.2.attn.q.weight"
    worker.spectral.receive_anchor(name, torch.ones(32, 32), step=1, now=2)
    restored = copy.deepcopy(worker)
    restored.spectral.priors[name].ema = None
    restored.load_state_dict(worker.state_dict())
    assert torch.equal(restored.spectral.priors[name].ema, torch.ones(32, 32))


@pytest.mark.parametrize(("override", "hint"), [
    ("optim.spectral.alpha=1.5", "optim.spectral.alpha = 1.5: in [0, 1]"),
    ("optim.spectral.tau=-1", "optim.spectral.tau = -1.0: must be >= 0"),
    ("optim.spectral.tau_mode=scaled",
     "optim.spectral.tau_mode = 'scaled': allowed: ['absolute', 'relative']"),
    ("optim.spectral.beta_anc=1", "optim.spectral.beta_anc = 1.0: in [0, 1)"),
    ("optim.spectral.targets=q,lm_head", "optim.spectral.targets = 'q,lm_head': comma-separated names"),
    ("optim.spectral.targets=", "optim.spectral.targets = '': comma-separated names"),
    ("optim.spectral.max_staleness=-1", "optim.spectral.max_staleness = -1: must be >= 0"),
])
def test_bad_spectral_settings_are_refused_with_one_line(tiny_corpus, override, hint):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, override)
    assert str(err.value).startswith(hint) and "\n" not in str(err.value)
