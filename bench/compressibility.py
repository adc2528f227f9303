"""Compressibility of AdamW, Muon and NuMuon: the demo model trained on equal tokens, then compressed.

1. A learning-rate sweep per optimizer: short runs (``--sweep-steps``, full warm-up + cosine
   schedule squeezed into them) at each lr of its grid (:data:`GRIDS`; ``--lrs NAME=LR,...``
   replaces one); the lowest final validation loss wins. Muon and NuMuon share one grid, and
   NuMuon runs like for like with Muon (:data:`NUMUON_RECIPE`: Nesterov momentum as Muon's, and the
   method note's rank schedule, full rank for 10 % of the run, cosine to the rank fraction at 80 %).
2. One full-length run per optimizer at its best lr (``--steps``, the demo's 300 by default), so
   every optimizer sees the same tokens; ``--numuon-fractions 0.5`` adds NuMuon runs at other rank
   fractions (at NuMuon's best lr, not swept again).
3. ``meshlearn compress`` on each: validation loss after plain SVD, ASVD and SVD-LLM at 75 %, 50 %
   and 25 % kept parameters, stable ranks and spectra.
4. Per-step optimizer time, NuMuon against Muon (and AdamW), side by side: all three step on
   identical gradients in alternating order, so they share the machine's load.

The mesh is one stage × one replica: the mesh equivalence tests pin the mesh to the unsplit model
(1e-5), so the demo's 4 × 2 mesh trains the same model up to rounding, and the simulator's overhead
would only slow the sweep down. Intra-op threads are pinned to 1: on a shared 2-core machine, OpenMP
spin-waiting made a whole NuMuon training step 12× slower (its small QR/SVD calls), AdamW's 4×.
Every timing is stored with the machine's load average (as ``uptime`` prints it) beside it.

    python bench/compressibility.py [--steps 300] [--sweep-steps 100] [--lrs muon=0.012,0.024]
                                    [--numuon-fractions 0.5]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, ROOT, demo_config, load_average, markdown_table, write_results

from meshlearn.assemble import resolve
from meshlearn.compressibility import BLOCK_KINDS, CompressSettings, MatrixSpectrum, compress_run
from meshlearn.compressibility.plots import plot_loss_vs_kept, plot_spectra
from meshlearn.config import RunConfig
from meshlearn.data import global_batch
from meshlearn.data.corpus import load_corpus
from meshlearn.jsonl import read_records
from meshlearn.models import Decoder, init_model
from meshlearn.optim import build_optimizer
from meshlearn.train import Trainer

OPTIMIZERS = ("adamw", "muon", "numuon")
MATRIX_GRID = (1.2e-2, 2.4e-2, 4.8e-2)
GRIDS = {"adamw": (3e-3, 6e-3, 1.2e-2), "muon": MATRIX_GRID, "numuon": MATRIX_GRID}
"""Three lrs per optimizer, factor 2 apart, centred on the best of a first shared grid (1.5e-3 … 1.2e-2)
where AdamW peaked at 6e-3 and Muon and NuMuon at its top edge; Muon and NuMuon share theirs."""
NUMUON_RECIPE = ("optim.numuon_rank_schedule=cosine", "optim.numuon_nesterov=true")
"""NuMuon against Muon like for like: the same (Nesterov) momentum, and the note's rank schedule from
``optim.numuon_start_fraction`` (1.0) down to ``optim.numuon_rank_fraction`` (0.25)."""
MESH = ("mesh.stages=1", "mesh.replicas=1")
OUT = ROOT / "bench" / "out" / "compressibility"
SETTINGS = CompressSettings()  # keeps 0.75, 0.5, 0.25; svd, asvd, svdllm; 64 calibration sequences
WIDE = ("model.d_model=512", "model.n_head=8")


def run_config(optimizer: str, lr: float, steps: int, *extra: str) -> RunConfig:
    recipe = NUMUON_RECIPE if optimizer == "numuon" else ()
    return demo_config(*MESH, f"optim.name={optimizer}", f"train.lr={lr}", f"train.steps={steps}",
                       f"name={optimizer}", "train.checkpoint_every=0", *recipe, *extra)


def train(cfg: RunConfig, run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    load_before = load_average()
    summary = Trainer(cfg, run_dir, progress=False).train()
    steps = [r["step_wall_s"] for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return summary | {"mean_step_wall_s": statistics.mean(steps),
                      "load_avg": f"{load_before} → {load_average()}"}


def sweep(grids: dict[str, tuple[float, ...]], steps: int) -> list[dict]:
    """Short runs at every lr of every optimizer's grid; a diverged run scores +inf."""
    rows = []
    for optimizer in OPTIMIZERS:
        for lr in grids[optimizer]:
            try:
                val = train(run_config(optimizer, lr, steps), OUT / "sweep" / f"{optimizer}-lr{lr:g}")[
                    "final_val_loss"]
            except FloatingPointError:  # the trainer stops on a non-finite train loss
                val = math.inf
            val = val if math.isfinite(val) else math.inf  # NaN would break min()
            rows.append({"optimizer": optimizer, "lr": lr, "val_loss": val})
            print(f"sweep {optimizer} lr {lr:g}: val {val:.4f}", flush=True)
    for optimizer in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == optimizer]
        best = min(mine, key=lambda r: r["val_loss"])
        for r in mine:
            r["best"] = "✓" if r is best else ""
    return rows


