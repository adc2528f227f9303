"""What one step did, as every driver reports it to the trainer (the simulator, dist, elastic)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepReport:
    """What one step (one global batch) did, for metrics."""

    step: int
    losses: list[float]  # every microbatch loss of every replica (last stages)
    sim_s: float | None  # virtual seconds since the previous step's end (None: a real run, no clock)
    bytes_pp: int
    bytes_dp: int
    grad_norm: float
    staleness: list[float] = field(default_factory=list)  # per stage: mean versions behind
    dp_wait_s: float = 0.0  # seconds workers' updates waited on the DP axis (summed over workers)
