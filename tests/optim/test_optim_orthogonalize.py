"""Newton–Schulz and block Krylov top-k: spectra, equivariance, subspace accuracy, warm start."""

from __future__ import annotations

import pytest
import torch

from meshlearn.optim.orthogonalize import (
    NS_COEFFICIENTS,
    block_krylov_topk,
    newton_schulz,
    topk_lmo,
    topk_lmo_with_basis,
)


def gaussian(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ns_scalar(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The scalar map NS applies to each normalized singular value: x ← ax + bx³ + cx⁵."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def gapped(m: int, n: int, k: int, gap: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """M = U diag(s) Vᵀ with top-k singular values in [5, 10] and the rest ≤ 5/gap. Returns the
    fp32 matrix, the true top-k U and V (fp64) and the full V (fp64)."""
    g = torch.Generator().manual_seed(seed)
    d = min(m, n)
    U = torch.linalg.qr(torch.randn(m, d, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64)).Q
    s = torch.cat(
        [
            torch.linspace(10, 5, k, dtype=torch.float64),
            torch.linspace(5 / gap, 0.01, d - k, dtype=torch.float64),
        ]
    )
    return (U * s @ V.T).float(), U[:, :k], V[:, :k], V


def sin_max_angle(A: torch.Tensor, B: torch.Tensor) -> float:
    """sin of the largest principal angle between span(A) and span(B) (accurate when small,
    unlike acos of cosines in fp32)."""
    qa = torch.linalg.qr(A.double()).Q
    qb = torch.linalg.qr(B.double()).Q
    return torch.linalg.matrix_norm(qb - qa @ (qa.T @ qb), ord=2).item()


# --------------------------------------------------------------------------- Newton–Schulz

# The band: NS maps each singular value σ/‖G‖_F through ns_scalar (5 steps of the quintic). On a
# fine grid, ns_scalar([0.01, 1]) = [0.6818, 1.1344] and ns_scalar([0.002, 1]) = [0.6818, 1.2024].
# Rectangular Gaussians have σ_min/‖G‖_F ≥ 0.05 here, so their outputs must sit in the first band
# — a tighter claim than the reference's loose "[0.5, 1.5]".
RECT_BAND = (0.67, 1.14)
WIDE_BAND = (0.67, 1.21)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ns_singular_values_in_band_on_rectangular_gaussians(shape, dtype):
    for seed in range(3):
        out = newton_schulz(gaussian(*shape, seed=seed), dtype=dtype)
        assert out.dtype == dtype and out.shape == shape
        s = torch.linalg.svdvals(out.float())
        assert RECT_BAND[0] < s.min() and s.max() < RECT_BAND[1], (shape, dtype, s.min(), s.max())


def test_ns_square_gaussian_band_holds_only_above_the_gain_limit():
    # Pitfall: a square Gaussian has σ_min/‖G‖_F ≈ n^-1.5; five steps (gain ≈ a⁵ ≈ 490) cannot
    # lift it, so only singular values above ~1/490 of the norm reach the band.
    G = gaussian(128, 128)
    s_in = torch.linalg.svdvals(G.double())
    x = s_in / s_in.norm()
    s_out = torch.linalg.svdvals(newton_schulz(G).double())  # descending
    order = ns_scalar(x).argsort(descending=True)
    lifted = x[order] >= 0.002
    assert WIDE_BAND[0] < s_out[lifted].min() and s_out.max() < WIDE_BAND[1]
    assert s_out.min() < 0.5  # the tiny one is not lifted (seed 0: 0.04)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (128, 128)])
def test_ns_acts_on_singular_values_by_the_quintic(shape):
    G = gaussian(*shape, seed=1)
    s_in = torch.linalg.svdvals(G.double())
    expected = ns_scalar(s_in / s_in.norm()).sort(descending=True).values
    got = torch.linalg.svdvals(newton_schulz(G).double())
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_ns_is_close_to_the_polar_factor():
    G = gaussian(64, 32)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    out = newton_schulz(G)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), polar.flatten(), dim=0)
    assert cos > 0.98  # measured 0.986
    # Same singular vectors: Uᵀ·NS(G)·V is diagonal.
    core = U.T @ out @ Vh.T
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-5


def test_ns_is_orthogonally_equivariant_in_fp64():
    G = gaussian(48, 32, dtype=torch.float64)
    Q1 = torch.linalg.qr(gaussian(48, 48, seed=1, dtype=torch.float64)).Q
    Q2 = torch.linalg.qr(gaussian(32, 32, seed=2, dtype=torch.float64)).Q
    torch.testing.assert_close(
        newton_schulz(Q1 @ G @ Q2), Q1 @ newton_schulz(G) @ Q2, atol=1e-6, rtol=0
    )


def test_ns_zero_matrix_and_bad_input():
    assert torch.equal(newton_schulz(torch.zeros(8, 4)), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.zeros(3, 4), coefficients=(1.0, 2.0))  # type: ignore[arg-type]


def test_ns_does_not_modify_its_input():
    G = gaussian(16, 8)
    before = G.clone()
    newton_schulz(G)
    newton_schulz(G, dtype=torch.bfloat16)
    assert torch.equal(G, before)


# --------------------------------------------------------------------------- block Krylov top-k


@pytest.mark.parametrize("m,n,k", [(96, 64, 8), (64, 96, 8), (128, 128, 16)])
def test_krylov_matches_exact_topk_subspace_with_a_gap(m, n, k):
    M, U_true, V_true, _ = gapped(m, n, k, gap=10.0)
    g = torch.Generator().manual_seed(1)
    U, S, V = block_krylov_topk(M, k, generator=g)
    assert U.shape == (m, k) and S.shape == (k,) and V.shape == (n, k)
    # Measured: sin θ ≤ 2e-6 (U), ≤ 3.1e-5 (V).
    assert sin_max_angle(U, U_true) <= 1e-3
    assert sin_max_angle(V, V_true) <= 1e-3
    torch.testing.assert_close(
        S.double(), torch.linspace(10, 5, k, dtype=torch.float64), atol=1e-4, rtol=0
    )
    # Orthonormal factors and consistent triplets: M V = U diag(S).
    torch.testing.assert_close(V.T @ V, torch.eye(k), atol=1e-5, rtol=0)
    torch.testing.assert_close(M @ V, U * S, atol=1e-4, rtol=0)


def test_krylov_warm_start_from_true_v_converges_in_one_iteration():
    # A gap of only 5 %: one cold iteration is far off (sin θ ≈ 0.7), but starting from the true
    # V the first block already spans it.
    M, U_true, V_true, _ = gapped(96, 64, 8, gap=1.05)
    g = torch.Generator().manual_seed(1)
    U_cold, _, V_cold = block_krylov_topk(M, 8, iters=1, generator=g)
    assert sin_max_angle(V_cold, V_true) > 0.1
    U, _, V = block_krylov_topk(M, 8, iters=1, warm_start=V_true.float(), generator=g)
    assert sin_max_angle(U, U_true) <= 1e-5  # measured 2.9e-6
    assert sin_max_angle(V, V_true) <= 1e-5


def test_krylov_warm_start_with_fewer_columns_is_padded():
    M, _, V_true, _ = gapped(64, 48, 8, gap=10.0)
    _, _, V = block_krylov_topk(M, 8, warm_start=V_true[:, :3].float())
    assert sin_max_angle(V, V_true) <= 1e-3


def test_krylov_is_deterministic_given_the_generator():
    M = gaussian(40, 30)
    a = block_krylov_topk(M, 5, generator=torch.Generator().manual_seed(7))
    b = block_krylov_topk(M, 5, generator=torch.Generator().manual_seed(7))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_krylov_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        block_krylov_topk(torch.zeros(6, 4), 5)
    with pytest.raises(ValueError, match="k must be"):
        topk_lmo(torch.zeros(6, 4), 0)


# --------------------------------------------------------------------------- top-k LMO


def test_topk_lmo_has_exactly_k_unit_singular_values():
    M = gaussian(48, 32)
    out = topk_lmo(M, 5, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(out.double())
    torch.testing.assert_close(s[:5], torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0)
    assert s[5:].max() < 1e-5


def test_topk_lmo_falls_back_to_newton_schulz_exactly_at_full_rank():
    M = gaussian(48, 32)
    out, basis = topk_lmo_with_basis(M, 32)
    assert basis is None
    assert torch.equal(out, newton_schulz(M))
    assert torch.equal(topk_lmo(M.T, 32), newton_schulz(M.T))


def test_krylov_at_full_rank_is_the_exact_polar_factor():
    # The Krylov path itself (called directly, bypassing the fall-back) gives U Vᵀ exactly; NS is
    # only close to it.
    M = gaussian(48, 32)
    U, _, V = block_krylov_topk(M, 32)
    Ue, _, Vhe = torch.linalg.svd(M, full_matrices=False)
    torch.testing.assert_close(U @ V.T, Ue @ Vhe, atol=2e-5, rtol=0)


def test_krylov_on_a_matrix_smaller_than_the_block_is_exact():
    # b = min(k + p, n) = 6 and iters·b = 12 > n: the Krylov basis spans R^n, so the SVD is exact.
    M = gaussian(8, 6, dtype=torch.float64)
    U, S, V = block_krylov_topk(M, 3, generator=torch.Generator().manual_seed(0))
    Ue, Se, Vhe = torch.linalg.svd(M, full_matrices=False)
    torch.testing.assert_close(S, Se[:3])
    torch.testing.assert_close(U @ V.T, Ue[:, :3] @ Vhe[:3])
