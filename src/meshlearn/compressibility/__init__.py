"""Compressibility of trained models: spectra, stable rank, and SVD compression (plain, ASVD,
SVD-LLM) scored by validation loss, with exact parameter accounting.

Method note: ``shared/methods/optimizers_and_compressibility.md``. Entry point for a run folder:
:func:`compress_run` (``meshlearn compress RUN``); the pieces work on any :class:`Decoder`.
"""

from meshlearn.compressibility.accounting import ParameterAccount, count_parameters
from meshlearn.compressibility.calibration import InputStats, calibration_windows, collect_input_stats
from meshlearn.compressibility.evaluate import validation_loss
from meshlearn.compressibility.factorize import (
    Factors,
    asvd,
    rank_for_keep,
    svd_llm,
    truncated_svd,
    whitening,
)
from meshlearn.compressibility.lowrank import LowRankLinear
from meshlearn.compressibility.matrices import BLOCK_KINDS, BlockMatrix, block_matrices
from meshlearn.compressibility.pipelines import (
    PIPELINES,
    PipelineOptions,
    compress_model,
    factorizable,
    uniform_ranks,
)
from meshlearn.compressibility.run import CompressSettings, compress_run, evaluate_compression
from meshlearn.compressibility.spectra import MatrixSpectrum, model_spectra, singular_values, stable_rank

__all__ = [
    "BLOCK_KINDS",
    "PIPELINES",
    "BlockMatrix",
    "CompressSettings",
    "Factors",
    "InputStats",
    "LowRankLinear",
    "MatrixSpectrum",
    "ParameterAccount",
    "PipelineOptions",
    "asvd",
    "block_matrices",
    "calibration_windows",
    "collect_input_stats",
    "compress_model",
    "compress_run",
    "count_parameters",
    "evaluate_compression",
    "factorizable",
    "model_spectra",
    "rank_for_keep",
    "singular_values",
    "stable_rank",
    "svd_llm",
    "truncated_svd",
    "uniform_ranks",
    "validation_loss",
    "whitening",
]
