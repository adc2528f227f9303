"""Orthogonalization primitives for Muon and NuMuon: Newton–Schulz and top-k block Krylov.

Both optimizers replace a momentum matrix ``M = U Σ Vᵀ`` by (an approximation of) a matrix with
the same singular vectors and unit singular values:

* Muon uses the full polar factor ``U Vᵀ``, approximated by five quintic Newton–Schulz steps
  (:func:`newton_schulz`, as in KellerJordan/Muon and ``torch.optim.Muon``).
* NuMuon keeps only the top-k singular directions, ``U_k V_kᵀ`` (:func:`topk_lmo`), computed by a
  randomized block Krylov method (:func:`block_krylov_topk`, Musco & Musco 2015).

Everything here is a pure function of tensors: no optimizer state, no process group. Randomness
comes only from an explicit ``torch.Generator``, so results are reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Quintic coefficients (a, b, c) of the reference Muon; tuned to maximise the slope at zero."""


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Approximate the polar factor ``U Vᵀ`` of a 2-D matrix by quintic Newton–Schulz.

    The iteration is ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``, after scaling ``X`` by its
    Frobenius norm (an upper bound on the spectral norm, so every singular value starts in
    ``[0, 1]``). With the default coefficients the output is *not* exactly orthogonal: its singular
    values land roughly in ``[0.5, 1.5]`` (the reference found this does not hurt training and it
    needs far fewer steps than a convergent iteration). Singular values below about ``1/490`` of
    the Frobenius norm (``a⁵ ≈ 490``) are not lifted — e.g. the smallest ones of a square Gaussian
    matrix — so use more ``steps`` if you need an accurate polar factor of an ill-conditioned
    matrix.

    The op sequence (transpose wide-first, ``clamp``-ed norm, ``addmm``) mirrors
    ``torch.optim.Muon`` so that in bf16 both give bit-identical results.

    Args:
        G: matrix of shape ``(m, n)``.
        steps: iterations; 5 is the reference. More steps do not converge to exactly 1 with the
            default coefficients, they just oscillate inside the band.
        coefficients: ``(a, b, c)`` of the quintic.
        eps: floor on the Frobenius norm, so a zero matrix maps to zero instead of NaN.
        dtype: compute dtype; ``None`` keeps ``G.dtype``. ``torch.bfloat16`` is the reference's
            choice on GPUs (about 2× faster, singular values still inside the band); use fp32 on
            CPU, where bf16 matmuls are slow and the extra rounding buys nothing.

    Returns:
        A matrix of shape ``(m, n)`` in the compute dtype.
    """
    if G.ndim != 2:
        raise ValueError(f"newton_schulz: G must be 2-D, got shape {tuple(G.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz: coefficients must be (a, b, c), got {coefficients!r}")
    a, b, c = coefficients
    X = G.to(dtype) if dtype is not None else G
    transposed = G.size(0) > G.size(1)
    if transposed:  # iterate on the short side: A = XXᵀ is then the smaller Gram matrix
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # bA + cA²
        X = torch.addmm(X, B, X, beta=a)  # aX + BX
    return X.T if transposed else X


def _orth(X: Tensor) -> Tensor:
    """Orthonormal basis of the column space of ``X`` (Householder QR: orthonormal even when
    ``X`` is rank deficient)."""
    return torch.linalg.qr(X, mode="reduced").Q


def _krylov_dtype(dtype: torch.dtype) -> torch.dtype:
    # QR and SVD are not implemented (or not accurate) in half precision: work in fp32 at least.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def block_krylov_topk(
    M: Tensor,
    k: int,
    oversample: int = 8,
    iters: int = 2,
    warm_start: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k singular triplets of ``M`` by randomized block Krylov iteration (Musco & Musco 2015).

    Starting from a block ``Ω₀ ∈ R^{n×b}`` (``b = k + oversample``), iterate
    ``Ωᵢ = orth(Mᵀ M Ωᵢ₋₁)`` for ``i = 1..iters``, take ``Q = orth([Ω₁ | … | Ω_iters])`` and the
    thin SVD ``M Q = Ũ Σ̂ Ŵᵀ``; then ``U_k = Ũ[:, :k]`` and ``V_k = Q Ŵ[:, :k]``.

    Tuning: the error in the k-th direction shrinks with the gap ``σ_{k+1}/σ_k`` raised to a power
    that grows with ``iters``; more ``oversample`` columns help when that gap is small. Cost is
    about ``2·iters·m·n·b`` flops plus QR/SVD of ``n × iters·b`` blocks, so NuMuon is cheaper than
    Newton–Schulz only for small ``k``. Warm-starting from the previous step's ``V_k`` (momentum
    changes slowly) usually makes one or two iterations enough.

    Args:
        M: matrix of shape ``(m, n)``; computed in fp32 if it is half precision.
        k: number of singular directions, ``1 ≤ k ≤ min(m, n)``.
        oversample: extra block columns ``p``; the block width is ``min(k + p, n)``.
        iters: Krylov iterations ``q`` (≥ 1).
        warm_start: optional ``(n, j)`` matrix, typically the previous ``V_k``; its first
            ``min(j, b)`` columns seed the block, and the rest of the block is random.
        generator: source of the random columns. They are drawn on the CPU and moved to
            ``M.device``, so a given generator state yields the same start on every device.

    Returns:
        ``(U_k, S_k, V_k)`` with shapes ``(m, k)``, ``(k,)``, ``(n, k)``; ``S_k`` is descending.
    """
    if M.ndim != 2:
        raise ValueError(f"block_krylov_topk: M must be 2-D, got shape {tuple(M.shape)}")
    m, n = M.shape
    if not 1 <= k <= min(m, n):
        raise ValueError(f"block_krylov_topk: k must be in [1, min(m, n)={min(m, n)}], got {k}")
    if iters < 1:
        raise ValueError(f"block_krylov_topk: iters must be >= 1, got {iters}")
    if oversample < 0:
        raise ValueError(f"block_krylov_topk: oversample must be >= 0, got {oversample}")
    work = _krylov_dtype(M.dtype)
    A = M.to(work)
    b = min(k + oversample, n)

    seeded = 0
    blocks: list[Tensor] = []
    if warm_start is not None:
        if warm_start.ndim != 2 or warm_start.size(0) != n:
            raise ValueError(
                f"block_krylov_topk: warm_start must have shape (n={n}, j), "
                f"got {tuple(warm_start.shape)}"
            )
        seeded = min(warm_start.size(1), b)
        blocks.append(warm_start[:, :seeded].to(device=A.device, dtype=work))
    if seeded < b:
        rand = torch.randn(n, b - seeded, generator=generator, dtype=work)
        blocks.append(rand.to(A.device))
    omega = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]

    krylov: list[Tensor] = []
    for _ in range(iters):
        omega = _orth(A.T @ (A @ omega))
        krylov.append(omega)
    Q = _orth(torch.cat(krylov, dim=1)) if iters > 1 else omega
    U_small, S, Wh = torch.linalg.svd(A @ Q, full_matrices=False)
    return U_small[:, :k], S[:k], Q @ Wh[:k].T


