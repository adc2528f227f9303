"""Singular value spectra and stable rank of the block matrices.

Stable rank ``‖W‖_F² / ‖W‖₂²`` is a smooth, scale-free count of the directions that carry a
matrix's energy: ``srank(I_n) = n`` and ``srank(uvᵀ) = 1``. A lower stable rank means truncated SVD
throws away less of the matrix, which is what NuMuon's low-rank updates aim for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlearn.compressibility.matrices import block_matrices
from meshlearn.models.llama import Decoder


def singular_values(weight: torch.Tensor) -> torch.Tensor:
    """Descending singular values, computed in fp64 so tiny tail values are not rounding noise."""
    return torch.linalg.svdvals(weight.detach().double())


def stable_rank(weight: torch.Tensor) -> float:
    """``‖W‖_F² / ‖W‖₂²``; 0 for an all-zero matrix (which has no direction at all)."""
    return stable_rank_from_values(singular_values(weight))


def stable_rank_from_values(values: torch.Tensor) -> float:
    """Stable rank from already computed singular values (descending)."""
    top = values[0].item() ** 2
    return (values.square().sum().item() / top) if top > 0 else 0.0


@dataclass(frozen=True)
class MatrixSpectrum:
    name: str
    kind: str
    layer: int
    shape: tuple[int, int]
    singular_values: list[float]
    stable_rank: float

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "layer": self.layer, "shape": list(self.shape),
                "stable_rank": self.stable_rank, "singular_values": self.singular_values}

    @classmethod
    def from_dict(cls, d: dict) -> MatrixSpectrum:
        """Read back a record of ``compress.json`` (to plot runs side by side)."""
        return cls(d["name"], d["kind"], d["layer"], tuple(d["shape"]), d["singular_values"],
                   d["stable_rank"])


def model_spectra(model: Decoder) -> list[MatrixSpectrum]:
    """Spectrum and stable rank of every block matrix (subspace writers via their U·Z weight)."""
    spectra = []
    for matrix in block_matrices(model):
        values = singular_values(matrix.weight)
        spectra.append(MatrixSpectrum(matrix.name, matrix.kind, matrix.layer, tuple(matrix.weight.shape),
                                      values.tolist(), stable_rank_from_values(values)))
    return spectra


def mean_stable_rank(spectra: list[MatrixSpectrum], kind: str | None = None) -> float:
    """Mean stable rank over all block matrices, or over one layer type."""
    ranks = [s.stable_rank for s in spectra if kind is None or s.kind == kind]
    return sum(ranks) / len(ranks)
