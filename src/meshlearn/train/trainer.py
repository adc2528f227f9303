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

from meshlearn.config import RunConfig, save_config, to_dict
from meshlearn.data import global_batch, shard_batch, validation_batches
from meshlearn.mesh.basis_updates import BasisUpdater
from meshlearn.mesh.driver import Driver
from meshlearn.mesh.schedule import schedule_table
from meshlearn.mesh.sim import pipeline_loss
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepWork
from meshlearn.report.progress import ProgressLine
from meshlearn.train.assemble import build_sim_driver, build_workers, load_corpus, resolve
from meshlearn.train.checkpoint import CHECKPOINT, ShardedCheckpoint, SingleFileCheckpoint
from meshlearn.train.files import MetricsLog, atomic_write_json, read_records
from meshlearn.train.provenance import describe_run
from meshlearn.train.schedule_lr import lr_factor
from meshlearn.verify.trust import TrustLayer

__all__ = ["CHECKPOINT", "Trainer", "pipeline_loss"]


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
    default is a SimDriver over every worker.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
                 driver: Callable[[RunConfig], Driver] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.corpus = load_corpus(cfg, self.run_dir)
        self.cfg = resolve(cfg, self.corpus.vocab_size)
        self.mesh = MeshShape(self.cfg.mesh.replicas, self.cfg.mesh.stages)
        self.driver = driver(self.cfg) if driver else build_sim_driver(self.cfg, build_workers(self.cfg))
        self.workers = self.driver.workers  # the workers of this process
        self.writer = self.driver.writes_records  # writes config, records, summary, manifests
        self.checkpoints = (SingleFileCheckpoint(self.run_dir) if self.driver.shard is None else
                            ShardedCheckpoint(self.run_dir, self.driver.shard,
                                              [str(w) for w in self.mesh.workers()], self.driver.barrier,
                                              self.writer, self.cfg.dist.keep_checkpoints))
        self.trust = TrustLayer(self.cfg, self.workers)  # attacks and SENTINEL (inactive by default)
        self.trust.attach(self.driver)
        self.table = schedule_table(self.cfg.mesh.schedule, self.mesh.stages, self.cfg.mesh.microbatches)
        self.val_batches = validation_batches(self.corpus.splits.val, self.cfg.train.eval_batches,
                                              self.cfg.train.batch_size, self.cfg.model.seq_len)
        self.basis_updater = None
        if self.cfg.subspace_update.every:
            m = self.cfg.model
            self.basis_updater = BasisUpdater(self.cfg.subspace_update, self.workers, m.d_model,
                                              m.subspace_rank, m.subspace_seed)
        self.totals = Totals()
        self.last_val_loss: float | None = None
        if resume:
            self._load_checkpoint()
        self.metrics = None
        if self.writer:
            save_config(self.cfg, self.run_dir / "config.toml")
            atomic_write_json(self.run_dir / "run.json", describe_run())
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl",
                                      keep_until_step=self.totals.step if resume else None)
        self.decision_log = None  # verify.jsonl: every verifier decision, for replay and audits
        if self.trust.sentinel is not None and self.cfg.verify.decision_log != "none":
            self.decision_log = MetricsLog(self.run_dir / "verify.jsonl",
                                           keep_until_step=self.totals.step if resume else None)
        self.progress = ProgressLine(self.cfg.train.steps) if progress and self.writer else None

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> dict:
        train = self.cfg.train
        stops_early = self.totals.step < train.stop_at_step < train.steps
        last = train.stop_at_step if stops_early else train.steps
        try:
            while self.totals.step < last:
                self.step()
                done = self.totals.step
                if self.basis_updater and self.basis_updater.after_step(done):
                    self._log({"kind": "event", "step": done, "event": "subspace_basis_update",
                               "updates": self.basis_updater.updates})
                if done % train.eval_every == 0 or done == train.steps:
                    self.evaluate()
                if train.checkpoint_every and done % train.checkpoint_every == 0 or done == last:
                    self.save_checkpoint()
        finally:
            if self.metrics:
                self.metrics.close()
            if self.decision_log:
                self.decision_log.close()
            if self.progress:
                self.progress.close()
        summary = self.summary()
        if self.writer:
            atomic_write_json(self.run_dir / "summary.json", summary)
        return summary

    def step(self) -> float | None:
        """One optimizer step; returns the train loss (None if the verifier dropped every microbatch)."""
        cfg, t = self.cfg, self.totals.step
        factor = lr_factor(t, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
        x, y = global_batch(self.corpus.splits.train, t, cfg.train.batch_size, cfg.model.seq_len,
                            cfg.seed)
        started = time.perf_counter()
        works = {w: work for w, work in self.step_work(t, x, y).items() if w in self.workers}
        report = self.driver.run_step(works, factor, cfg.train.grad_clip)
        verified = self.trust.end_step(t)  # bans take effect here, between steps
        wall = time.perf_counter() - started
        loss = sum(report.losses) / len(report.losses) if report.losses else None
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(f"step {t + 1}: train loss is {loss}; lower train.lr")
        totals = self.totals
        totals.step += 1
        totals.tokens += x.numel()
        totals.wall_s += wall
        totals.bytes_pp += report.bytes_pp
        totals.bytes_dp += report.bytes_dp
        record = {"kind": "train", "step": totals.step, "train_loss": loss,
                  "lr": cfg.train.lr * factor, "grad_norm": report.grad_norm,
                  "step_sim_s": report.sim_s, "step_wall_s": wall}
        if self.trust.sentinel is not None:
            record |= {"verify_flags": verified.flags, "verify_skipped": verified.skipped}
        self._log(record)
        for event in verified.events:
            self._log(event)
        if self.decision_log:
            for decision in verified.decisions:
                self.decision_log.write(decision)
        return loss

    def step_work(self, step: int, x: torch.Tensor, y: torch.Tensor) -> dict[WorkerId, StepWork]:
        """Replica r takes slice r of the global batch, cut into microbatches."""
        shards = shard_batch(x, y, self.mesh.replicas, self.cfg.mesh.microbatches)
        works = {}
        for wid in self.mesh.workers():
            micro = shards[wid.replica]
            works[wid] = StepWork(
                step=step,
                plan=self.table[wid.stage],
                microbatch_size=micro[0][0].shape[0],
                tokens=[mx for mx, _ in micro] if wid.stage == 0 else None,
                targets=[my for _, my in micro] if wid.stage == self.mesh.stages - 1 else None,
            )
        return works

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss through replica 0's stages, with the boundary codec applied as in training."""
        self.last_val_loss = self.driver.evaluate(self.val_batches)
        self._log({"kind": "eval", "step": self.totals.step, "val_loss": self.last_val_loss})
        return self.last_val_loss

    # --- records -----------------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        totals = self.totals
        record |= {"tokens": totals.tokens, **self.driver.record_fields(),
                   "wall_time_s": totals.wall_s, "bytes_pp": totals.bytes_pp,
                   "bytes_dp": totals.bytes_dp}
        if self.metrics:
            self.metrics.write(record)
        if self.progress:
            self.progress.update(record)

    def summary(self) -> dict:
        totals = self.totals
        recent = ([r["train_loss"] for r in _recent_train(self.run_dir, 10) if r["train_loss"] is not None]
                  if self.writer else [])
        return {
            "name": self.cfg.name or self.run_dir.name,
            "steps": totals.step,
            "tokens": totals.tokens,
            "final_val_loss": self.last_val_loss,
            "final_train_loss": sum(recent) / len(recent) if recent else None,
            "wall_time_s": totals.wall_s,
            "wall_tokens_per_s": totals.tokens / totals.wall_s if totals.wall_s else None,
            "bytes_per_token_pp": totals.bytes_pp / totals.tokens if totals.tokens else 0.0,
            "bytes_per_token_dp": totals.bytes_dp / totals.tokens if totals.tokens else 0.0,
        } | self.driver.summary_fields(totals.tokens, totals.wall_s) | self.trust.summary()

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """``common`` is the same in every process; the rest is this process's (its shard)."""
        common = {"config": to_dict(self.cfg), "totals": vars(self.totals).copy(),
                  "last_val_loss": self.last_val_loss}
        return self.checkpoints.save(self.totals.step, common, {
            "workers": {str(w): worker.state_dict() for w, worker in self.workers.items()},
            **self.driver.state(),
            "torch_rng": torch.random.get_rng_state(),
            "subspace_update": self.basis_updater.state() if self.basis_updater else None,
            "trust": self.trust.state_dict() if self.trust.active else None,
        })

    def _load_checkpoint(self) -> None:
        common, state = self.checkpoints.load()
        self.totals = Totals(**common["totals"])
        self.last_val_loss = common["last_val_loss"]
        for w, worker_state in state["workers"].items():
            self.workers[WorkerId.parse(w)].load_state_dict(worker_state)
        self.driver.load_state(state)
        torch.random.set_rng_state(state["torch_rng"])
        if self.basis_updater:
            self.basis_updater.load_state(state["subspace_update"])
        if self.trust.active and state.get("trust") is not None:
            self.trust.load_state_dict(state["trust"])


def _recent_train(run_dir: Path, n: int) -> list[dict]:
    records = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return records[-n:]
