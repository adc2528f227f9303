"""The per-process entry point: what torchrun (or ``meshlearn train --backend dist``) runs.
It composes the runtimes: the dist one, and the elastic layer on top of it with ``elastic.enabled``
(its driver, a joiner's slot, the banned-identity check, the verifier's row membership).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m meshlearn.entry.worker --config run.toml --out runs/x        # or: meshlearn worker ...

It reads the rank and the rendezvous from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joins the process group, starts its heartbeat, and
runs the ordinary Trainer with a DistDriver for its one worker: rank = replica · P + stage.
Any failure ends the process with one line naming the worker at fault — its own, or the one all
processes agreed on through the store — and a non-zero exit code; nothing is left half-written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from meshlearn.assemble import build_worker
from meshlearn.cluster.control_store import control_connector
from meshlearn.cluster.links import cluster_connector
from meshlearn.config import RunConfig, load_config
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.groups import anchors, build_groups, verifier_rank
from meshlearn.distributed.health import (
    EXIT_PEER_FAILURE,
    WorkerFailure,
    process_name,
    store_client,
    use_store,
)
from meshlearn.distributed.session import Session, start_session, train_tokenizer_once
from meshlearn.elastic.binding import interface_of
from meshlearn.elastic.evictions import elastic_relay, refuse_resume_when_verified
from meshlearn.elastic.membership import JOIN_ENV
from meshlearn.entry.arguments import add_worker_arguments
from meshlearn.entry.plugins import register_builtin_plugins
from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import MeshShape
from meshlearn.models.split import init_model, split_model
from meshlearn.protocol.model import stage_modules
from meshlearn.train.closing import rate
from meshlearn.train.signals import GracefulStop
from meshlearn.train.trainer import Trainer


def refuse_resume(cfg: RunConfig, run_dir: Path) -> None:
    """What a dist run cannot resume from yet, refused in one line. The launcher checks before it
    spawns anything, and every worker again (one started by hand has no launcher in front of it)."""
    if anchors(cfg):
        raise ConfigError("--resume", str(run_dir), "a dist run with an anchor circuit (anchor.z > 0) cannot "
                                                    "resume yet (its passes in flight are not checkpointed)")
    refuse_resume_when_verified(cfg, run_dir)


def build_driver(cfg: RunConfig, session: Session) -> DistDriver:
    """This process's worker and its groups. Group creation is collective: same order everywhere."""
    mesh, me = session.mesh, session.me
    # Elastic runs: torchft owns the DP axis, and each row links its own stages (elastic/links.py).
    groups = None if cfg.elastic.enabled else build_groups(cfg, mesh, session.rank,
                                                           connector=session.connector)
    # Every process builds the same seeded unsplit model and keeps its stage: identical replicas.
    stages = stage_modules(cfg, split_model(init_model(cfg.model, cfg.seed), mesh.stages))
    module = stages[me.stage].to(session.device)
    worker = build_worker(cfg, me, module)
    if cfg.elastic.enabled:
        from meshlearn.elastic.worker import build_elastic_driver

        return build_elastic_driver(cfg, session, worker)
    driver = DistDriver(cfg, worker, session.health, session.device, session.comm, groups.dp, groups.links,
                        workers_group=groups.workers, relay=verifier_rank(cfg, mesh), framed=groups.framed,
                        counters=groups.counters)
    if anchors(cfg):
        from meshlearn.distributed.anchor import AnchorClient

        driver.anchor = AnchorClient(cfg, worker, groups.anchor_links, session.health, session.device,
                                     session.run_dir)
    return driver


