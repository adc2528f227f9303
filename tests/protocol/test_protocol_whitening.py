"""The whitening morph (the defence against passive covariance alignment): it keeps the model's
function like any invertible morph, and leaves the covariance attack nothing to match, while the
same attack recovers an orthogonal morph from the same kind of traffic."""

import copy

import torch

from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import split_model
from meshlearn.protocol import protocol_model
from meshlearn.protocol.attacks import covariance_alignment, relative_error
from meshlearn.protocol.morph import StageMorph, morph_mesh
from meshlearn.protocol.snapshots import boundary_traffic
from meshlearn.protocol.transforms import haar_orthogonal, seeded_generator, whitening

D = 12


def traffic(n: int, seed: int) -> torch.Tensor:
    """Skewed, anisotropic samples (distinct variances 9 … 0.25): what the attack needs."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.empty(n, D, dtype=torch.float64).exponential_(generator=gen) - 1.0
    mix = haar_orthogonal(D, seeded_generator("mix")).matrix
    return (z * torch.linspace(3.0, 0.5, D, dtype=torch.float64)) @ mix


def test_covariance_alignment_recovers_orthogonal_but_not_whitening_morphs():
    probe, passive_a, passive_b = traffic(4000, 0), traffic(50000, 1), traffic(50000, 2)
    t_orth = haar_orthogonal(D, seeded_generator("T")).matrix
    found = covariance_alignment(passive_a, passive_b @ t_orth)
    assert relative_error(probe, probe @ t_orth, found) < 0.15  # the attack works: measured 0.046
    # Whitening: the sender whitens with its own traffic in both epochs (then rotates), so each
    # epoch's traffic has covariance ≈ I and the basis change is T̂ = W_a⁻¹·W_b.
    w_a = whitening(torch.cov(passive_a.T), seeded_generator("a"), shrinkage=0.0)
    w_b = whitening(torch.cov(passive_a.T), seeded_generator("b"), shrinkage=0.0)
    t_hat = w_a.inverse @ w_b.matrix
    y_a, y_b = passive_a @ w_a.matrix, passive_b @ w_a.matrix @ t_hat
    assert torch.allclose(torch.cov(y_a.T), torch.eye(D, dtype=torch.float64), atol=1e-9)
    found = covariance_alignment(y_a, y_b)
    # measured 1.39, about √2: as far off as a random rotation
    assert relative_error(probe @ w_a.matrix, probe @ w_a.matrix @ t_hat, found) > 0.5


def test_whitening_morphs_keep_the_function():
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, n_layer=4, d_model=16, n_head=2, seq_len=12)
    plain = Decoder(cfg).eval()
    stages = [protocol_model(s, seed=1) for s in split_model(plain, 2)]
    before = [copy.deepcopy(s) for s in stages]
    x = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(3))
    morphs = {WorkerId(0, s): StageMorph(m, None) for s, m in enumerate(stages)}
    for epoch in range(3):
        cov = torch.cov(boundary_traffic(stages, x)[0].double().T)
        morph_mesh(morphs, MeshShape(1, 2), "orthogonal", 0.0, seed=2, epoch=epoch,
                   boundaries={0: whitening(cov, seeded_generator("w", epoch))})
    with torch.no_grad():
        ref = plain(x)
        out = stages[1](stages[0](x))
        h = boundary_traffic(stages, x)[0].double()
        h0 = boundary_traffic(before, x)[0].double()
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    eye = torch.eye(cfg.d_model, dtype=torch.float64)
    # the boundary traffic is white (shrinkage 0.1 leaves some of the spectrum), the plain one not
    assert (torch.cov(h.T) - eye).abs().max() < 0.5 < (torch.cov(h0.T) - eye).abs().max()
