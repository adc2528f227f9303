"""What one step did, as every driver reports it to the trainer (the simulator, dist, elastic).

The report of a whole mesh is computed once (``mesh_report``) from one ``ProcessRow`` per worker:
the simulator builds them from its workers' stats in process, dist gathers them from every process
(at each step's end, or at a drain point under ``async``). Elastic reports from its own worker's
numbers (no collective spans its mesh).

A worker's DP outlier score (attribution, ``dp/attribution.py``) is never taken from its own row
alone: under dist each process writes its own row, and an attacker would write "no score". Every
replica of a stage computes every member's score from the same stacked contributions, so each row
carries its stage's whole score vector, and a worker's score is the median of its stage's rows'
(``voted_scores``): a strict minority of the stage cannot lower or raise it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from meshlearn.mesh.network import Network
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.mesh.worker import StepStats


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
    dp_scores: dict[str, list[float]] = field(default_factory=dict)
    """Per worker with a robust reduce in the step (``dp.robust``): its outlier score in each of
    the step's updates, in update order (one under a flushing schedule, up to M under ``async``);
    read by ``dp/attribution.py``, which counts marks per update."""


NO_SCORE = -1.0
"""A ``ProcessRow``'s vote of an update without a robust reduce (scores are ≥ 0, ∞ included): it
sorts below every score, so it counts in a median as a vote for "none"."""


def update_dp_scores(scores: dict[int, list[float]], microbatches: int) -> dict[int, list[float]]:
    """A worker's stage scores of one step (``StepStats.dp_scores``: update u → every replica's
    score) by the update's slot, u mod M. Why mod M: a step's K = M / ``update_every`` updates are
    consecutive and K divides M, so their slots are distinct and in update order; every member of
    a stage numbers its updates alike, so a slot names the same update in each member's row, even
    where a round was dropped on one member and merged on another."""
    return {u % microbatches: list(v) for u, v in scores.items()}


@dataclass
class ProcessRow:
    """One process's numbers for one step, in a runtime whose workers are processes of their own:
    gathered to every process (at the step's end, or at a drain point under ``async``), so each
    computes the same report, global clip norm and link table from them. Travels as one float64
    vector (``pack``/``unpack``): a gather moves tensors, and every process knows the layout from
    the config (M microbatches, the link slots)."""

    losses: dict[int, float] = field(default_factory=dict)  # microbatch in the step (0..M-1) → loss
    sq_norm: float = 0.0  # this stage's squared gradient norm (its mean over the step's updates)
    busy_s: float = 0.0  # compute time so far
    bytes_pp: int = 0  # bytes this process sent in the step, per axis
    bytes_dp: int = 0
    staleness: float = 0.0  # mean versions behind of the gradients it applied in the step
    dp_wait_s: float = 0.0  # time its updates waited on the DP axis so far
    dp_scores: dict[int, list[float]] = field(default_factory=dict)
    """Update slot (``update_dp_scores``) → the outlier scores of its stage's replicas (replica order)."""
    links: list[tuple[float, float]] = field(default_factory=list)  # per link slot: bytes sent, busy s

    SCALARS = ("sq_norm", "busy_s", "bytes_pp", "bytes_dp", "staleness", "dp_wait_s")

    def pack(self, microbatches: int, slots: int, replicas: int) -> torch.Tensor:
        """M losses, M flags (1: the loss is there; a microbatch a verifier quarantined has none),
        the scalars, M update slots of D outlier scores (a step has at most M updates; the stage's
        D replicas' scores; ``NO_SCORE`` where none), then (bytes, busy) per link slot."""
        M, D = microbatches, replicas
        row = torch.zeros((2 + D) * M + len(self.SCALARS) + 2 * slots, dtype=torch.float64)
        for m, loss in self.losses.items():
            row[m], row[M + m] = loss, 1.0
        at = 2 * M
        for i, name in enumerate(self.SCALARS):
            row[at + i] = getattr(self, name)
        at += len(self.SCALARS)
        row[at:at + M * D] = NO_SCORE
        for slot, scores in self.dp_scores.items():
            row[at + slot * D:at + (slot + 1) * D] = torch.tensor(scores, dtype=torch.float64)
        at += M * D
        for i, (nbytes, busy) in enumerate(self.links):
            row[at + 2 * i], row[at + 2 * i + 1] = nbytes, busy
        return row

    @classmethod
    def unpack(cls, row: torch.Tensor, microbatches: int, slots: int, replicas: int) -> ProcessRow:
        """``pack``'s row back; a score that is no score (negative, NaN: another process's bytes)
        is ``NO_SCORE``, and an update slot without any score is left out."""
        M, D, values = microbatches, replicas, row.tolist()
        at = 2 * M
        scalars = dict(zip(cls.SCALARS, values[at:at + len(cls.SCALARS)], strict=True))
        at += len(cls.SCALARS)
        votes = [[s if s >= 0 else NO_SCORE for s in values[at + j * D:at + (j + 1) * D]] for j in range(M)]
        scores = {j: v for j, v in enumerate(votes) if any(s != NO_SCORE for s in v)}
        at += M * D
        return cls(losses={m: values[m] for m in range(M) if values[M + m] > 0}, dp_scores=scores,
                   **scalars | {"bytes_pp": int(scalars["bytes_pp"]), "bytes_dp": int(scalars["bytes_dp"])},
                   links=[(values[at + 2 * i], values[at + 2 * i + 1]) for i in range(slots)])


def stats_row(stats: StepStats, microbatches: int, sq_norm: float | None = None, **process) -> ProcessRow:
    """A worker's row of one step from its ``stats``: losses by microbatch in the step, its squared
    norm (``sq_norm``: a flushing schedule's stage norm before the global clip; else the mean over
    the step's updates), its mean staleness and its stage's outlier scores; ``process``: the
    process's own counters (busy time, bytes, links), where a runtime has them."""
    norms = stats.update_sq_norms
    return ProcessRow(losses={j % microbatches: loss for j, loss in stats.losses.items()},
                      sq_norm=sq_norm if sq_norm is not None else (sum(norms) / len(norms) if norms else 0.0),
                      staleness=sum(stats.staleness) / len(stats.staleness) if stats.staleness else 0.0,
                      dp_scores=update_dp_scores(stats.dp_scores, microbatches), **process)


def voted_scores(mesh: MeshShape, rows: dict[WorkerId, ProcessRow]) -> dict[str, list[float]]:
    """Per worker, its outlier score in each of the step's updates (update order, where it has
    one): the median (the lower one at an even D, always one member's vote) of what its stage's
    rows say, a row without that update voting ``NO_SCORE``. The honest members computed the same
    score bit for bit, so with a strict minority lying (the worker itself, say) their value is the
    median; no score where half of the rows or more have none."""
    voted = {}
    for w in mesh.workers():
        members = [rows[m].dp_scores for m in mesh.stage_replicas(w.stage)]
        scores = []
        for slot in sorted({slot for row in members for slot in row}):
            votes = [row[slot][w.replica] if slot in row else NO_SCORE for row in members]
            score = statistics.median_low(votes)
            if score != NO_SCORE:
                scores.append(score)
        if scores:
            voted[str(w)] = scores
    return voted


def mesh_report(step: int, mesh: MeshShape, rows: dict[WorkerId, ProcessRow], sim_s: float | None,
                bytes_pp: int, bytes_dp: int, dp_wait_s: float = 0.0) -> StepReport:
    """Step ``step``'s report from every worker's row: the last stages' losses in replica order;
    the norm of replica 0's stages together (each one's norm before the global clip under a
    flushing schedule, its mean over the step's updates under ``async``), summed in stage order
    as the clip sums them; per stage the mean staleness over its replicas; every worker's outlier
    scores as its stage's rows vote them (``voted_scores``)."""
    P, replicas = mesh.stages, mesh.replicas
    sq = sum(rows[WorkerId(0, s)].sq_norm for s in range(P))
    staleness = [sum(rows[w].staleness for w in mesh.stage_replicas(s)) / replicas for s in range(P)]
    last = [rows[WorkerId(r, P - 1)] for r in range(replicas)]
    return StepReport(step=step, losses=[loss for row in last for _, loss in sorted(row.losses.items())],
                      sim_s=sim_s, bytes_pp=bytes_pp, bytes_dp=bytes_dp, grad_norm=math.sqrt(sq),
                      staleness=staleness, dp_wait_s=dp_wait_s,
                      dp_scores=voted_scores(mesh, rows))


AxisBytes = tuple[int, int]
"""Bytes sent on the pipeline ("pp") and the data-parallel ("dp") axes."""


class StepBytes:
    """A step's bytes per axis as every runtime reports them: counted from the previous step's end,
    so the control messages of a drain point (sent between two steps) are in the next step's."""

    def __init__(self, network: Network):
        self.network = network
        self.mark: AxisBytes | None = None  # the counters at the last step's end

    def counters(self) -> AxisBytes:
        return self.network.bytes_on_axis("pp"), self.network.bytes_on_axis("dp")

    def begin(self) -> AxisBytes:
        """The counters the coming step's bytes count from."""
        return self.mark or self.counters()

    def since(self, start: AxisBytes) -> AxisBytes:
        """The bytes per axis sent since ``start``."""
        pp, dp = self.counters()
        return pp - start[0], dp - start[1]

    def end(self) -> None:
        self.mark = self.counters()


# --- the run's summary: the fields every runtime writes to summary.json, computed once ------------

def run_summary(compute_model: str, links: list[dict], idle_fraction: float | None = None,
                sim_s: float | None = None, tokens: int = 0) -> dict:
    """The fields of summary.json every runtime fills: the virtual time and throughput (None for a
    real run: no virtual clock), the idle fraction, what computed the run, and its link table."""
    return {"sim_time_s": sim_s, "sim_tokens_per_s": tokens / sim_s if sim_s else None,
            "idle_fraction": idle_fraction, "compute_model": compute_model, "links": links}


def idle_fraction(busy_s: float, workers: int, seconds: float) -> float | None:
    """The share of ``workers`` × ``seconds`` no worker computed in (None: no time passed)."""
    return 1.0 - busy_s / (workers * seconds) if seconds else None


def link_table(links: Iterable[tuple[WorkerId, WorkerId, str, float, float]], seconds: float) -> list[dict]:
    """The summary's links, each (src, dst, axis, bytes sent, busy seconds) with its utilization
    over ``seconds``, by axis, then sender and receiver."""
    return [{"src": str(src), "dst": str(dst), "axis": axis, "bytes": int(nbytes), "busy_s": busy,
             "utilization": busy / seconds if seconds else 0.0}
            for src, dst, axis, nbytes, busy in sorted(links, key=lambda link: (link[2], link[0], link[1]))]


def dp_counters(wait_s: float, summaries: list[dict],
                total: Callable[[list[float]], list[float]] | None = None) -> dict:
    """A message-based DP strategy's counters for the summary (none without one): the time updates
    waited on the DP axis and each counter of ``summaries`` (this process's strategies'), summed,
    then over every process by ``total`` where workers are processes of their own (a collective)."""
    if not summaries:
        return {}
    keys = list(summaries[0])
    values = [wait_s, *(sum(summary[key] for summary in summaries) for key in keys)]
    if total is not None:
        values = total(values)
    return {"dp_wait_s": values[0], **{key: int(v) for key, v in zip(keys, values[1:], strict=True)}}
