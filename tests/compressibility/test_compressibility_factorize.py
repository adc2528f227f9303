"""The math of compression on single matrices: stable rank, truncated SVD, ASVD, SVD-LLM."""

from __future__ import annotations

import pytest
import torch

from meshlearn.compressibility import (
    asvd,
    collect_input_stats,
    rank_for_keep,
    stable_rank,
    svd_llm,
    truncated_svd,
)
from meshlearn.models import DecoderConfig, init_model

TINY = DecoderConfig(vocab_size=64, n_layer=2, d_model=32, n_head=2, seq_len=16)


def gaussian(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_stable_rank_of_known_matrices():
    assert stable_rank(torch.eye(7)) == pytest.approx(7.0)
    u, v = gaussian(9, 1, 0), gaussian(5, 1, 1)
    assert stable_rank(u @ v.T) == pytest.approx(1.0)
    assert stable_rank(torch.diag(torch.tensor([3.0, 4.0]))) == pytest.approx(25 / 16)
    assert stable_rank(torch.zeros(3, 3)) == 0.0


def test_rank_for_keep_is_the_floor_of_the_parameter_budget():
    assert rank_for_keep(0.75, 32, 32) == 12  # 0.75 · 1024/64 = 12 exactly, despite float noise
    assert rank_for_keep(0.5, 96, 32) == 12  # 0.5 · 3072/128
    assert rank_for_keep(0.3, 96, 32) == 7  # ⌊7.2⌋
    assert rank_for_keep(0.01, 32, 32) == 1  # never rank 0
    with pytest.raises(ValueError, match="keep"):
        rank_for_keep(1.5, 32, 32)


def test_truncated_svd_error_is_the_tail_and_costs_r_times_m_plus_n():
    w = gaussian(20, 12, 2)
    factors = truncated_svd(w, 5)
    sigma = torch.linalg.svdvals(w)
    assert factors.params == 5 * (20 + 12)
    assert (w - factors.dense()).norm().item() == pytest.approx(sigma[5:].square().sum().sqrt().item())


def test_asvd_with_alpha_zero_is_plain_svd():
    w = gaussian(16, 24, 3)
    abs_mean = gaussian(24, 1, 4).abs().squeeze(1) + 0.1
    plain, scaled = truncated_svd(w, 6), asvd(w, abs_mean, 6, alpha=0.0)
    torch.testing.assert_close(scaled.a, plain.a)
    torch.testing.assert_close(scaled.b, plain.b)
    assert not torch.allclose(asvd(w, abs_mean, 6, alpha=0.5).dense(), plain.dense())


def test_svdllm_output_error_is_the_truncated_tail_on_the_calibration_data():
    """The method note's identity ‖(W − W′)X‖_F² = Σ_{i>r} σ_i(W L)², on a real layer's inputs."""
    model = init_model(TINY, 0)
    layer = model.layers["1"].mlp.down  # (32, 96): the widest input
    ids = torch.randint(0, TINY.vocab_size, (16, TINY.seq_len), generator=torch.Generator().manual_seed(5))
    stats = collect_input_stats(model, {"down": layer}, ids)["down"]
    captured = []
    handle = layer.register_forward_hook(lambda _m, args, _o: captured.append(args[0].reshape(-1, 96)))
    with torch.no_grad():
        model(ids)
    handle.remove()
    x = torch.cat(captured).double().T  # (n, N) = (96, 256)
    assert stats.count == x.shape[1]
    w, r = layer.weight.detach().double(), 10
    factors = svd_llm(w, stats.gram, r, ridge=0.0)
    error = ((w - factors.dense()) @ x).square().sum().item()
    sigma = torch.linalg.svdvals(w @ torch.linalg.cholesky(x @ x.T))
    assert error == pytest.approx(sigma[r:].square().sum().item(), rel=1e-8)
    plain_error = ((w - truncated_svd(w, r).dense()) @ x).square().sum().item()
    assert error < plain_error  # whitening minimizes exactly this error among rank-r matrices


def test_svdllm_rejects_a_singular_gram_without_ridge():
    x = gaussian(6, 3, 6)  # 3 tokens for 6 channels: X Xᵀ has rank 3
    with pytest.raises(ValueError, match="ridge"):
        svd_llm(gaussian(4, 6, 7), x @ x.T, 2, ridge=0.0)
    assert svd_llm(gaussian(4, 6, 7), x @ x.T, 2, ridge=1e-6).rank == 2
