"""``meshlearn compress RUN``: score a trained run's model after SVD compression.

Steps: rebuild the unsplit model from replica 0's stages in the checkpoint → spectra and stable
ranks → calibration statistics on train-split windows (only if a calibrated pipeline is asked
for) → for each pipeline and target keep fraction, factorize every block matrix and measure the
validation loss on the run's own validation batches → write ``compress.json``, ``compress.md`` and
plots into ``RUN/compress/`` (each file atomically).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from meshlearn.atomic import atomic_write_json, atomic_write_text
from meshlearn.compressibility.calibration import DEFAULT_SEQUENCES, calibration_windows, collect_input_stats
from meshlearn.compressibility.evaluate import validation_loss
from meshlearn.compressibility.matrices import BLOCK_KINDS
from meshlearn.compressibility.pipelines import (
    NEEDS_CALIBRATION,
    PipelineOptions,
    check_pipeline,
    compress_model,
    factorizable,
    uniform_ranks,
)
from meshlearn.compressibility.plots import plot_loss_vs_kept, plot_spectra
from meshlearn.compressibility.report import render_markdown
from meshlearn.compressibility.spectra import MatrixSpectrum, mean_stable_rank, model_spectra
from meshlearn.data import validation_batches
from meshlearn.data.batches import Batch
from meshlearn.data.corpus import load_corpus
from meshlearn.models.llama import Decoder
from meshlearn.train.restore import load_run_model

OUT_DIR = "compress"


@dataclass(frozen=True)
class CompressSettings:
    """What ``meshlearn compress`` measures. CLI flags: ``--keep``, ``--pipelines``,
    ``--calibration``."""

    keeps: tuple[float, ...] = (0.75, 0.5, 0.25)
    """Target fractions of each block matrix's parameters to keep (rank ⌊keep·mn/(m+n)⌋)."""
    pipelines: tuple[str, ...] = ("svd", "asvd", "svdllm")
    calibration_sequences: int = DEFAULT_SEQUENCES
    """Train-split windows of seq_len tokens for ASVD/SVD-LLM; more is slower, rarely better here."""
    calibration_seed: int = 0
    options: PipelineOptions = field(default_factory=PipelineOptions)

    def __post_init__(self) -> None:
        for keep in self.keeps:
            if not 0 < keep <= 1:
                raise ValueError(f"keep fractions must be in (0, 1], got {keep}")
        for name in self.pipelines:
            check_pipeline(name)


def evaluate_compression(model: Decoder, val: list[Batch], calibration: torch.Tensor | None,
                         settings: CompressSettings) -> dict:
    """Spectra, the uncompressed loss, and one record per (pipeline, keep); no files touched.

    ``calibration`` (token ids, (N, T)) may be None when no calibrated pipeline is requested."""
    spectra = model_spectra(model)
    matrices, skipped = factorizable(model)
    stats = None
    if NEEDS_CALIBRATION & set(settings.pipelines):
        if calibration is None:
            raise ValueError("ASVD and SVD-LLM need calibration sequences")
        stats = collect_input_stats(model, {m.name: m.module for m in matrices}, calibration)
    base = validation_loss(model, val)
    results = []
    for pipeline in settings.pipelines:
        for keep in settings.keeps:
            started = time.perf_counter()
            compressed, account = compress_model(model, pipeline, uniform_ranks(model, keep), stats,
                                                 settings.options)
            loss = validation_loss(compressed, val)
            results.append({"pipeline": pipeline, "keep": keep, "val_loss": loss,
                            "loss_increase": loss - base, "seconds": time.perf_counter() - started,
                            "account": account.to_dict()})
    return {"uncompressed_val_loss": base, "spectra": [s.to_dict() for s in spectra],
            "stable_rank": stable_rank_summary(spectra), "skipped": skipped, "results": results}


def stable_rank_summary(spectra: list[MatrixSpectrum]) -> dict:
    kinds = [k for k in BLOCK_KINDS if any(s.kind == k for s in spectra)]
    return {"mean": mean_stable_rank(spectra), "by_kind": {k: mean_stable_rank(spectra, k) for k in kinds}}


def compress_run(run_dir: Path, settings: CompressSettings = CompressSettings(),
                 out_dir: Path | None = None) -> dict:
    """Evaluate a run's compressibility and write the results; returns what ``compress.json`` holds."""
    run_dir = Path(run_dir)
    model, cfg, step = load_run_model(run_dir)
    corpus = load_corpus(cfg, run_dir)
    seq_len = cfg.model.seq_len
    val = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size, seq_len)
    calibration = None
    if NEEDS_CALIBRATION & set(settings.pipelines):
        calibration = calibration_windows(corpus.splits.train, settings.calibration_sequences, seq_len,
                                          settings.calibration_seed)
    result = {
        "run": cfg.name or run_dir.name, "run_dir": str(run_dir), "step": step,
        "optimizer": cfg.optim.name, "lr": cfg.train.lr,
        "settings": asdict(settings),
        "calibration": {"split": "train", "sequences": settings.calibration_sequences,
                        "seq_len": seq_len, "seed": settings.calibration_seed},
        "validation": {"batches": len(val), "batch_size": cfg.train.batch_size, "seq_len": seq_len},
        **evaluate_compression(model, val, calibration, settings),
    }
    write_outputs(result, Path(out_dir) if out_dir else run_dir / OUT_DIR)
    return result


def write_outputs(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    by_layer: dict[str, list[MatrixSpectrum]] = {}
    for s in map(MatrixSpectrum.from_dict, result["spectra"]):
        by_layer.setdefault(f"layer {s.layer}", []).append(s)
    plot_spectra(by_layer, out_dir / "spectra.png", f"{result['run']}: normalized singular values")
    curves = {p: [(r["account"]["kept_in_compressed"], r["val_loss"])
                  for r in result["results"] if r["pipeline"] == p] for p in result["settings"]["pipelines"]}
    plot_loss_vs_kept({result["run"]: curves}, {"uncompressed": result["uncompressed_val_loss"]},
                      out_dir / "loss_vs_kept.png")
    atomic_write_json(out_dir / "compress.json", result)
    atomic_write_text(out_dir / "compress.md", render_markdown(result))
