"""The protocol model at init computes what the plain decoder computes, as a whole and as stages."""

import pytest
import torch

from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import split_model
from meshlearn.protocol import ProtocolDecoder, protocol_model
from meshlearn.protocol.transforms import haar_orthogonal, low_condition, seeded_generator

CFG = DecoderConfig(vocab_size=64, n_layer=4, d_model=32, n_head=4, seq_len=16)


def plain_model(cfg: DecoderConfig = CFG) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():  # gains away from 1, so folding them is really tested
        for p in model.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    return model


def run(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("extra", [{}, {"n_kv_head": 2, "qk_norm": True, "logit_softcap": 30.0}])
def test_same_function_as_the_plain_decoder_at_init(extra):
    cfg = DecoderConfig(**{**CFG.__dict__, **extra})
    plain = plain_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    ref = plain(x)
    whole = protocol_model(plain, seed=7)
    stages = [protocol_model(s, seed=7) for s in split_model(plain, 2)]
    for out in (whole(x), run(stages, x)):
        assert (out - ref).abs().max() / ref.abs().max() < 1e-5
    # A stage is the whole protocol model with parts removed: same names, same tensors.
    full = whole.state_dict()
    for stage in stages:
        for name, value in stage.state_dict().items():
            assert torch.equal(value, full[name]), name


def test_gains_are_folded_and_the_norm_reads_a_random_basis():
    model = protocol_model(plain_model(), seed=7)
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("norm.weight") for n in names)  # no separate gains left
    r = model.layers["0"].attn_norm.basis
    assert not torch.allclose(r, torch.eye(32))
    assert torch.allclose(r.T @ r, torch.eye(32), atol=1e-6)
    assert torch.equal(model.layers["0"].attn_skip, torch.eye(32))  # every residual basis is I
    assert isinstance(model, ProtocolDecoder)


def test_transform_quality():
    g = seeded_generator(1, "test")
    q = haar_orthogonal(48, g)
    assert (q.matrix.T @ q.matrix - torch.eye(48, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(q.inverse, q.matrix.T)
    for eps in (0.01, 0.1, 0.5):
        t = low_condition(48, eps, g)
        assert t.condition() <= torch.tensor(2 * eps).exp() * (1 + 1e-9)
        assert (t.matrix @ t.inverse - torch.eye(48, dtype=torch.float64)).abs().max() < 1e-12
        assert abs(torch.linalg.det(t.matrix).abs().item() - 1) < 1e-9


def test_haar_sign_fix_gives_an_unbiased_diagonal():
    """Without the sign fix QR makes diag(R) > 0, which biases Q's diagonal; Haar Q has mean 0."""
    g = seeded_generator(2, "test")
    diag = torch.stack([haar_orthogonal(4, g).matrix.diagonal() for _ in range(4000)])
    assert diag.mean().abs() < 0.03
    q_raw, _ = torch.linalg.qr(torch.randn(4000, 4, 4, generator=g, dtype=torch.float64))
    assert q_raw.diagonal(dim1=-2, dim2=-1).mean().abs() > 0.1  # the bias the fix removes
