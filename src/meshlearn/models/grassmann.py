"""Optional updates of the subspace basis U by a Riemannian step on the Grassmannian.

Our own reading where the paper is unspecific (see docs/subspace.md): every N steps, at a drain point
of the synchronous pipeline, U moves towards the dominant directions of the gradients that arrive at
the pipeline boundaries, i.e. it ascends tr(UᵀSU) with S = E[g gᵀ] over boundary gradient vectors:

    ξ = −2 (I − UUᵀ) S U          (Riemannian gradient of −tr(UᵀSU))
    U ← qf(U − η ξ)               (QR retraction, column signs fixed)

S is normalised by its trace so that η is scale-free. Every weight stored as coefficients in the old
basis is then re-expressed in the new one: W = U_old·Z ≈ U_new·(M·Z) with M = U_newᵀ U_old. The remap
is exact for the part of span(U_old) that span(U_new) still contains and drops the rest, so an update
changes the model slightly; first moments of the optimizer state are remapped the same way, second
moments (elementwise) are kept as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshlearn.models.subspace import SubspaceEmbedding, SubspaceLinear, fixed_basis_signs

FIRST_MOMENTS = ("exp_avg", "momentum_buffer")


def grassmann_step(basis: torch.Tensor, second_moment: torch.Tensor, lr: float) -> torch.Tensor:
    """One retraction step ascending tr(UᵀSU); returns a new orthonormal basis."""
    s = second_moment / second_moment.trace().clamp_min(1e-30)
    projector = torch.eye(basis.shape[0]) - basis @ basis.t()
    xi = -2.0 * projector @ s @ basis
    q, r = torch.linalg.qr(basis - lr * xi)
    return fixed_basis_signs(q, r)


Remap = Callable[[torch.Tensor], torch.Tensor]


def remap_module(module: nn.Module, new_basis: torch.Tensor) -> dict[nn.Parameter, Remap]:
    """Re-express every subspace parameter of ``module`` in ``new_basis``, in place.

    Returns, per parameter, the linear map applied to it, so the caller can remap optimizer state
    with the same map.
    """
    maps: dict[nn.Parameter, Remap] = {}
    for sub in module.modules():
        if not isinstance(sub, (SubspaceLinear, SubspaceEmbedding)):
            continue
        m = new_basis.t() @ sub.basis  # (k, k)
        if isinstance(sub, SubspaceLinear):
            param, remap = sub.z, (lambda t, m=m: m @ t)  # W = U z → U_new (M z)
        else:
            param, remap = sub.e, (lambda t, m=m: t @ m.t())  # E Uᵀ → (E Mᵀ) U_newᵀ
        with torch.no_grad():
            param.copy_(remap(param))
        maps[param] = remap
        sub.basis = new_basis.clone()
    return maps


def set_basis(module: nn.Module, basis: torch.Tensor) -> None:
    """Install a basis without touching parameters (restoring a checkpoint taken after an update)."""
    for sub in module.modules():
        if isinstance(sub, (SubspaceLinear, SubspaceEmbedding)):
            sub.basis = basis.clone()


def remap_optimizer_state(optimizer: torch.optim.Optimizer, maps: dict[nn.Parameter, Remap]) -> None:
    """Apply each parameter's coefficient map to its first-moment buffers."""
    for param, remap in maps.items():
        state = optimizer.state.get(param, {})
        for key in FIRST_MOMENTS:
            if key in state:
                state[key].copy_(remap(state[key]))
