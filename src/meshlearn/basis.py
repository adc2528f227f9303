"""State that lives in the basis of a model parameter, and how it follows a change of basis.

A protocol model's morph (``meshlearn.protocol``) changes a parameter W into L·W (torch's (out, in)
layout; the function is unchanged because its neighbour folds L⁻¹). Anything a method keeps in
W's coordinates must follow, or training after the morph silently differs from training without
it (the method note's pitfall "silent divergence"). Such a holder lists its tensors as
:class:`BasisTensor`s, each saying which parameter it belongs to and how it moves:

- ``weight``: like W itself (L·X): copies of weights, weight differences, tangent vectors
  (DiLoCo's outer weights and outer momentum, the curvature tracker's eigenvector estimates);
- ``gradient``: like ∂loss/∂W (L^{−T}·X): gradients and their running sums (Muon momentum,
  PowerSGD's error feedback).

For orthogonal L both are L·X. The morph transforms the live tensors in place (through its fp64
master copy), so a holder needs no code of its own beyond listing them; holders of state that
cannot follow a change of basis (an elementwise second moment, a slice of coordinates) are
refused with morphs instead (``protocol/settings.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

KINDS = ("weight", "gradient")


@dataclass(frozen=True)
class BasisTensor:
    """One tensor of state in the basis of parameter ``param`` (its name in the stage module)."""

    param: str
    kind: str  # "weight" or "gradient" (see the module docstring)
    tensor: Tensor  # the live tensor; changed in place, same shape as the parameter

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"BasisTensor.kind = {self.kind!r}; allowed: {list(KINDS)}")
