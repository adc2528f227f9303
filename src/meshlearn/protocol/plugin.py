"""Morphs as a trainer plugin: every ``protocol.every_steps`` steps (or ``every_tokens`` tokens, or
``every_seconds`` of virtual time: ``protocol/schedule.py``), at a drain point it asks for, every
boundary of the mesh gets a fresh transform (``protocol/morph.py``).

Each pipeline boundary's transform travels as a ``morph`` message from the upper stage's replica
to the lower one's, over their link: the simulator charges its bytes and time like any message
(``SimDriver.send_control``), and the receiver folds only what arrived. The virtual clock does
not charge the folds' compute (measured here as ``protocol_morph_wall_s``: the paper's ~0.05 s
per morph is mostly drawing the fp64 transforms).

With ``protocol.keep_snapshots > 0`` it also keeps, in ``RUN/protocol/``, replica 0's stages just
before and after each of the last morphs with samples of their boundary traffic
(``protocol/snapshots.py``): what the attack commands need. Its cost is measured apart
(``protocol_snapshot_wall_s``), since it is no part of the protocol.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from meshlearn.compress.codecs import Encoded
from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.llama import Decoder
from meshlearn.protocol.model import ProtocolDecoder, protocol_model
from meshlearn.protocol.morph import Holder, StageMorph, morph_mesh
from meshlearn.protocol.schedule import MorphSchedule
from meshlearn.protocol.settings import ProtocolConfig
from meshlearn.protocol.snapshots import (
    SNAPSHOT_DIR,
    list_snapshots,
    prune_snapshots,
    take_snapshot,
    traffic_windows,
    write_snapshot,
)
from meshlearn.protocol.transforms import Transform


def stage_modules(cfg, stages: list[Decoder]) -> list[Decoder | ProtocolDecoder]:
    """The stage modules a run trains: the protocol model's unless ``protocol.morph = off``
    (``cfg``: the resolved RunConfig; every replica of a stage gets the same Q's)."""
    if cfg.protocol.morph == "off":
        return stages
    return [protocol_model(stage, cfg.seed) for stage in stages]


def state_holders(w: WorkerId, worker: Worker, callbacks: dict[str, Callback]) -> dict[str, Holder]:
    """What besides the optimizer keeps state in worker ``w``'s parameter bases: its DP strategy
    and the plugins registered before this one (``basis_state``, ``meshlearn.basis``)."""
    holders: dict[str, Holder] = {}
    if worker.dp is not None:
        holders["dp"] = worker.dp.basis_state
    for name, callback in callbacks.items():
        holders[f"plugin.{name}"] = partial(callback.basis_state, w)
    return holders


def run_clock(driver) -> float:
    """The run's clock in seconds: the simulator's virtual time at the last step's end."""
    return driver.record_fields()["sim_time_s"]


class MorphCallback(Callback):
    """Morphs every boundary on its schedule. Usage: set ``protocol.morph = orthogonal`` (and
    optim.name = muon); the events ``protocol_morph`` in metrics.jsonl say when, with the bytes
    the transforms cost on the pipeline links."""

    def __init__(self, cfg: ProtocolConfig, seed: int, workers: dict[WorkerId, Worker], driver,
                 mesh: MeshShape, snapshots: SnapshotKeeper | None = None,
                 callbacks: dict[str, Callback] | None = None, tokens_per_step: int = 0):
        self.cfg = cfg
        self.schedule = MorphSchedule(cfg, tokens_per_step, lambda: run_clock(driver),
                                      getattr(driver, "lookahead", 0))
        self.seed = seed
        self.snapshots = snapshots
        self.workers = workers
        self.driver = driver
        self.mesh = mesh
        self.morphs = {w: StageMorph(worker.module, worker.optimizer,
                                     holders=state_holders(w, worker, callbacks or {}))
                       for w, worker in workers.items()}
        self.epoch = 0  # morphs applied so far
        self.bytes = 0
        self.wall_s = 0.0

    def drains_after(self, done: int) -> bool:
        return self.schedule.drains_after(done)

    def on_step_end(self, step: int, report) -> StepOutput:
        self.schedule.step_end(step + 1)
        return StepOutput()

    def on_drain(self, done: int) -> list[dict]:
        if not self.schedule.due(done):
            return []  # a drain point someone else asked for
        assert self.driver.drained, "morphs happen at drain points only"
        if self.snapshots is not None:
            self.snapshots.take(self.epoch, done)
        started = time.perf_counter()
        stats = morph_mesh(self.morphs, self.mesh, self.cfg.morph, self.cfg.epsilon, self.seed,
                           self.epoch, self._sender(done))
        wall = time.perf_counter() - started
        self.schedule.morphed()
        self.epoch += 1
        self.bytes += stats.boundary_bytes
        self.wall_s += wall
        if self.snapshots is not None:
            self.snapshots.take(self.epoch, done)
            self.snapshots.prune()
        return [{"kind": "event", "step": done, "event": "protocol_morph", "epoch": self.epoch,
                 "transforms": stats.transforms, "morph_bytes": stats.boundary_bytes,
                 "morph_wall_s": wall}]

    def _sender(self, step: int):
        def send(src: WorkerId, dst: WorkerId, t: Transform) -> tuple[torch.Tensor, bool]:
            payload = Encoded({"transform": t.matrix.clone()}, tuple(t.matrix.shape), t.matrix.dtype,
                              {"orthogonal": int(t.orthogonal)})
            message = Message("morph", step, 0, src, dst, payload, version=self.workers[src].version)
            got = self.driver.send_control(message).payload
            return got.tensors["transform"], bool(got.meta["orthogonal"])
        return send

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "bytes": self.bytes, "schedule": self.schedule.state_dict(),
                "masters": {str(w): m.master.state_dict() for w, m in self.morphs.items()}}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        self.epoch, self.bytes = state["epoch"], state["bytes"]
        self.schedule.load_state_dict(state["schedule"])
        for w, master in state["masters"].items():
            self.morphs[WorkerId.parse(w)].master.load_state_dict(master)

    def summary(self) -> dict:
        master_bytes = max((sum(t.numel() * t.element_size() for t in m.master.tensors.values())
                            for m in self.morphs.values()), default=0)
        return {"protocol_morphs": self.epoch, "protocol_morph_bytes": self.bytes,
                "protocol_morph_wall_s": self.wall_s, "protocol_master_bytes_peak": master_bytes,
                **(self.snapshots.summary() if self.snapshots is not None else {})}