def parse_grids(overrides: list[str]) -> dict[str, tuple[float, ...]]:
    """``--lrs muon=0.01,0.02`` replaces one optimizer's grid."""
    grids = dict(GRIDS)
    for text in overrides:
        name, _, values = text.partition("=")
        if name not in GRIDS or not values:
            raise SystemExit(f"--lrs {text!r}: expected NAME=LR,LR,... with NAME in {list(GRIDS)}")
        grids[name] = tuple(float(v) for v in values.split(","))
    return grids


def optimizer_step_times(extra: tuple[str, ...], lrs: dict[str, float], repeats: int,
                         warmup: int) -> list[dict]:
    """Time ``optimizer.step()`` of each optimizer on one model's identical gradients, alternating
    the order every round. Gradients stay in place across steps, so every step does the same work
    (NuMuon's Krylov block is warm-started from the second step on, as in training)."""
    cfg = demo_config(*MESH, *extra)
    corpus = load_corpus(cfg, None)
    cfg = resolve(cfg, corpus.vocab_size)
    model = init_model(cfg.model, cfg.seed)
    x, y = global_batch(corpus.splits.train, 0, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
    Decoder.loss(model(x), y).backward()
    optimizers = {}
    for name in OPTIMIZERS:
        replica = copy.deepcopy(model)
        for mine, source in zip(replica.parameters(), model.parameters(), strict=True):
            mine.grad = source.grad.clone()  # deepcopy drops .grad
        optimizers[name] = build_optimizer(replica, dataclasses.replace(cfg.optim, name=name), lrs[name])
    times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    load_before = load_average()
    for i in range(warmup + repeats):
        for name in OPTIMIZERS if i % 2 == 0 else OPTIMIZERS[::-1]:
            started = time.perf_counter()
            optimizers[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    muon = statistics.median(times["muon"])
    return [{"model": f"d_model={cfg.model.d_model}", "optimizer": name,
             "median_ms": 1e3 * statistics.median(times[name]), "min_ms": 1e3 * min(times[name]),
             "mean_ms": 1e3 * statistics.mean(times[name]),
             "over_muon": statistics.median(times[name]) / muon,
             "load_avg": f"{load_before} → {load_average()}"} for name in OPTIMIZERS]


def compression_rows(compressed: dict[str, dict]) -> list[dict]:
    """One row per (pipeline, keep) with every variant's loss; ratios are shape-only, so shared."""
    labels = list(compressed)
    rows = []
    for i, r in enumerate(compressed[labels[0]]["results"]):
        row = {"pipeline": r["pipeline"], "keep": r["keep"],
               "kept_in_compressed": r["account"]["kept_in_compressed"],
               "kept_total": r["account"]["kept_total"]}
        for label in labels:
            mine = compressed[label]["results"][i]
            assert (mine["pipeline"], mine["keep"]) == (r["pipeline"], r["keep"])
            row[label] = mine["val_loss"]
        row["best"] = min(labels, key=lambda label: row[label])
        rows.append(row)
    return rows


def goals(base: dict[str, float], rows: list[dict]) -> list[str]:
    """The issue's two goals for every NuMuon variant, each with its numbers and a verdict."""
    lines = []
    for label in (label for label in base if label.startswith("numuon")):
        for row in (r for r in rows if r["keep"] == 0.5):
            met = row[label] < min(row["muon"], row["adamw"])
            lines.append(f"- {label}, 50 % kept, {row['pipeline']}: {row[label]:.4f} vs Muon "
                         f"{row['muon']:.4f} ({row[label] - row['muon']:+.4f}), AdamW {row['adamw']:.4f} "
                         f"({row[label] - row['adamw']:+.4f}) → {'met' if met else 'missed'}")
        gap = base[label] / base["muon"] - 1
        lines.append(f"- {label}, uncompressed: {base[label]:.4f} vs Muon {base['muon']:.4f} ({gap:+.2%}; "
                     f"goal ≤ +2 %) → {'met' if gap <= 0.02 else 'missed'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--lrs", action="append", default=[], metavar="NAME=LR,LR,...",
                        help="replace one optimizer's lr grid (repeatable)")
    parser.add_argument("--numuon-fractions", default="",
                        help="extra NuMuon rank fractions, full runs at NuMuon's best lr (e.g. 0.5)")
    parser.add_argument("--timing-repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    grids = parse_grids(args.lrs)

    swept = sweep(grids, args.sweep_steps)
    best = {o: next(r["lr"] for r in swept if r["optimizer"] == o and r["best"]) for o in OPTIMIZERS}
    variants = {o: (o, best[o], ()) for o in OPTIMIZERS}
    for fraction in filter(None, args.numuon_fractions.split(",")):
        rank = f"optim.numuon_rank_fraction={fraction}"
        variants[f"numuon r={fraction}"] = ("numuon", best["numuon"], (rank,))
    full, compressed = {}, {}
    for label, (optimizer, lr, extra) in variants.items():
        run_dir = OUT / label.replace(" ", "-")
        full[label] = train(run_config(optimizer, lr, args.steps, *extra), run_dir)
        compressed[label] = compress_run(run_dir, SETTINGS)
        print(f"{label} lr {lr:g}: val {full[label]['final_val_loss']:.4f}, compressed in "
              f"{sum(r['seconds'] for r in compressed[label]['results']):.0f} s", flush=True)
    timing = [*optimizer_step_times((), best, args.timing_repeats, 3),
              *optimizer_step_times(WIDE, best, max(3, args.timing_repeats // 4), 2)]

    rows = compression_rows(compressed)
    base = {label: c["uncompressed_val_loss"] for label, c in compressed.items()}
    runs = [{"variant": label, "lr": lr, "tokens": full[label]["tokens"], "val_loss": base[label],
             "over_muon": base[label] / base["muon"] - 1,
             "stable_rank": compressed[label]["stable_rank"]["mean"],
             "mean_step_wall_s": full[label]["mean_step_wall_s"],
             "load_avg": full[label]["load_avg"]} for label, (_, lr, _) in variants.items()]
    ranks = [{"variant": label, **c["stable_rank"]["by_kind"], "mean": c["stable_rank"]["mean"]}
             for label, c in compressed.items()]
    figures = RESULTS / "compressibility"
    figures.mkdir(parents=True, exist_ok=True)
    plot_loss_vs_kept({p: {label: [(r["kept_in_compressed"], r[label]) for r in rows if r["pipeline"] == p]
                           for label in compressed} for p in SETTINGS.pipelines},
                      base, figures / "loss_vs_kept.png")
    spectra = {label: list(map(MatrixSpectrum.from_dict, c["spectra"])) for label, c in compressed.items()}
    plot_spectra(spectra, figures / "spectra.png", "normalized singular values of every block matrix")
    verdicts = goals(base, rows)
    elapsed = time.perf_counter() - started

    sweep_table = markdown_table(swept, [("optimizer", "optimizer", ""), ("lr", "lr", "g"),
                                         ("val_loss", f"val loss @ {args.sweep_steps} steps", ".4f"),
                                         ("best", "best", "")])
    run_table = markdown_table(runs, [
        ("variant", "optimizer", ""), ("lr", "lr", "g"), ("tokens", "tokens", "d"),
        ("val_loss", f"val loss @ {args.steps} steps", ".4f"), ("over_muon", "vs Muon", "+.2%"),
        ("stable_rank", "mean stable rank", ".2f"), ("mean_step_wall_s", "wall s/step (whole step)", ".3f"),
        ("load_avg", "load average (before → after)", "")])
    compress_table = markdown_table(rows, [
        ("pipeline", "pipeline", ""), ("keep", "target keep", ".2f"),
        ("kept_in_compressed", "kept in compressed (measured)", ".4f"),
        ("kept_total", "kept of all params", ".4f"),
        *((label, label, ".4f") for label in compressed), ("best", "lowest", "")])
    rank_table = markdown_table(ranks, [("variant", "optimizer", ""),
                                        *((k, k, ".2f") for k in BLOCK_KINDS), ("mean", "mean", ".2f")])
    timing_table = markdown_table(timing, [
        ("model", "model", ""), ("optimizer", "optimizer", ""), ("median_ms", "median ms/step", ".2f"),
        ("min_ms", "min ms", ".2f"), ("mean_ms", "mean ms", ".2f"), ("over_muon", "÷ Muon (median)", ".2f"),
        ("load_avg", "load average (before → after)", "")])
    command = " ".join(["python bench/compressibility.py", f"--steps {args.steps}",
                        f"--sweep-steps {args.sweep_steps}", *(f"--lrs {v}" for v in args.lrs),
                        *([f"--numuon-fractions {args.numuon_fractions}"] if args.numuon_fractions else [])])
    cfg = demo_config()
    markdown = "\n\n".join([
        f"Demo model (configs/demo.toml, mesh 1 × 1), {args.steps} steps × "
        f"{runs[0]['tokens'] // args.steps} tokens for every run; NuMuon rank fraction "
        f"{cfg.optim.numuon_start_fraction} → {cfg.optim.numuon_rank_fraction} (cosine schedule) "
        "unless named, with Nesterov momentum as Muon's (`" + " ".join(NUMUON_RECIPE) + "`), "
        "Muon/NuMuon lr scale "
        f"{cfg.optim.muon_adjust_lr}, weight decay {cfg.optim.weight_decay}; `{command}` "
        f"({elapsed / 60:.1f} min on this machine)",
        f"LR sweep ({args.sweep_steps}-step runs, same warm-up and cosine schedule)\n\n{sweep_table}",
        f"Full runs at the best lr (uncompressed loss via the unsplit model)\n\n{run_table}",
        "Validation loss after compression (every block matrix at rank ⌊keep·mn/(m+n)⌋; embedding, "
        f"head and norms dense; {SETTINGS.calibration_sequences} calibration sequences from the train "
        f"split)\n\n{compress_table}",
        f"Stable rank ‖W‖_F²/‖W‖₂², mean per layer type\n\n{rank_table}",
        "Optimizer step time, side by side on identical gradients, best lrs (1 thread; "
        f"wide = {' '.join(WIDE)})\n\n{timing_table}",
        "Goals\n\n" + "\n".join(verdicts),
        "Plots: [loss vs kept parameters](compressibility/loss_vs_kept.png), "
        "[spectra](compressibility/spectra.png)",
    ])
    write_results("compressibility", {
        "command": command, "steps": args.steps, "sweep_steps": args.sweep_steps,
        "grids": grids, "best_lr": best, "sweep": swept, "runs": runs, "compression": rows,
        "stable_rank": ranks, "timing": timing, "goals": verdicts, "elapsed_s": elapsed,
        "compress": {label: {k: v for k, v in c.items() if k != "spectra"}
                     for label, c in compressed.items()},
    }, markdown)


if __name__ == "__main__":
    main()
