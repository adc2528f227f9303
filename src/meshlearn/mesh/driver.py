"""What the Trainer asks of a driver: SimDriver (every worker, virtual clock) and DistDriver (one
worker per process, real messages) both answer it, so one training loop serves both."""

from __future__ import annotations

from typing import Protocol

import torch

from meshlearn.mesh.sim import StepReport
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import StepWork, Worker


class Driver(Protocol):
    workers: dict[WorkerId, Worker]
    """The workers of this process (all of them in the simulator, one in a dist process)."""
    writes_records: bool
    """Whether this process writes config.toml, metrics.jsonl, summary.json and manifests."""
    shard: str | None
    """This process's checkpoint shard name, or None when one file holds every worker."""

    def run_step(self, works: dict[WorkerId, StepWork], lr_factor: float, grad_clip: float) -> StepReport:
        """One synchronous step of the local workers; the report covers the whole mesh."""
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
