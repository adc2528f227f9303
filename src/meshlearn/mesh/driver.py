"""What the Trainer asks of a driver: SimDriver (every worker, virtual clock) and DistDriver (one
worker per process, real messages) both answer it, so one training loop serves both.

The step contract: a driver runs step t when asked, pulling data from its WorkSource up to the
next drain point; under a flushing schedule every step is a drain point, under ``async`` work of
later steps may already be in flight when step t's report comes back."""

from __future__ import annotations

from typing import Protocol

import torch

from meshlearn.mesh.report import StepReport
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import StepWork, Worker


class WorkSource(Protocol):
    """Where a driver gets work: the trainer."""

    def work(self, step: int) -> dict[WorkerId, StepWork]:
        """Step ``step``'s data and learning-rate factor for this process's workers."""
        ...

    def next_drain(self, step: int) -> int:
        """The first step ≥ ``step`` after which the pipeline must be empty (no forward of a later
        step may start before it is)."""
        ...


class Driver(Protocol):
    workers: dict[WorkerId, Worker]
    """The workers of this process (all of them in the simulator, one in a dist process)."""
    writes_records: bool
    """Whether this process writes config.toml, metrics.jsonl, summary.json and manifests."""
    shard: str | None
    """This process's checkpoint shard name, or None when one file holds every worker."""

    def run_step(self, step: int, source: WorkSource) -> list[StepReport]:
        """Run until this process's workers have applied step ``step``'s updates, pulling work from
        ``source`` as far as its next drain point allows. Returns the reports that are complete
        (each covers the whole mesh): step ``step``'s in the simulator; a real async run may hand
        several steps' reports in at a drain point instead."""
        ...

    @property
    def drained(self) -> bool:
        """Nothing in flight: checkpoints and evaluation happen only here."""
        ...

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Replica 0's validation loss, known to every process."""
        ...

    def record_fields(self) -> dict:
        """Driver-specific fields of every metrics record (e.g. the virtual clock)."""
        ...

    def summary_fields(self, tokens: int, wall_s: float) -> dict:
        """Driver-specific fields of summary.json (time axis, bubble fraction, links)."""
        ...

    def state(self) -> dict:
        """This process's driver state for a checkpoint (clocks, link counters, RNG streams)."""
        ...

    def load_state(self, state: dict) -> None: ...

    def barrier(self, what: str) -> None:
        """Wait for every process (``what`` names the occasion in a timeout error)."""
        ...
