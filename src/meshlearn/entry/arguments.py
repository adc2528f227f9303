"""The arguments of one worker process, shared by ``meshlearn worker`` and ``python -m
meshlearn.entry.worker`` (what torchrun starts). Imports nothing heavy: ``meshlearn --help`` builds
this parser without torch."""

from __future__ import annotations

import argparse


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; later wins)")
    parser.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    parser.add_argument("--resume", metavar="RUN", help="continue RUN from its last complete checkpoint")
    parser.add_argument("--join", metavar="HOST:PORT",
                        help="join the running elastic run whose store is HOST:PORT (in RUN/elastic.json; "
                             "--out names the run folder): take a free slot, heal from a live peer, train")
