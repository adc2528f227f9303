"""Lossy baselines a user would try instead of the subspace codec, each with exact wire bytes.

They work on any (dense) model, and are compared with the subspace codec at equal bytes: top-k
sparsification, 4-bit quantization, and a fixed random low-rank projection (the subspace codec's
encoding *without* the constrained model — it shows why the constraint, not the projection, matters).
"""

from __future__ import annotations

import torch

from meshlearn.compress.codecs import Encoded, Kind, MessageContext, place


class TopKCodec:
    """Per token, the ``k`` largest-magnitude values and their int16 positions."""

    name = "topk"

    def __init__(self, k: int, wire_dtype: torch.dtype):
        self.k = k
        self.wire_dtype = wire_dtype

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        rows = x.detach().reshape(-1, x.shape[-1])
        index = rows.abs().topk(self.k, dim=1).indices
        values = rows.gather(1, index)
        return Encoded({"values": values.to(self.wire_dtype), "index": index.to(torch.int16)},
                       tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        values, index = message.tensors["values"], message.tensors["index"].long()
        rows = torch.zeros(values.shape[0], message.shape[-1], dtype=message.dtype, device=values.device)
        rows.scatter_(1, index, values.to(message.dtype))
        return place(rows.reshape(message.shape), ctx)


class Int4RowCodec:
    """Symmetric 4-bit quantization (levels −7…7), one fp32 scale per token, two values per byte."""

    name = "int4"

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        if rows.shape[1] % 2:
            rows = torch.nn.functional.pad(rows, (0, 1))
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 7.0
        q = (torch.round(rows / scale).clamp_(-7, 7) + 8).to(torch.uint8)  # 1…15 in a nibble
        packed = q[:, 0::2] << 4 | q[:, 1::2]
        return Encoded({"packed": packed, "scale": scale.squeeze(1)}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        packed, scale = message.tensors["packed"], message.tensors["scale"]
        q = torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(1).float() - 8
        d = message.shape[-1]
        return place((q[:, :d] * scale.unsqueeze(1)).reshape(message.shape).to(message.dtype), ctx)


class RandomProjectionCodec:
    """Send X·P for a fixed random orthonormal P (d × r); receive X·P·Pᵀ. Lossy on a dense model."""

    name = "lowrank"

    def __init__(self, d_model: int, rank: int, seed: int, wire_dtype: torch.dtype):
        gen = torch.Generator().manual_seed(seed)
        self.projection, _ = torch.linalg.qr(torch.randn(d_model, rank, generator=gen))
        self.wire_dtype = wire_dtype

    def encode(self, x: torch.Tensor, kind: Kind = "act", ids: torch.Tensor | None = None,
               ctx: MessageContext | None = None) -> Encoded:
        coeffs = x.detach().float() @ self.projection.to(x.device)
        return Encoded({"coeffs": coeffs.to(self.wire_dtype)}, tuple(x.shape), x.dtype)

    def decode(self, message: Encoded, kind: Kind = "act",
               ctx: MessageContext | None = None) -> torch.Tensor:
        coeffs = place(message.tensors["coeffs"].float(), ctx)
        return (coeffs @ self.projection.to(coeffs.device).t()).to(message.dtype)
