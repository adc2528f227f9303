"""The ``meshlearn`` command: train, resume, report, sample, compress. A thin entry point over the
library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import meshlearn
from meshlearn.config import ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    from meshlearn.train.trainer import Trainer

    if args.backend:  # --backend is short for --set backend=...
        args.set = [*args.set, f"backend={args.backend}"]
    if args.resume:
        run_dir = Path(args.resume)
        config = run_dir / "config.toml"
        if not config.is_file():
            raise ConfigError("--resume", str(run_dir), "not a run folder (no config.toml in it)")
        cfg = load_config(config, args.set)
    else:
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.out)
    if cfg.backend == "dist":
        from meshlearn.distributed.launch import launch_local

        where = ["--resume", str(run_dir)] if args.resume else [
            *(["--config", args.config] if args.config else []), "--out", str(run_dir)]
        return launch_local([*where, *(x for o in args.set for x in ("--set", o))], cfg, run_dir)
    summary = Trainer(cfg, run_dir, resume=bool(args.resume)).train()
    val = summary["final_val_loss"]
    print(f"done: {summary['steps']} steps, val loss {val:.4f}, "
          f"{summary['sim_tokens_per_s']:.0f} tok/s virtual ({summary['compute_model']}), "
          f"{summary['wall_tokens_per_s']:.0f} tok/s wall → {run_dir}")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from meshlearn.distributed.worker import resolve_run, run

    return run(*resolve_run(args))


def _report(args: argparse.Namespace) -> int:
    from meshlearn.report import render_report

    index = render_report([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    print(f"report: {index}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from meshlearn.sample import sample_from_run

    print(sample_from_run(Path(args.run), args.prompt, args.tokens, args.temperature, args.seed))
    return 0


def _compress(args: argparse.Namespace) -> int:
    from meshlearn.compressibility import PIPELINES, CompressSettings, compress_run
    from meshlearn.compressibility.run import OUT_DIR

    try:
        keeps = tuple(float(k) for k in args.keep.split(","))
    except ValueError:
        raise ConfigError("--keep", args.keep, "comma-separated fractions, e.g. 0.75,0.5,0.25") from None
    if not all(0 < k <= 1 for k in keeps):
        raise ConfigError("--keep", args.keep, "every fraction must be in (0, 1]")
    pipelines = tuple(p.strip() for p in args.pipelines.split(","))
    unknown = [p for p in pipelines if p not in PIPELINES]
    if unknown:
        raise ConfigError("--pipelines", unknown[0], f"allowed: {sorted(PIPELINES)}")
    if args.calibration < 1:
        raise ConfigError("--calibration", args.calibration, "must be >= 1 sequence")
    out = Path(args.out) if args.out else Path(args.run) / OUT_DIR
    result = compress_run(Path(args.run), CompressSettings(keeps, pipelines, args.calibration), out)
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"uncompressed: val loss {result['uncompressed_val_loss']:.4f}, "
          f"mean stable rank {result['stable_rank']['mean']:.2f}")
    for r in result["results"]:
        account = r["account"]
        print(f"{r['pipeline']:>7} keep {r['keep']:.2f}: val loss {r['val_loss']:.4f} "
              f"(kept {account['kept_in_compressed']:.3f} of compressed matrices, "
              f"{account['kept_total']:.3f} of all parameters)")
    print(f"compress: {out / 'compress.md'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlearn", description=meshlearn.__doc__)
    parser.add_argument("--version", action="version", version=f"meshlearn {meshlearn.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train on a simulated mesh (or resume a run)")
    train.add_argument("--config", help="TOML config file (default: built-in defaults)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set mesh.stages=2 (repeatable; later wins)")
    train.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    train.add_argument("--resume", metavar="RUN", help="continue RUN from its last checkpoint")
    train.add_argument("--backend", choices=["sim", "dist"],
                       help="sim: one process, virtual clock; dist: one local process per worker "
                            "(short for --set backend=...; see docs/distributed.md)")
    train.set_defaults(func=_train)

    worker = sub.add_parser("worker", help="one worker process of a dist run: what torchrun starts "
                                           "(rank and rendezvous from its environment)")
    worker.add_argument("--config", help="TOML config file (default: built-in defaults)")
    worker.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; later wins)")
    worker.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    worker.add_argument("--resume", metavar="RUN", help="continue RUN from its last complete checkpoint")
    worker.set_defaults(func=_worker)

    report = sub.add_parser("report", help="plots and an HTML summary of one or more runs")
    report.add_argument("runs", nargs="+", help="run folders")
    report.add_argument("--out", help="output folder (default: RUN/report, or RUN/report-compare)")
    report.set_defaults(func=_report)

    sample = sub.add_parser("sample", help="generate text from a run's latest checkpoint")
    sample.add_argument("run", help="run folder")
    sample.add_argument("--prompt", default="\n", help="text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sample.add_argument("--temperature", type=float, default=0.8)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=_sample)

    compress = sub.add_parser("compress", help="validation loss after SVD compression, stable ranks, spectra")
    compress.add_argument("run", help="run folder (uses its checkpoint, corpus and validation batches)")
    compress.add_argument("--keep", default="0.75,0.5,0.25",
                          help="target fractions of each block matrix's parameters to keep (comma-separated)")
    compress.add_argument("--pipelines", default="svd,asvd,svdllm",
                          help="comma-separated: svd (plain truncated), asvd (α=0.5), svdllm (whitened)")
    compress.add_argument("--calibration", type=int, default=64,
                          help="train-split sequences of seq_len tokens for asvd/svdllm (default: 64)")
    compress.add_argument("--out", help="output folder (default: RUN/compress)")
    compress.set_defaults(func=_compress)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"meshlearn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
