"""Morphs as a trainer plugin: every ``protocol.every_steps`` steps (or ``every_tokens`` tokens, or
``every_seconds`` of virtual time: ``protocol/schedule.py``), at a drain point it asks for, every
boundary of the mesh gets a fresh transform (``protocol/morph.py``).

Each pipeline boundary's transform travels as a ``morph`` message from the upper stage's replica
to the lower one's, over their link: the simulator charges its bytes and time like any message
(the run's ``ControlChannel``, ``PluginContext.control``), and the receiver folds only what
arrived. The virtual clock does
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
from meshlearn.data.run_data import RunData
from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.mesh.driver import Clock, ControlChannel, Driver
from meshlearn.mesh.messages import Message
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import Worker
from meshlearn.models.split import stage_layer_ranges
from meshlearn.protocol.morph import Holder, StageMorph, epoch_stats, morph_mesh, morph_worker
from meshlearn.protocol.schedule import MorphSchedule
from meshlearn.protocol.snapshots import (
    SNAPSHOT_DIR,
    list_snapshots,
    prune_snapshots,
    take_snapshot,
    traffic_windows,
    write_snapshot,
)
from meshlearn.protocol.transforms import Transform


def state_holders(w: WorkerId, worker: Worker, callbacks: dict[str, Callback]) -> dict[str, Holder]:
    """What besides the optimizer keeps state in worker ``w``'s parameter bases: its DP strategy
    and the plugins registered before this one (``basis_state``, ``meshlearn.basis``)."""
    holders: dict[str, Holder] = {}
    if worker.dp is not None:
        holders["dp"] = worker.dp.basis_state
    for name, callback in callbacks.items():
        holders[f"plugin.{name}"] = partial(callback.basis_state, w)
    return holders


def transform_of(message: Message, d: int) -> tuple[torch.Tensor, bool]:
    """The (T, orthogonal) a received ``morph`` message carries, checked before any fold: a
    finite fp64 d×d matrix, orthogonal to 1e-8 if it says so, else well enough conditioned to
    invert (a peer's mistake or lie would otherwise break the model's function silently)."""
    t = message.payload.tensors.get("transform")
    orthogonal = bool(message.payload.meta.get("orthogonal", 0))
    ok = (t is not None and t.dtype == torch.float64 and tuple(t.shape) == (d, d)
          and bool(torch.isfinite(t).all()))
    if ok and orthogonal:
        ok = float((t.T @ t - torch.eye(d, dtype=t.dtype, device=t.device)).abs().max()) <= 1e-8
    elif ok:
        sv = torch.linalg.svdvals(t)
        ok = float(sv[-1]) > 0 and float(sv[0] / sv[-1]) < 1e6
    if not ok:
        what = "orthogonal" if orthogonal else "invertible"
        raise RuntimeError(f"worker {message.dst}: the morph transform from {message.src} is not a "
                           f"finite {what} fp64 {d}×{d} matrix; refusing to fold it")
    return t, orthogonal


class MorphCallback(Callback):
    """Morphs every boundary on its schedule. Usage: set ``protocol.morph = orthogonal`` (and
    optim.name = muon); the events ``protocol_morph`` in metrics.jsonl say when, with the bytes
    the transforms cost on the pipeline links.

    In the simulator it morphs every worker at once (``morph_mesh``). Under the distributed driver
    each process morphs its own worker (``morph_worker``): it receives the boundary transform above
    its stage from the previous stage's process as a ``morph`` message, draws its own, sends the one
    below to the next stage's, and reports the mesh's totals (``epoch_stats``)."""

    def __init__(self, cfg, workers: dict[WorkerId, Worker], driver: Driver, clock: Clock,
                 control: ControlChannel, snapshots: SnapshotKeeper | None = None,
                 callbacks: dict[str, Callback] | None = None):
        self.cfg = cfg.protocol
        self.seed = cfg.seed
        self.mesh = MeshShape(cfg.mesh.replicas, cfg.mesh.stages)
        # Seconds are the run's clock at a step's end (refused under dist: settings.py).
        self.schedule = MorphSchedule(self.cfg, cfg.train.batch_size * cfg.model.seq_len,
                                      clock.elapsed_s, driver.lookahead)
        self.snapshots = snapshots
        self.workers = workers
        self.driver = driver
        self.control = control
        self.morphs = {w: StageMorph(worker.module, worker.optimizer,
                                     holders=state_holders(w, worker, callbacks or {}))
                       for w, worker in workers.items()}
        self.local = len(workers) < self.mesh.replicas * self.mesh.stages  # one process per worker
        self.d = cfg.model.d_model
        self.stage_layers = [len(r) for r in stage_layer_ranges(cfg.model.n_layer, cfg.mesh.stages)]
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
        c = self.cfg
        if self.local:
            (me, morph), = self.morphs.items()
            morph_worker(morph, me, self.mesh, c.morph, c.epsilon, self.seed, self.epoch,
                         self._send_to(done), self._receive)
            stats = epoch_stats(self.mesh, self.stage_layers, self.d)
        else:
            stats = morph_mesh(self.morphs, self.mesh, c.morph, c.epsilon, self.seed, self.epoch,
                               self._sender(done))
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

    def _message(self, step: int, src: WorkerId, dst: WorkerId, t: Transform) -> Message:
        payload = Encoded({"transform": t.matrix.clone()}, tuple(t.matrix.shape), t.matrix.dtype,
                          {"orthogonal": int(t.orthogonal)})
        return Message("morph", step, 0, src, dst, payload, version=self.workers[src].version)

    def _sender(self, step: int):
        """Every worker in this process (the simulator): the message crosses the link and its
        receiver takes it at once."""
        def send(src: WorkerId, dst: WorkerId, t: Transform) -> tuple[torch.Tensor, bool]:
            self.control.send_control(self._message(step, src, dst, t))
            return self._receive(src, dst)
        return send

    def _send_to(self, step: int):
        """One worker per process: queued on the link to the next stage's process."""
        def send(src: WorkerId, dst: WorkerId, t: Transform) -> None:
            self.control.send_control(self._message(step, src, dst, t))
        return send

    def _receive(self, src: WorkerId, me: WorkerId) -> tuple[torch.Tensor, bool]:
        return transform_of(self.control.receive_control(src, "morph", "the boundary transform"), self.d)

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

    def __init__(self, cfg, run_dir: Path, workers: dict[WorkerId, Worker], resume_step: int | None,
                 data: RunData):
        self.cfg = cfg  # the resolved RunConfig
        self.folder = Path(run_dir) / SNAPSHOT_DIR
        for _, step, path in list_snapshots(self.folder):
            if resume_step is not None and step > resume_step:
                path.unlink()  # written after the checkpoint this run resumes from: redone
        self.stages = [workers[WorkerId(0, s)].module for s in range(cfg.mesh.stages)]
        self.data = data
        self.wall_s = 0.0

    def take(self, epoch: int, step: int) -> None:
        started = time.perf_counter()
        tokens, p, seq_len = self.data.train, self.cfg.protocol, self.cfg.model.seq_len
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
    if ctx.control is None:
        raise RuntimeError("protocol.morph needs a runtime with a control channel (sim or dist)")
    keeps = cfg.protocol.keep_snapshots > 0 and ctx.writer  # refused under dist (settings.py)
    snapshots = SnapshotKeeper(cfg, ctx.run_dir, ctx.workers, ctx.resume_step, ctx.data) if keeps else None
    return MorphCallback(cfg, ctx.workers, ctx.driver, ctx.clock, ctx.control, snapshots, dict(ctx.callbacks))
