"""Subspace networks (protocol models): confine the residual stream to span(U), U ∈ R^{d×k}.

Method note: ``shared/methods/subspace_networks.md`` (arXiv 2506.01260). Every weight that writes
into the residual stream — attention output, FFN down projection, the learnable token embedding — is
*reparametrized* as U·Z, so its output lies in span(U) by construction and stays there under any
optimizer (AdamW, Muon, ...). The rest of the embedding is a fixed random table regenerated from a
seed. The residual minus that table is then exactly k coordinates per token, which is all a pipeline
boundary has to send.

Norm placement: Llama's pre-norm is kept. A norm (with its trainable gain) sits *inside* each branch
before the projections, and the branch's last operation is a constrained writer, so the branch output
is in span(U). The final norm and head come after the last boundary, where nothing needs to be sent.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn


def subspace_basis(d_model: int, rank: int, seed: int) -> torch.Tensor:
    """U (d, k) with orthonormal columns: the Q of a seeded Gaussian, signs fixed by diag(R) > 0.

    Generated in fp32 on the CPU with its own generator, so every stage gets the same bits.
    """
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d_model, rank, generator=gen, dtype=torch.float32))
    return fixed_basis_signs(q, r)


def fixed_basis_signs(q: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Make a QR factorization unique: flip columns of Q so that diag(R) > 0."""
    diag = torch.diagonal(r)
    return q * torch.where(diag < 0, -1.0, 1.0)


def fixed_token_table(vocab_size: int, d_model: int, std: float, seed: int) -> torch.Tensor:
    """T_fixed (V, d): the frozen full-rank part of the token embedding (the model's init std)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(vocab_size, d_model, generator=gen, dtype=torch.float32) * std


def tensor_hash(t: torch.Tensor) -> str:
    """Content hash of a shared artifact: stages compare these to catch silent mismatches."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class SubspaceLinear(nn.Module):
    """A residual writer y = x·Wᵀ with W = U·Z (nn.Linear layout W ∈ R^{d×in}); Z ∈ R^{k×in} learns.

    Z's init std is scaled by sqrt(d/k) so that ‖W‖_F matches a dense layer of the same std.
    """

    def __init__(self, in_features: int, basis: torch.Tensor, std: float):
        super().__init__()
        d_model, rank = basis.shape
        self.register_buffer("basis", basis, persistent=False)
        self.z = nn.Parameter(torch.randn(rank, in_features) * std * (d_model / rank) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.z.t()) @ self.basis.t()  # (..., in) → (..., k) → (..., d)

    @property
    def weight(self) -> torch.Tensor:
        """The effective dense weight U·Z, for inspection and SVD analysis."""
        return self.basis @ self.z


class SubspaceEmbedding(nn.Module):
    """TE(tok) = E[tok]·Uᵀ + T_fixed[tok]: a learnable part in span(U) plus a frozen full-rank table."""

    def __init__(self, vocab_size: int, basis: torch.Tensor, table: torch.Tensor, std: float):
        super().__init__()
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("table", table, persistent=False)
        self.e = nn.Parameter(torch.randn(vocab_size, basis.shape[1]) * std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.e[ids] @ self.basis.t() + self.table[ids]  # (B, T, d)
