"""The per-process entry point: what torchrun (or ``meshlearn train --backend dist``) runs.

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m meshlearn.distributed.worker --config run.toml --out runs/x        # or: meshlearn worker ...

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
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshlearn.config import ConfigError, RunConfig, load_config
from meshlearn.distributed.driver import DistDriver
from meshlearn.distributed.groups import anchor_id, anchors, build_groups, verifier_rank, world_size
from meshlearn.distributed.health import EXIT_PEER_FAILURE, Health, WorkerFailure, process_name, store_client
from meshlearn.distributed.resume import refuse_resume
from meshlearn.distributed.settings import derive_deadlines
from meshlearn.elastic.membership import JOIN_ENV
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.split import init_model, split_model
from meshlearn.protocol.plugin import stage_modules
from meshlearn.train.assemble import build_worker, load_corpus
from meshlearn.train.closing import rate
from meshlearn.train.signals import GracefulStop
from meshlearn.train.trainer import Trainer


@dataclass
class Session:
    """This process's place in the run, and its liveness monitor."""

    rank: int
    world: int
    local_world: int
    mesh: MeshShape
    me: WorkerId | None  # None: the verifier process, or an anchor stage
    device: torch.device
    comm: str
    health: Health
    run_dir: Path
    anchor: WorkerId | None = None  # an anchor stage's id (distributed/anchor.py)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(name, None, "not set: start workers with torchrun or `meshlearn train "
                                          "--backend dist`, which set RANK, WORLD_SIZE, MASTER_ADDR/PORT")
        return default
    return int(value)


def start_session(cfg: RunConfig, run_dir: Path) -> Session:
    """Join the process group (deadline: dist.init_timeout_s) and start the heartbeat."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
    expected = world_size(cfg, mesh)
    if world != expected:
        extra = (f" + anchor.z × mesh.stages = {anchors(cfg) * mesh.stages} anchor stages" if anchors(cfg)
                 else " + 1 verifier (verify.name = sentinel)" if expected > mesh.world_size else "")
        raise ConfigError("mesh", f"{mesh.replicas}×{mesh.stages}",
                          f"needs {expected} processes (mesh.replicas × mesh.stages{extra}) but "
                          f"WORLD_SIZE = {world}")
    verifying = verifier_rank(cfg, mesh) is not None
    cuda = torch.cuda.is_available() and not verifying  # the verifier relays over gloo (CPU)
    comm = cfg.dist.comm if cfg.dist.comm != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if comm == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = cfg.dist.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    scope = None
    if cfg.elastic.enabled:
        from meshlearn.elastic.binding import interface_of

        # gloo's sockets on elastic.host's interface only; a dead peer outside this worker's
        # pipeline row is not this worker's failure.
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(cfg.elastic.host)
        # its row's ranks once the row trains (elastic/driver.py: _link_row); the verifier's
        # failures, and the deaths it sees, are the whole run's (every row's links pass it)
        scope = {rank} if rank < mesh.world_size else None
    if not cfg.elastic.enabled:  # elastic rows link over the store: no world group (joiners)
        dist.init_process_group(comm, timeout=timedelta(seconds=cfg.dist.init_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadlines = derive_deadlines(cfg.dist, cfg.link, 0, 0, 0, 1)
    store = store_client(host, port, deadlines.dead_after_s)
    owner = os.environ.get("MESHLEARN_STORE_OWNER", f"rendezvous store at {host}:{port}")
    health = Health(store, mesh, rank, cfg.dist.heartbeat_s, deadlines.dead_after_s, owner, world=world,
                    scope=scope, anchors=anchors(cfg))
    if cfg.elastic.enabled and scope is None:
        # The verifier: with no world group to wait for, a worker may still be starting (importing,
        # on a loaded host) when this watch begins; it watches them once its links are built
        # (verifier.elastic_relay), so a slow start is not taken for a death that ends the run.
        health.ignore(set(range(mesh.world_size)))
    health.start()
    me = mesh.worker(rank) if rank < mesh.world_size else None  # None: the verifier, or an anchor
    anchor = None
    if me is None and anchors(cfg):
        z, s = divmod(rank - mesh.world_size, mesh.stages)
        anchor = anchor_id(mesh, z, s)
    return Session(rank, world, local_world, mesh, me, device, comm, health, Path(run_dir), anchor)


def build_driver(cfg: RunConfig, session: Session) -> DistDriver:
    """This process's worker and its groups. Group creation is collective: same order everywhere."""
    mesh, me = session.mesh, session.me
    # Elastic runs: torchft owns the DP axis, and each row links its own stages (elastic/links.py).
    groups = None if cfg.elastic.enabled else build_groups(cfg, mesh, session.rank)
    # Every process builds the same seeded unsplit model and keeps its stage: identical replicas.
    stages = stage_modules(cfg, split_model(init_model(cfg.model, cfg.seed), mesh.stages))
    module = stages[me.stage].to(session.device)
    worker = build_worker(cfg, me, module)
    if cfg.elastic.enabled:
        from meshlearn.elastic.worker import build_elastic_driver

        return build_elastic_driver(cfg, session, worker)
    driver = DistDriver(cfg, worker, session.health, session.device, session.comm, groups.dp, groups.links,
                        workers_group=groups.workers, relay=verifier_rank(cfg, mesh))
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
    try:
        session = start_session(cfg, run_dir)
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
        from meshlearn.distributed.verifier import run_verifier  # it uses this module's helpers

        return run_verifier(cfg, run_dir, resume, session)
    name = str(session.me)
    trainer = None

    def flush() -> None:
        sys.stdout.flush()
        sys.stderr.flush()

    session.health.on_exit = flush
    try:
        if cfg.data.tokenizer in ("bpe", "model") and not resume and os.environ.get(JOIN_ENV) != "1":
            _train_tokenizer_once(cfg, run_dir, session)
        # SIGINT/SIGTERM (from the launcher, torchrun or a scheduler): every process stops after
        # the same step, agreed through the rendezvous store (meshlearn/train/signals.py).
        stop = GracefulStop(store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                         cfg.dist.init_timeout_s), repeat="ignore").install()
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


def _train_tokenizer_once(cfg: RunConfig, run_dir: Path, session: Session) -> None:
    """BPE is trained by rank 0 and cached in the run folder; the others wait, then load it
    (elastic runs have no world group: they wait on a key of the store)."""
    if session.rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        load_corpus(cfg, Path(run_dir))
        if cfg.elastic.enabled:
            session.health.store.set("tokenizer/ready", "1")
    if cfg.elastic.enabled:
        end = time.monotonic() + cfg.dist.init_timeout_s
        while not session.health.store.check(["tokenizer/ready"]):
            session.health.check()
            if time.monotonic() > end:
                raise TimeoutError(f"rank 0's tokenizer did not come within dist.init_timeout_s = "
                                   f"{cfg.dist.init_timeout_s:g} s")
            time.sleep(0.05)
        return
    work = dist.barrier(async_op=True)
    session.health.wait_work(work, "the wait for rank 0's tokenizer", cfg.dist.init_timeout_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlearn worker",
                                     description="one worker process of a dist run (torchrun runs this)")
    add_run_arguments(parser)
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; later wins)")
    parser.add_argument("--out", default="runs/latest", help="run folder (default: runs/latest)")
    parser.add_argument("--resume", metavar="RUN", help="continue RUN from its last complete checkpoint")
    parser.add_argument("--join", metavar="HOST:PORT",
                        help="join the running elastic run whose store is HOST:PORT (in RUN/elastic.json; "
                             "--out names the run folder): take a free slot, heal from a live peer, train")


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