def run(cfg: RunConfig, run_dir: Path, resume: bool) -> int:
    """Train this process's worker; returns the exit code (never hangs: every wait has a deadline)."""
    cfg = dataclasses.replace(cfg, backend="dist")  # recorded in config.toml: --resume stays dist
    if resume:
        refuse_resume(cfg, run_dir)
    if cfg.elastic.enabled:
        from meshlearn.elastic.evictions import refuse_banned_start

        refuse_banned_start(cfg)  # SENTINEL banned this identity: it never comes back
    connector = cluster_connector(cfg)  # a cluster run's authenticated streams (None: plain ones)
    if connector is not None:
        # a cluster host's launcher started us with its port and key: the rendezvous is the
        # coordinator's control service (checked first: a half-given credential is one line)
        use_store(control_connector(cfg.cluster.coordinator))
    try:
        # elastic: gloo's sockets on elastic.host's interface (asked once the rank checks out)
        interface = (lambda: interface_of(cfg.elastic.host)) if cfg.elastic.enabled else None
        session = start_session(cfg, run_dir, gloo_interface=interface, connector=connector)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — e.g. a peer that never came up
        rank = os.environ.get("RANK", "?")
        mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
        name = process_name(mesh, int(rank), anchors(cfg)) if rank.isdigit() else "?"
        print(f"meshlearn worker {name} (rank {rank}): error: could not join the run within "
              f"dist.init_timeout_s = {cfg.dist.init_timeout_s:g} s: {type(err).__name__}: "
              f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}", file=sys.stderr)
        return 1
    if session.anchor is not None:
        from meshlearn.distributed.anchor import run_anchor

        return run_anchor(cfg, run_dir, session)
    if session.me is None:
        from meshlearn.distributed.verifier import run_verifier

        return run_verifier(cfg, run_dir, resume, session,
                            elastic_links=elastic_relay if cfg.elastic.enabled else None)
    name = str(session.me)
    trainer = None

    def flush() -> None:
        sys.stdout.flush()
        sys.stderr.flush()

    session.health.on_exit = flush
    try:
        if cfg.data.tokenizer in ("bpe", "model") and not resume and os.environ.get(JOIN_ENV) != "1":
            train_tokenizer_once(cfg, run_dir, session)
        # SIGINT/SIGTERM (from the launcher, torchrun or a scheduler): every process stops after
        # the same step, agreed through the rendezvous store (meshlearn/train/signals.py).
        stop = GracefulStop(store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                         cfg.dist.init_timeout_s), repeat="ignore").install()
        register_builtin_plugins()
        trainer = Trainer(cfg, run_dir, resume=resume, progress=True,
                          driver=lambda resolved: build_driver(resolved, session), stop=stop)
        summary = trainer.train()
        trainer.driver.close()
        end = trainer.closing(summary, f"{rate(summary['wall_tokens_per_s'], 'wall')} over "
                                       f"{session.world} processes")
        if trainer.writer:
            print(end.line)
        flush()
        if cfg.elastic.enabled or anchors(cfg):  # peers may be gone, or a receive from an anchor
            # still posted: tearing the world group down could block
            os._exit(end.code)
        if dist.is_initialized():  # untrusted links (dist.trusted_links): there is no group
            dist.destroy_process_group()
        return end.code
    except WorkerFailure as err:
        message, code = str(err), getattr(err, "exit_code", session.health.exit_code)  # evicted: its own
        if code != EXIT_PEER_FAILURE:
            message = f"left the run: {message}"
    except BaseException as err:  # noqa: BLE001 — our own failure: publish it, naming ourselves
        traceback.print_exc()
        message, code = session.health.abort(f"worker {name} failed: {type(err).__name__}: {err}"), 1
    print(f"meshlearn worker {name}: error: {message}", file=sys.stderr)
    flush()
    # Skip interpreter teardown: destroying groups with a dead peer can block, and the threads
    # may sit in C++ receives. Files are safe: every write was atomic, metrics lines are flushed.
    os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlearn worker",
                                     description="one worker process of a dist run (torchrun runs this)")
    add_worker_arguments(parser)
    return parser


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, Path, bool]:
    """The same (config, run folder, resume) resolution as ``meshlearn train``; ``--join``: the
    running elastic run's config, this process set up for a free slot of it."""
    if getattr(args, "join", None):
        from meshlearn.elastic.worker import prepare_join

        return prepare_join(args.join, Path(args.out)), Path(args.out), False
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").is_file():
            raise ConfigError("--resume", str(run_dir), "not a run folder (no config.toml in it)")
        return load_config(run_dir / "config.toml", args.set), run_dir, True
    return load_config(args.config, args.set), Path(args.out), False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(*resolve_run(args))
    except (ConfigError, FileNotFoundError) as err:  # before any training: nothing to clean up
        print(f"meshlearn worker: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
