"""The anchor stage's own EMA and the top-r factors it sends (open detail 3, ``anchor.send = factors``).

An anchor stage keeps, per targeted matrix, the EMA M ← β_anc·M + (1 − β_anc)·G of its clean
gradients (``optim.spectral.fold_ema``: the very update a fast worker applies under ``send =
gradients``), takes the thin SVD of M on every pass and sends U_r, S_r, V_r: r·(m + n + 1) values
per matrix (r = min(``anchor.rank``, m, n)) instead of m·n. The fast workers install the received
basis (``SpectralCorrection.receive_basis``) and keep no EMA. Each anchor stage actor
(anchor/actor.py) holds one, under every runtime.

The EMA folds in every pass the stage computes, whether or not a fast replica later receives it in
time (under ``send = gradients`` a dropped arrival never enters the fast worker's EMA); with every
share delivered the two modes fold the same sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshlearn.optim.spectral import AnchorBasis, fold_ema


def factor_rank(shape: tuple[int, int], rank: int) -> int:
    """r of one matrix: the requested rank, at most its thin SVD's."""
    return min(rank, *shape)


class AnchorEMA:
    """One anchor stage's EMAs of its targeted matrices; ``fold`` gives the factors to send."""

    def __init__(self, beta: float, rank: int):
        self.beta, self.rank = beta, rank
        self.ema: dict[str, Tensor] = {}

    def fold(self, grads: dict[str, Tensor]) -> dict[str, AnchorBasis]:
        """Fold one pass's gradients in and return each matrix's top-r basis of the new EMA (fp32)."""
        out = {}
        for name, grad in grads.items():
            self.ema[name] = fold_ema(self.ema.get(name), grad, self.beta)
            out[name] = AnchorBasis.of(self.ema[name]).top(factor_rank(tuple(grad.shape), self.rank))
        return out

    def state(self) -> dict[str, Tensor]:
        return {name: ema.clone() for name, ema in self.ema.items()}

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.ema = {name: ema.clone() for name, ema in state.items()}


def basis_on_wire(basis: AnchorBasis, dtype: torch.dtype) -> AnchorBasis:
    """The factors as the receiver holds them after a trip in ``dtype`` (fp32 again)."""
    return AnchorBasis(*(t.detach().to(dtype).to(torch.float32) for t in (basis.u, basis.s, basis.vh)))


def pack(bases: dict[str, AnchorBasis], dtype: torch.dtype) -> dict[str, Tensor]:
    """Factors as a message's named tensors (``name|u``, ``name|s``, ``name|vh``) in ``dtype``."""
    return {f"{name}|{part}": t.detach().to(dtype).contiguous() for name, b in bases.items()
            for part, t in (("u", b.u), ("s", b.s), ("vh", b.vh))}


def unpack(tensors: dict[str, Tensor]) -> dict[str, AnchorBasis]:
    """``pack``'s inverse, in fp32."""
    names = sorted({key.rsplit("|", 1)[0] for key in tensors})
    return {n: AnchorBasis(*(tensors[f"{n}|{part}"].to(torch.float32) for part in ("u", "s", "vh")))
            for n in names}
