"""The ``meshlearn`` command: train, resume, report, sample. A thin entry point over the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import meshlearn
from meshlearn.config import ConfigError, load_config


def _train(args: argparse.Namespace) -> int:
    from meshlearn.train.trainer import Trainer

    if args.resume:
        run_dir = Path(args.resume)
        config = run_dir / "config.toml"
        if not config.is_file():
            raise ConfigError("--resume", str(run_dir), "not a run folder (no config.toml in it)")
        cfg = load_config(config, args.set)
    else:
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.out)
    summary = Trainer(cfg, run_dir, resume=bool(args.resume)).train()
    val = summary["final_val_loss"]
    print(f"done: {summary['steps']} steps, val loss {val:.4f}, "
          f"{summary['sim_tokens_per_s']:.0f} tok/s virtual ({summary['compute_model']}), "
          f"{summary['wall_tokens_per_s']:.0f} tok/s wall → {run_dir}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from meshlearn.report import render_report

    index = render_report([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    print(f"report: {index}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from meshlearn.sample import sample_from_run

    print(sample_from_run(Path(args.run), args.prompt, args.tokens, args.temperature, args.seed))
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
    train.set_defaults(func=_train)

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
