"""Trainer: the loop that reads in order — lr → batch → pipeline step → log → eval → checkpoint.

The pipeline's internal order (which microbatch runs where, when) belongs to the schedule and the
driver; the trainer only hands each worker its work for the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlearn.assemble import build_workers, resolve
from meshlearn.atomic import atomic_write_json
from meshlearn.config import RunConfig, save_config, to_dict
from meshlearn.data import shard_batch, validation_batches
from meshlearn.data.corpus import load_corpus
from meshlearn.data.replica_corpus import load_replica_tokens, own_rows
from meshlearn.data.run_data import RunData
from meshlearn.hooks import PluginContext, build_callbacks
from meshlearn.jsonl import MetricsLog, read_records
from meshlearn.mesh.driver import ControlChannel, DataPlan, Driver, Membership, TimeModels
from meshlearn.mesh.evaluation import pipeline_loss
from meshlearn.mesh.report import StepReport
from meshlearn.mesh.sim import build_sim_driver
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.report.progress import ProgressLine
from meshlearn.train.checkpoint import ShardedCheckpoint, SingleFileCheckpoint
from meshlearn.train.closing import Closing, closing
from meshlearn.train.provenance import record_start
from meshlearn.train.signals import GracefulStop

__all__ = ["Trainer", "pipeline_loss"]


@dataclass
class Totals:
    """Cumulative counters that a resumed run continues from."""

    step: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    bytes_pp: int = 0
    bytes_dp: int = 0


class Trainer:
    """The training loop of one process: every worker under the simulator, one under ``--backend dist``.

    ``driver`` builds the driver (``meshlearn.mesh.driver.Driver``) from the resolved config; the
    default is a SimDriver over every worker. The trainer is the driver's ``WorkSource``: it hands
    out each step's data (``work``) and says where the next drain point is (``next_drain``).
    Methods join through plugins (``meshlearn.hooks``); the trainer names none of them.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
                 driver: Callable[[RunConfig], Driver] | None = None, stop: GracefulStop | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.corpus = load_corpus(cfg, self.run_dir)
        self.cfg = resolve(cfg, self.corpus.vocab_size)
        self.mesh = MeshShape(self.cfg.mesh.replicas, self.cfg.mesh.stages)
        self.data = RunData(self.corpus.splits.train, self.cfg.train.batch_size, self.cfg.model.seq_len,
                            self.cfg.seed, self.cfg.mesh.microbatches)
        self.own_tokens = (load_replica_tokens(cfg.data.replica_corpus, self.corpus.tokenizer,
                                               cfg.data.val_fraction) if cfg.data.replica_corpus else {})
        self.driver = driver(self.cfg) if driver else build_sim_driver(self.cfg, build_workers(self.cfg))
        self.workers = self.driver.workers  # the workers of this process
        self.writer = self.driver.writes_records  # writes config, records, summary, manifests
        # config.toml and run.json: the writer, or in a cluster run one process per machine's folder
        self.writes_files = self.driver.writes_run_files
        # A mesh whose processes come and go (elastic): its joiners, records and checkpoint shards.
        membership = self.driver if isinstance(self.driver, Membership) else None
        own_store = self.driver.checkpoint_store  # a cluster run's (cluster/)
        self.checkpoints = (SingleFileCheckpoint(self.run_dir) if self.driver.shard is None else
                            own_store(self.run_dir) if own_store else
                            ShardedCheckpoint(self.run_dir, self.driver.shard,
                                              [str(w) for w in self.mesh.workers()], self.driver.barrier,
                                              self.writer, self.cfg.dist.keep_checkpoints,
                                              membership.checkpoint_membership if membership else None))
        self.val_batches = validation_batches(self.corpus.splits.val, self.cfg.train.eval_batches,
                                              self.cfg.train.batch_size, self.cfg.model.seq_len)
        self.totals = Totals()
        self.last_val_loss: float | None = None
        # SIGINT/SIGTERM: stop at the next drain point every process agrees on (train/signals.py).
        self.stop = stop
        self.interrupted: str | None = None  # the signal's name, once the run stopped for it
        common, state = self.checkpoints.load() if resume else (None, None)
        if common is not None:
            self.totals = Totals(**common["totals"])
            self.last_val_loss = common["last_val_loss"]
        joined_at = membership.joined_at if membership else None
        if joined_at is not None:  # a driver that joined a running mesh (elastic): start where it is
            self.totals.step = joined_at
            self.totals.tokens = joined_at * self.cfg.train.batch_size * self.cfg.model.seq_len
        train = self.cfg.train
        stops_early = self.totals.step < train.stop_at_step < train.steps
        # The step this invocation trains to (train.stop_at_step, if it stops early, else train.steps).
        self.last_step = train.stop_at_step if stops_early else train.steps
        self.plugins = build_callbacks(self._plugin_context(self.totals.step if resume else None))
        if state is not None:
            self._load_state(state)
        self.metrics = None
        # A driver whose records' writer changes with membership (elastic) takes every record and
        # writes those it claims; the others' records go to ``metrics``.
        self.sink = membership.records if membership else None
        if self.writes_files:
            # run.json first: it records the keys changed since the previous start's config.toml
            record_start(self.run_dir, to_dict(self.cfg), self.totals.step if resume else None)
            save_config(self.cfg, self.run_dir / "config.toml")
        if self.writer:
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl",
                                      keep_until_step=self.totals.step if resume else None)
        if self.sink is not None:
            self.sink.attach(self.run_dir / "metrics.jsonl")
        self.progress = ProgressLine(self.cfg.train.steps) if progress and self.writer else None

    def _plugin_context(self, resume_step: int | None) -> PluginContext:
        """What the plugins get: the run's data and clock, and the driver's optional services."""
        driver = self.driver
        return PluginContext(self.cfg, self.run_dir, self.workers, driver, resume_step, self.writer,
                             data=self.data, clock=driver.clock,
                             control=driver if isinstance(driver, ControlChannel) else None,
                             time_models=driver if isinstance(driver, TimeModels) else None)

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> dict:
        train = self.cfg.train
        try:
            while self.totals.step < self.last_step:
                self.step()
                done = self.totals.step
                self._settle_stop(done)
                if not self.drains_after(done):
                    continue
                for callback in self.plugins.values():
                    for record in callback.on_drain(done):
                        self._log(record)
                if done % train.eval_every == 0 or done == train.steps:
                    self.evaluate()
                stopping = self._stopping(done)
                if (train.checkpoint_every and done % train.checkpoint_every == 0 or done == self.last_step
                        or stopping):
                    self.save_checkpoint()
                if stopping:
                    self.interrupted = self.stop.name
                    break
        finally:
            for callback in self.plugins.values():
                callback.close()
            if self.sink is not None:
                self.sink.close()
            if self.metrics:
                self.metrics.close()
            if self.progress:
                self.progress.close()
        summary = self.summary()
        if self._writes_summary():
            atomic_write_json(self.run_dir / "summary.json", summary)
        return summary

    def step(self) -> float | None:
        """One global batch; returns its train loss (None if the verifier dropped every microbatch,
        or if the driver reports the step later, as a real async run does at log intervals)."""
        t = self.totals.step
        started = time.perf_counter()
        reports = self.driver.run_step(t, self)
        wall = time.perf_counter() - started
        totals = self.totals
        totals.step += 1
        totals.tokens += self.cfg.train.batch_size * self.cfg.model.seq_len
        totals.wall_s += wall
        loss = None
        for report in reports:
            report_loss = self._record(report, wall if report.step == t else None)
            if report.step == t:
                loss = report_loss
        return loss

    def _record(self, report: StepReport, wall: float | None) -> float | None:
        cfg, totals = self.cfg, self.totals
        loss = sum(report.losses) / len(report.losses) if report.losses else None
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(f"step {report.step + 1}: train loss is {loss}; lower train.lr")
        totals.bytes_pp += report.bytes_pp
        totals.bytes_dp += report.bytes_dp
        factor = lr_factor(report.step, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        record = {"kind": "train", "step": report.step + 1,
                  "tokens": (report.step + 1) * cfg.train.batch_size * cfg.model.seq_len, "train_loss": loss,
                  "lr": cfg.train.lr * factor, "grad_norm": report.grad_norm,
                  "step_sim_s": report.sim_s, "step_wall_s": wall}
        if cfg.mesh.schedule == "async":
            record["staleness"] = report.staleness
        events = []
        for callback in self.plugins.values():
            out = callback.on_step_end(report.step, report)
            record |= out.fields
            events += out.records
        self._log(record)
        for event in events:
            self._log(event)
        return loss

    # --- the driver's work source ------------------------------------------------------------

    def drains_after(self, done: int) -> bool:
        """Whether the pipeline must be empty after ``done`` steps: evaluation, a checkpoint, the
        end of this invocation, or a plugin's request."""
        train = self.cfg.train
        return (done % train.eval_every == 0 or done >= self.last_step
                or bool(train.checkpoint_every) and done % train.checkpoint_every == 0
                or self._stopping(done)
                or any(callback.drains_after(done) for callback in self.plugins.values()))

    def next_drain(self, step: int) -> int:
        """The first step ≥ ``step`` (0-based) after which the pipeline drains. A pending stop
        request becomes a drain point here: after the highest step any process has started
        (train/signals.py), which this call first claims for this process (``_frontier``)."""
        t = step
        while not self.drains_after(t + 1):
            t += 1
        if self.stop is not None and self.stop.observe(step, self._frontier(step, t)):
            return self.next_drain(step)
        return t

    def _frontier(self, step: int, drain: int) -> int:
        """The last step this process may start before it asks ``next_drain`` again: the steps its
        driver feeds (up to its lookahead, never past the next drain point ``drain``), and, once
        its workers have finished ``step``, the next one, unless ``step`` ends at a drain point.
        Claiming the next step before deciding whether this one drains is what lets a stop land
        after the step in flight: no process can then be past the step every process agrees on."""
        fed = min(drain, step + self.driver.lookahead)
        if all(worker.steps_done > step for worker in self.workers.values()):
            return max(fed, min(drain, step + 1))
        return fed

    def _settle_stop(self, done: int) -> None:
        """At a step's end, before deciding whether it drains: a pending signal stops the run
        after this step unless a process has already claimed the next one; without one, this
        process claims the next step, or learns of another process's stop."""
        if self.stop is not None:
            self.next_drain(done - 1)

    def _stopping(self, done: int) -> bool:
        stop = self.stop
        return stop is not None and stop.stop_after is not None and done >= stop.stop_after + 1

    def work(self, step: int) -> dict[WorkerId, StepWork]:
        """Step ``step``'s work for this process's workers: the rows that train it take the slices
        of its global batch in order, cut into microbatches, with the step's learning-rate factor.
        A row is an assignment stage → replica: every replica's slot row (r, …, r), unless the
        driver says otherwise (an elastic driver's ``data_plan`` names the rows — re-paired ones
        too — and the batch, which stays the same until a step commits). A worker in no row
        gets no data (it spectates)."""
        cfg = self.cfg
        stages = self.mesh.stages
        index, rows = (self.driver.data_plan(step) if isinstance(self.driver, DataPlan)
                       else (step, tuple((r,) * stages for r in range(self.mesh.replicas))))
        x, y = self.data.batch(index)
        factor = lr_factor(step, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        shards = shard_batch(x, y, len(rows), cfg.mesh.microbatches) if rows else []
        if self.own_tokens and rows:  # data.replica_corpus: some replicas read their own text
            shards = own_rows(self.own_tokens, shards, rows, index, cfg.train.batch_size,
                              cfg.model.seq_len, cfg.seed, cfg.mesh.microbatches)
        works = {}
        for wid in self.workers:
            k = next((k for k, row in enumerate(rows) if row[wid.stage] == wid.replica), None)
            micro = shards[k] if k is not None else []
            works[wid] = StepWork(
                step=step,
                microbatch_size=micro[0][0].shape[0] if micro else 0,
                lr_factor=factor,
                tokens=[mx for mx, _ in micro] if wid.stage == 0 else None,
                targets=[my for _, my in micro] if wid.stage == stages - 1 else None,
            )
        return works

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss through replica 0's stages, with the boundary codec applied as in training
        (at a drain point: the weights are settled)."""
        self.last_val_loss = self.driver.evaluate(self.val_batches)
        self._log({"kind": "eval", "step": self.totals.step, "val_loss": self.last_val_loss,
                   **self.driver.eval_fields()})
        return self.last_val_loss

    # --- records -----------------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        totals = self.totals
        record = {"tokens": totals.tokens} | record | {**self.driver.record_fields(),
                   "wall_time_s": totals.wall_s, "bytes_pp": totals.bytes_pp,
                   "bytes_dp": totals.bytes_dp}
        if self.sink is not None:
            self.sink.write(self.totals.step, record)
        elif self.metrics:
            self.metrics.write(record)
        if self.metrics:
            for callback in self.plugins.values():
                callback.on_record(record)
        if self.progress:
            self.progress.update(record)

    def summary(self) -> dict:
        totals = self.totals
        recent = ([r["train_loss"] for r in _recent_train(self.run_dir, 10) if r["train_loss"] is not None]
                  if self._writes_summary() else [])
        summary = {
            "name": self.cfg.name or self.run_dir.name,
            "steps": totals.step,
            "tokens": totals.tokens,
            "final_val_loss": self.last_val_loss,
            "final_train_loss": sum(recent) / len(recent) if recent else None,
            "wall_time_s": totals.wall_s,
            "wall_tokens_per_s": totals.tokens / totals.wall_s if totals.wall_s else None,
            "bytes_per_token_pp": totals.bytes_pp / totals.tokens if totals.tokens else 0.0,
            "bytes_per_token_dp": totals.bytes_dp / totals.tokens if totals.tokens else 0.0,
            "interrupted": self.interrupted,
        } | self.driver.summary_fields(totals.tokens, totals.wall_s)
        for callback in self.plugins.values():
            summary |= callback.summary()
        return summary

    def opening(self) -> str:
        """What the run is about to do, printed before its first step: the mesh, the model's size
        (replica 0's stages, as far as this process holds them), the tokens of each split, the
        steps and the folder."""
        cfg, mesh = self.cfg, self.cfg.mesh
        params = sum(p.numel() for w, worker in self.workers.items() if w.replica == 0
                     for p in worker.module.parameters())
        splits = self.corpus.splits
        return (f"meshlearn: {mesh.stages} stages × {mesh.replicas} replicas ({mesh.schedule}), "
                f"{params / 1e6:.2f}M parameters, {len(splits.train):,} train / {len(splits.val):,} "
                f"validation tokens, steps {self.totals.step + 1}–{self.last_step} of {cfg.train.steps} × "
                f"{cfg.train.batch_size} × {cfg.model.seq_len} → {self.run_dir}")

    def closing(self, summary: dict, rates: str) -> Closing:
        """The line this run ends with and its exit code (train/closing.py); ``rates``: the
        driver's throughput, as the caller words it."""
        stop = self.stop
        signal_name = self.interrupted or (stop.name if stop is not None else None)
        return closing(summary, self.cfg.train.steps, self.cfg.train.stop_at_step, signal_name,
                       stop.exit_code if stop is not None else 0, self.run_dir, rates,
                       cluster=self.cfg.backend == "dist" and self.cfg.cluster.enabled)

    def _writes_summary(self) -> bool:
        """The records' writer; under a sink, the process that wrote the last step's records."""
        return self.sink.holds(self.totals.step) if self.sink is not None else self.writer

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """At a drain point. ``common`` is the same in every process; the rest is this process's."""
        common = {"config": to_dict(self.cfg), "totals": vars(self.totals).copy(),
                  "last_val_loss": self.last_val_loss}
        return self.checkpoints.save(self.totals.step, common, {
            "workers": {str(w): worker.state_dict() for w, worker in self.workers.items()},
            **self.driver.state(),
            "torch_rng": torch.random.get_rng_state(),
            "plugins": {name: callback.state_dict() for name, callback in self.plugins.items()},
        })

    def _load_state(self, state: dict) -> None:
        for w, worker_state in state["workers"].items():
            self.workers[WorkerId.parse(w)].load_state_dict(worker_state)
        self.driver.load_state(state)
        torch.random.set_rng_state(state["torch_rng"])
        for name, callback in self.plugins.items():
            callback.load_state_dict(state["plugins"].get(name))


def _recent_train(run_dir: Path, n: int) -> list[dict]:
    records = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return records[-n:]
