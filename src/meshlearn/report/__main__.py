"""``python -m meshlearn.report RUN [RUN ...] [--out DIR]``: render a report from a shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshlearn.report import render_report


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, render, print the index path; exit 2 on a missing run folder."""
    parser = argparse.ArgumentParser(prog="python -m meshlearn.report", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run folder(s) to report on")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    args = parser.parse_args(argv)
    try:
        index = render_report(args.runs, args.out)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
