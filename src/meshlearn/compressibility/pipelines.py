"""Compress a decoder: replace each block matrix by a ``LowRankLinear`` from one of the pipelines.

Pipelines are one registry (name → factorization); ASVD and SVD-LLM need the calibration
statistics of :mod:`.calibration`, plain SVD does not. The input model is never modified.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from meshlearn.compressibility.accounting import ParameterAccount, count_parameters
from meshlearn.compressibility.calibration import InputStats
from meshlearn.compressibility.factorize import Factors, asvd, rank_for_keep, svd_llm, truncated_svd
from meshlearn.compressibility.lowrank import LowRankLinear
from meshlearn.compressibility.matrices import BlockMatrix, block_matrices
from meshlearn.models.llama import Decoder
from meshlearn.models.subspace import SubspaceLinear


@dataclass(frozen=True)
class PipelineOptions:
    asvd_alpha: float = 0.5
    """ASVD's activation exponent α; 0 turns ASVD into plain SVD, 1 scales by the raw mean |x|."""
    svdllm_ridge: float = 1e-6
    """SVD-LLM's ridge, relative to the mean diagonal of X Xᵀ (see :func:`.factorize.whitening`)."""


def _svd(weight: torch.Tensor, stats: InputStats | None, r: int, options: PipelineOptions) -> Factors:
    return truncated_svd(weight, r)


def _asvd(weight: torch.Tensor, stats: InputStats | None, r: int, options: PipelineOptions) -> Factors:
    assert stats is not None  # compress_model checks NEEDS_CALIBRATION first
    return asvd(weight, stats.abs_mean, r, options.asvd_alpha)


def _svdllm(weight: torch.Tensor, stats: InputStats | None, r: int, options: PipelineOptions) -> Factors:
    assert stats is not None
    return svd_llm(weight, stats.gram, r, options.svdllm_ridge)


Factorizer = Callable[[torch.Tensor, InputStats | None, int, PipelineOptions], Factors]

PIPELINES: dict[str, Factorizer] = {"svd": _svd, "asvd": _asvd, "svdllm": _svdllm}
NEEDS_CALIBRATION = frozenset({"asvd", "svdllm"})


def check_pipeline(name: str) -> None:
    if name not in PIPELINES:
        raise ValueError(f"unknown compression pipeline {name!r}; registered: {sorted(PIPELINES)}")


def factorizable(model: Decoder) -> tuple[list[BlockMatrix], dict[str, str]]:
    """Block matrices a pipeline can factorize, and the others with the reason they stay dense."""
    matrices, skipped = [], {}
    for matrix in block_matrices(model):
        if matrix.factorizable:
            matrices.append(matrix)
        else:
            skipped[matrix.name] = _why_dense(matrix.module)
    return matrices, skipped


def _why_dense(module: nn.Module) -> str:
    if isinstance(module, SubspaceLinear):
        return f"SubspaceLinear (already U·Z of rank {module.z.shape[0]}): left as is"
    return f"{type(module).__name__} is not a dense nn.Linear: left as is"


def uniform_ranks(model: Decoder, keep: float) -> dict[str, int]:
    """The same parameter budget for every factorizable matrix: r = ⌊keep · mn/(m+n)⌋."""
    return {m.name: rank_for_keep(keep, *m.weight.shape) for m in factorizable(model)[0]}


def compress_model(model: Decoder, pipeline: str, ranks: Mapping[str, int],
                   stats: Mapping[str, InputStats] | None = None,
                   options: PipelineOptions = PipelineOptions()) -> tuple[Decoder, ParameterAccount]:
    """A copy of ``model`` with every matrix named in ``ranks`` factorized at its rank (matrices not
    named stay dense and uncounted; :func:`uniform_ranks` names all of them).

    ``stats`` (from :func:`.calibration.collect_input_stats` on the *uncompressed* model) is
    required for the calibrated pipelines. Returns the compressed copy and its measured account."""
    check_pipeline(pipeline)
    if pipeline in NEEDS_CALIBRATION and stats is None:
        raise ValueError(f"pipeline {pipeline!r} needs calibration statistics (stats=...)")
    compressed = copy.deepcopy(model)
    matrices, skipped = factorizable(compressed)
    unknown = sorted(set(ranks) - {m.name for m in matrices})
    if unknown:
        raise ValueError(f"no factorizable block matrix named {unknown[0]!r}")
    dense = factors = 0
    for matrix in matrices:
        if matrix.name not in ranks:
            continue
        weight = matrix.weight
        found = PIPELINES[pipeline](weight, stats[matrix.name] if stats else None, ranks[matrix.name],
                                    options)
        setattr(matrix.parent, matrix.kind, LowRankLinear(found))
        dense += weight.numel()
        factors += found.params
    account = ParameterAccount(dict(ranks), dense, factors, count_parameters(model),
                               count_parameters(compressed), skipped)
    return compressed, account
