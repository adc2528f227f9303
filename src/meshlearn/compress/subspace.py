"""The subspace codec: k coefficients per token instead of d values, exact on a constrained model.

On a subspace-constrained decoder (``model.subspace_rank = k``) the residual minus the fixed token
table lies in span(U), so

    encode:  C = (X − T_fixed[ids])·U          (b, n, k), sent with the token ids
    decode:  X = C·Uᵀ + T_fixed[ids]

reconstructs X up to floating-point rounding. Backward, the receiver sends (∂L/∂X)·U and the sender
uses (∂L/∂C)·Uᵀ = (∂L/∂X)·Π as its output gradient; since every change the sender's parameters can
make to X lies in span(U), its parameter gradients are exactly those of the unsplit model.

Arithmetic is fp32; ``codec.wire_dtype`` sets what travels (fp32 is bit-for-bit up to rounding, bf16
halves the bytes at bf16 rounding of C). Ids travel as int16 when the vocabulary fits, else int32.
"""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Encoded, Kind, MessageContext, place
from meshlearn.models.subspace import tensor_hash


def id_dtype(vocab_size: int) -> torch.dtype:
    return torch.int16 if vocab_size <= 2**15 else torch.int32


class SubspaceCodec:
    name = "subspace"

    def __init__(self, basis: torch.Tensor, table: torch.Tensor, wire_dtype: torch.dtype):
        self.table = table  # (V, d), the frozen token table
        self.wire_dtype = wire_dtype
        self.ids_dtype = id_dtype(table.shape[0])
        self.set_basis(basis)

    def set_basis(self, basis: torch.Tensor) -> None:
        """Switch to a new U (after a Grassmann update); the version tag changes with it."""
        self.basis = basis  # (d, k), orthonormal columns
        self.version = tensor_hash(basis) + tensor_hash(self.table)  # what both ends must agree on

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        x = x.detach().float()
        basis = self.basis.to(x.device)
        if kind == "act":
            if ids is None:
                raise ValueError("subspace codec: activations need the microbatch's token ids")
            ids = ids.long().to(x.device)
            coeffs = (x - self.table.to(x.device)[ids]) @ basis  # (b, n, k)
            tensors = {"coeffs": coeffs.to(self.wire_dtype), "ids": ids.to(self.ids_dtype)}
        else:
            tensors = {"coeffs": (x @ basis).to(self.wire_dtype)}  # (∂L/∂X)·U
        return Encoded(tensors, tuple(x.shape), torch.float32, {"version": self.version})

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        if message.meta.get("version") != self.version:
            raise ValueError("subspace codec: sender and receiver disagree on U or the token table")
        coeffs = place(message.tensors["coeffs"].float(), ctx)
        x = coeffs @ self.basis.to(coeffs.device).t()
        if kind == "act":
            x = x + self.table.to(coeffs.device)[message.tensors["ids"].long().to(coeffs.device)]
        return x
