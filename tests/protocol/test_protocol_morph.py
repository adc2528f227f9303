"""Morphs: the function is kept (1, 10, 1000 morphs, fp64 master), the weights are not, stages
from different epochs do not stitch, and Muon follows orthogonal morphs exactly."""

import copy
import math

import pytest
import torch

from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import split_model
from meshlearn.optim.muon import Muon
from meshlearn.protocol import protocol_model
from meshlearn.protocol.morph import StageMorph, morph_mesh
from meshlearn.protocol.transforms import haar_orthogonal, low_condition, seeded_generator

CFG = DecoderConfig(vocab_size=256, n_layer=4, d_model=32, n_head=4, seq_len=32)


@pytest.fixture(scope="module")
def trained(tiny_corpus) -> tuple[Decoder, torch.Tensor]:
    """A plain decoder trained briefly on the tiny corpus (bytes), and held-out batches."""
    data = torch.tensor(list(tiny_corpus.read_bytes()[:60000]), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)

    def batch(n):
        starts = torch.randint(0, len(data) - CFG.seq_len - 1, (n,), generator=gen)
        return torch.stack([data[s:s + CFG.seq_len + 1] for s in starts.tolist()])

    torch.manual_seed(0)
    model = Decoder(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        b = batch(16)
        Decoder.loss(model(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), batch(32)


def stages_of(model: Decoder, stages: int, replicas: int = 1) -> dict[WorkerId, torch.nn.Module]:
    parts = [protocol_model(s, seed=3) for s in split_model(model, stages)]
    return {WorkerId(r, s): copy.deepcopy(parts[s]) for r in range(replicas) for s in range(stages)}


def run(modules, x, replica=0):
    h = x
    for s in range(len(modules) // max(1, len({w.replica for w in modules}))):
        h = modules[WorkerId(replica, s)](h)
    return h


def loss_of(modules, batch) -> float:
    with torch.no_grad():
        return Decoder.loss(run(modules, batch[:, :-1]), batch[:, 1:]).item()


def morph_n(modules, mesh, n, start=0, kind="orthogonal", dtype=torch.float64, morphs=None):
    morphs = morphs or {w: StageMorph(m, None, dtype) for w, m in modules.items()}
    for epoch in range(start, start + n):
        morph_mesh(morphs, mesh, kind, 0.01, seed=11, epoch=epoch)
    return morphs


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["orthogonal", "lowcond"])
def test_function_kept_weights_changed_after_1_10_1000_morphs(trained, kind):
    model, batch = trained
    x = batch[:4, :-1]
    modules, mesh = stages_of(model, 2), MeshShape(1, 2)
    with torch.no_grad():
        ref, boundary0 = model(x), modules[WorkerId(0, 0)](x)
    before = {n: t.clone() for n, t in modules[WorkerId(0, 1)].state_dict().items()}
    morphs, done = None, 0
    for n in (1, 10, 1000):
        morphs = morph_n(modules, mesh, n - done, done, kind, morphs=morphs)
        done = n
        with torch.no_grad():
            assert rel(run(modules, x), ref) <= 1e-5, (kind, n)
            assert rel(modules[WorkerId(0, 0)](x), boundary0) > 0.5  # the boundary traffic changed
    after = modules[WorkerId(0, 1)].state_dict()
    for name in ("layers.2.attn_norm.basis", "layers.2.attn_skip", "layers.3.mlp.down.weight",
                 "layers.2.attn.o.weight", "norm.basis"):
        assert rel(after[name], before[name]) > 0.5, name
    for name in ("layers.2.attn.q.weight", "layers.3.mlp.gate.weight", "head.weight"):
        assert torch.equal(after[name], before[name]), name  # entry matrices keep their basis


def test_without_the_master_copy_folds_drift(trained):
    """The drift control: the same 1000 morphs folded directly in fp32 (no fp64 master)."""
    model, batch = trained
    x = batch[:4, :-1]
    with torch.no_grad():
        ref = model(x)
    errors = {}
    for dtype in (torch.float64, torch.float32):
        modules = stages_of(model, 2)
        morph_n(modules, MeshShape(1, 2), 1000, dtype=dtype)
        with torch.no_grad():
            errors[dtype] = rel(run(modules, x), ref)
    print(f"logit drift after 1000 morphs: fp64 master {errors[torch.float64]:.2e}, "
          f"fp32 direct {errors[torch.float32]:.2e}")
    assert errors[torch.float32] > 3 * errors[torch.float64]


def test_replicas_of_a_stage_morph_together(trained):
    model, _ = trained
    modules = stages_of(model, 2, replicas=2)
    morph_n(modules, MeshShape(2, 2), 3)
    for s in range(2):
        a, b = modules[WorkerId(0, s)].state_dict(), modules[WorkerId(1, s)].state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_stages_from_different_epochs_do_not_stitch(trained):
    model, batch = trained
    modules, mesh = stages_of(model, 2), MeshShape(1, 2)
    snapshots = []
    morphs = None
    for epoch in range(3):
        snapshots.append({w: copy.deepcopy(m) for w, m in modules.items()})
        morphs = morph_n(modules, mesh, 1, epoch, morphs=morphs)
    real = loss_of(snapshots[2], batch)
    stitched = loss_of({WorkerId(0, 0): snapshots[0][WorkerId(0, 0)],
                        WorkerId(0, 1): snapshots[2][WorkerId(0, 1)]}, batch)
    torch.manual_seed(1)
    random_init = loss_of(stages_of(Decoder(CFG), 2), batch)
    print(f"real {real:.3f}  stitched {stitched:.3f}  random init {random_init:.3f} nats/token")
    assert real < random_init - 1.0
    assert stitched >= random_init - 0.05


def muon_step(weight, grad, momentum):
    p = torch.nn.Parameter(weight.clone())
    opt = Muon([("layers.0.attn.o.weight", p)], lr=0.05, weight_decay=0.1, ns_dtype=torch.float64)
    opt.state[p]["momentum_buffer"] = momentum.clone()
    p.grad = grad.clone()
    opt.step()
    return p.detach()


def test_muon_equivariance_and_its_negative_controls():
    """One Muon step on the morphed matrix (Tᵀ·W, gradient T⁻¹·G, momentum T⁻¹·M), mapped back,
    is the step on the original (orthogonal T, fp64); not for low-condition T, not for AdamW."""
    g = seeded_generator(5, "muon")
    w, grad, mom = (torch.randn(24, 40, generator=g, dtype=torch.float64) for _ in range(3))
    plain = muon_step(w, grad, mom)
    t = haar_orthogonal(24, g)
    morphed = muon_step(t.matrix.T @ w, t.inverse @ grad, t.inverse @ mom)
    assert (t.inverse.T @ morphed - plain).abs().max() < 1e-8
    lc = low_condition(24, 0.5, g)
    morphed = muon_step(lc.matrix.T @ w, lc.inverse @ grad, lc.inverse @ mom)
    assert (lc.inverse.T @ morphed - plain).abs().max() > 1e-4
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(t.matrix.T @ w)
    for param, gr in ((p, grad), (q, t.inverse @ grad)):
        opt = torch.optim.AdamW([param], lr=0.05)
        param.grad = gr.clone()
        opt.step()
    assert (t.matrix @ q.detach() - p.detach()).abs().max() > 1e-4  # Adam is not equivariant


def test_gradient_transform():
    """If W ↦ W·T (the note's convention), the gradient maps as G ↦ G·T^{−T}."""
    g = seeded_generator(6, "grad")
    x, w = torch.randn(10, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g,
                                                                                 dtype=torch.float64)
    t = low_condition(8, 0.3, g)

    def f(weight):
        return torch.sin(x @ weight).sum()

    w0 = w.clone().requires_grad_(True)
    f(w0).backward()
    w1 = (w @ t.matrix).requires_grad_(True)
    f(w1 @ t.inverse).backward()
    assert torch.allclose(w1.grad, w0.grad @ t.inverse.T, atol=1e-12)
    assert math.isfinite(t.condition())