class SnapshotKeeper:
    """Writes replica 0's stages with their boundary traffic into ``RUN/protocol/`` (before and
    after each morph) and keeps the files of the last ``keep`` morphs."""

    def __init__(self, cfg, run_dir: Path, workers: dict[WorkerId, Worker], resume_step: int | None):
        self.cfg = cfg  # the resolved RunConfig
        self.folder = Path(run_dir) / SNAPSHOT_DIR
        for _, step, path in list_snapshots(self.folder):
            if resume_step is not None and step > resume_step:
                path.unlink()  # written after the checkpoint this run resumes from: redone
        self.stages = [workers[WorkerId(0, s)].module for s in range(cfg.mesh.stages)]
        self._tokens = None
        self.wall_s = 0.0

    def _train_tokens(self):
        if self._tokens is None:  # read once, at the first snapshot (as the curvature probe does)
            from meshlearn.train.assemble import load_corpus

            self._tokens = load_corpus(self.cfg, self.folder.parent).splits.train
        return self._tokens

    def take(self, epoch: int, step: int) -> None:
        started = time.perf_counter()
        tokens, p, seq_len = self._train_tokens(), self.cfg.protocol, self.cfg.model.seq_len
        passive = traffic_windows(tokens, p.traffic_tokens, seq_len, self.cfg.seed, "traffic",
                                  epoch, step)
        probe = traffic_windows(tokens, p.traffic_tokens, seq_len, self.cfg.seed, "probe")
        write_snapshot(self.folder, take_snapshot(self.stages, epoch, step, passive, probe))
        self.wall_s += time.perf_counter() - started

    def prune(self) -> None:
        prune_snapshots(self.folder, 2 * self.cfg.protocol.keep_snapshots)

    def summary(self) -> dict:
        files = list(self.folder.glob("epoch-*-step-*.pt"))
        return {"protocol_snapshot_wall_s": self.wall_s,
                "protocol_snapshot_bytes": sum(f.stat().st_size for f in files)}


def protocol_plugin(ctx: PluginContext) -> MorphCallback | None:
    cfg = ctx.cfg
    if cfg.protocol.morph in ("off", "none"):
        return None
    keeps = cfg.protocol.keep_snapshots > 0 and ctx.writer
    return MorphCallback(cfg.protocol, cfg.seed, ctx.workers, ctx.driver,
                         MeshShape(cfg.mesh.replicas, cfg.mesh.stages),
                         SnapshotKeeper(cfg, ctx.run_dir, ctx.workers, ctx.resume_step) if keeps else None,
                         dict(ctx.callbacks), cfg.train.batch_size * cfg.model.seq_len)