def topk_lmo(
    M: Tensor,
    k: int,
    oversample: int = 8,
    iters: int = 2,
    warm_start: Tensor | None = None,
    generator: torch.Generator | None = None,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
) -> Tensor:
    """NuMuon's direction: ``U_k V_kᵀ``, the top-k singular directions of ``M`` with unit singular
    values — the linear minimization oracle over ``{‖Δ‖₂ ≤ 1, ‖Δ‖_* ≤ k}`` (up to sign).

    At full rank (``k == min(m, n)``) this *is* Muon: it returns :func:`newton_schulz` of ``M``
    (``ns_*`` arguments), so NuMuon at rank fraction 1 reproduces Muon step for step. Below full
    rank it uses :func:`block_krylov_topk` (the other arguments). See
    :func:`topk_lmo_with_basis` to also get ``V_k`` for warm starts.

    Returns:
        A matrix shaped like ``M`` (fp32 for half-precision input on the Krylov path).
    """
    return topk_lmo_with_basis(
        M, k, oversample, iters, warm_start, generator, ns_steps, ns_coefficients, eps, ns_dtype
    )[0]


def topk_lmo_with_basis(
    M: Tensor,
    k: int,
    oversample: int = 8,
    iters: int = 2,
    warm_start: Tensor | None = None,
    generator: torch.Generator | None = None,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`topk_lmo` that also returns ``V_k`` (``(n, k)``) to warm-start the next call, or
    ``None`` on the full-rank Newton–Schulz path (which needs no warm start)."""
    if M.ndim != 2:
        raise ValueError(f"topk_lmo: M must be 2-D, got shape {tuple(M.shape)}")
    full = min(M.shape)
    if not 1 <= k <= full:
        raise ValueError(f"topk_lmo: k must be in [1, min(m, n)={full}], got {k}")
    if k == full:
        return newton_schulz(M, ns_steps, ns_coefficients, eps, ns_dtype), None
    U, _, V = block_krylov_topk(M, k, oversample, iters, warm_start, generator)
    return U @ V.T, V
