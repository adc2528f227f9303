"""What a run records for its report, as trainer plugins (``meshlearn.hooks``).

- ``timeline``: arms the driver's ``TimelineRecorder`` for the steps of ``report.timeline_steps``
  and writes ``timeline.json`` (``timeline.<worker>.json`` per process under ``--backend dist``)
  once they have run.
- ``tensorboard`` (``report.tensorboard``, off by default): every numeric field of the train and
  eval records as a TensorBoard scalar, tagged ``train/<field>`` / ``eval/<field>``, at the record's
  step; list fields (staleness per stage) as ``train/<field>/s<i>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlearn.hooks import Callback, PluginContext, StepOutput
from meshlearn.mesh.timeline import TIMELINE_FILE, TimelineRecorder, parse_timeline_steps

TENSORBOARD_DIR = "tensorboard"


def timeline_path(run_dir: Path, shard: str | None) -> Path:
    """``timeline.json``, or ``timeline.<worker>.json`` for one process of a dist run."""
    return Path(run_dir) / (TIMELINE_FILE if shard is None else f"timeline.{shard}.json")


class TimelineCallback(Callback):
    """Writes the recorder's events when its last chosen step has run (or at the end of a run that
    stopped before it). The driver records; this callback only arms it and saves the file."""

    def __init__(self, ctx: PluginContext, recorder: TimelineRecorder):
        self.recorder, self.driver = recorder, ctx.driver
        self.path = timeline_path(ctx.run_dir, ctx.driver.shard)
        cfg = ctx.cfg
        self.meta = {"schedule": cfg.mesh.schedule, "stages": cfg.mesh.stages,
                     "replicas": cfg.mesh.replicas, "microbatches": cfg.mesh.microbatches,
                     "compute_model": "real" if recorder.clock == "wall" else
                     f"{cfg.sim.compute}:{cfg.sim.device}"}
        self.workers = sorted(str(w) for w in ctx.workers)
        self.last = max(recorder.steps)
        self.written = False

    def on_step_end(self, step: int, report: Any) -> StepOutput:
        # Every action of a step has finished when its report comes back (under async too).
        if not self.written and step >= self.last:
            self._write()
        return StepOutput()

    def close(self) -> None:
        if not self.written and self.recorder.events:  # the run stopped before the last chosen step
            self._write()
        self.driver.timeline = None

    def _write(self) -> None:
        self.recorder.write(self.path, self.workers, self.meta)
        self.written = True
        self.driver.timeline = None  # nothing more to record: the call sites see None again


def timeline_plugin(ctx: PluginContext) -> TimelineCallback | None:
    """Present when some chosen step is still ahead (every driver records: ``Driver.timeline``)."""
    steps = parse_timeline_steps(ctx.cfg.report.timeline_steps, ctx.cfg.train.steps)
    ahead = frozenset(s for s in steps if ctx.resume_step is None or s >= ctx.resume_step)
    if not ahead:
        return None
    clock = "virtual" if ctx.clock.virtual else "wall"
    recorder = TimelineRecorder(ahead, clock)
    ctx.driver.timeline = recorder
    return TimelineCallback(ctx, recorder)


class TensorBoardCallback(Callback):
    """Mirrors the train and eval records into a TensorBoard event file."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def on_record(self, record: dict) -> None:
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, global_step=int(record["step"]))

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) of every finite numeric field of a train or eval record; [] for other kinds."""
    kind = record.get("kind")
    if kind not in ("train", "eval") or not isinstance(record.get("step"), int):
        return []
    out = []
    for key, value in record.items():
        if key in ("kind", "step"):
            continue
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
                out.append((f"{kind}/{key}" + (f"/s{i}" if isinstance(value, list) else ""), float(v)))
    return out


def tensorboard_plugin(ctx: PluginContext) -> TensorBoardCallback | None:
    """On with ``report.tensorboard``, in the process that writes the run's records."""
    return TensorBoardCallback(ctx.run_dir) if ctx.cfg.report.tensorboard and ctx.writer else None
