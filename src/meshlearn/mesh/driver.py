"""What the Trainer and the plugins ask of a driver: SimDriver (every worker, virtual clock),
DistDriver (one worker per process, real messages) and ElasticDriver (dist with a quorum on the DP
axis) all answer ``Driver``, so one training loop serves them all.

The step contract: a driver runs step t when asked, pulling data from its WorkSource up to the
next drain point; under a flushing schedule every step is a drain point, under ``async`` work of
later steps may already be in flight when step t's report comes back.

What only some runtimes have is an optional capability, a small Protocol of its own below
(``ControlChannel``, ``DataPlan``, ``Membership``, ``MessageMonitors``, ``TimeModels``; the
verifier's in ``verify/capabilities.py``). A runtime implements one by having its members; a
caller tests it with ``isinstance`` (they are ``runtime_checkable``) or, for a plugin, receives it
from its ``PluginContext``. Nobody probes a driver with ``getattr``/``hasattr``
(tests/test_layers.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from meshlearn.mesh.compute import ComputeModel
from meshlearn.mesh.messages import Message, MessageMonitor
from meshlearn.mesh.network import Network
from meshlearn.mesh.report import StepReport
from meshlearn.mesh.timeline import TimelineRecorder
from meshlearn.mesh.topology import WorkerId
from meshlearn.mesh.worker import StepWork, Worker

Row = tuple[int, ...]
"""A pipeline row: stage s → the replica that serves it."""


class WorkSource(Protocol):
    """Where a driver gets work: the trainer."""

    def work(self, step: int) -> dict[WorkerId, StepWork]:
        """Step ``step``'s data and learning-rate factor for this process's workers."""
        ...

    def next_drain(self, step: int) -> int:
        """The first step ≥ ``step`` after which the pipeline must be empty (no forward of a later
        step may start before it is)."""
        ...


class Clock(Protocol):
    """The run's time axis: the simulator's virtual seconds, or a real run's wall seconds."""

    virtual: bool
    """True for the simulator's clock (seconds of the modelled mesh, not of this machine)."""

    def worker_s(self, worker: WorkerId) -> float:
        """Where ``worker``'s own clock stands now (a real run knows only its own workers')."""
        ...

    def elapsed_s(self) -> float:
        """The run's clock at the last step's end (a wall clock: now, which a plugin reads at a
        step's end)."""
        ...


class CheckpointStore(Protocol):
    """Where a process's checkpoints go (``train/checkpoint.py``'s single file or shards, a
    cluster's agreed shards)."""

    def save(self, step: int, common: dict, shard: dict) -> Path: ...

    def load(self) -> tuple[dict | None, dict | None]:
        """(what every process shares, this process's own) of the latest complete checkpoint."""
        ...


@runtime_checkable
class Driver(Protocol):
    workers: dict[WorkerId, Worker]
    """The workers of this process (all of them in the simulator, one in a dist process)."""
    writes_records: bool
    """Whether this process writes metrics.jsonl, summary.json and manifests."""
    writes_run_files: bool
    """Whether this process writes config.toml and run.json (the records' writer; in a cluster run
    one process per machine, each in its own folder)."""
    shard: str | None
    """This process's checkpoint shard name, or None when one file holds every worker."""
    checkpoint_store: Callable[[Path], CheckpointStore] | None
    """This runtime's own checkpoint store for a run folder (a cluster's), or None for the
    trainer's default (one file, or a shard per process)."""
    lookahead: int
    """How many steps past the running one the driver may feed (it never feeds past a drain
    point): the trainer's stop rule and the verifier's lag read it."""
    fed: int
    """The last step (0-based) whose work the driver has handed its workers; -1 before any."""
    clock: Clock
    """The run's clock (virtual in the simulator, wall in a real run)."""
    timeline: TimelineRecorder | None
    """Records the computes and sends of chosen steps when set (the timeline plugin sets it)."""

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

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Replica 0's validation loss (an elastic process whose row did not evaluate: None)."""
        ...

    def eval_fields(self) -> dict:
        """Driver-specific fields of the evaluation record (e.g. the evaluation's virtual time)."""
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


# --- optional capabilities -------------------------------------------------------------------


@runtime_checkable
class ControlChannel(Protocol):
    """Control messages between workers at a drain point (a protocol model's boundary
    transforms): they cross the pipeline link like any message and are counted in the next
    step's bytes. The simulator and the distributed runtime have one."""

    def send_control(self, message: Message) -> None:
        """Send ``message`` on its link; returns at once."""
        ...

    def receive_control(self, src: WorkerId, kind: str, what: str) -> Message:
        """The next control message of ``kind`` from ``src`` (``what`` names it in an error)."""
        ...


@runtime_checkable
class DataPlan(Protocol):
    """A runtime that decides which rows train a step and on which global batch (elastic: the
    rows agreed per step, the batch of the committed steps so far); without it every replica's
    slot row trains step t on batch t."""

    def data_plan(self, step: int) -> tuple[int, tuple[Row, ...]]:
        """(the global batch step ``step`` trains, the rows that split it)."""
        ...


class RecordSink(Protocol):
    """Takes every record of a run whose records' writer changes with membership, and writes
    those this process claims (``elastic/records.py``)."""

    def attach(self, path: Path) -> None: ...

    def write(self, done: int, record: dict) -> None: ...

    def holds(self, done: int) -> bool:
        """Whether this process wrote the records of step ``done`` (it then writes the summary)."""
        ...

    def close(self) -> None: ...


class ShardMembership(Protocol):
    """Which shards a checkpoint of a changing membership lists (``train/checkpoint.py``'s
    ``ShardedCheckpoint``)."""

    def manifest(self, step: int) -> tuple[list[str], bool]:
        """(the shards the checkpoint after ``step`` steps lists, whether this process writes it)."""
        ...

    def substitute(self, shard: str, listed: list[str]) -> str:
        """The listed shard a missing ``shard`` loads instead."""
        ...


@runtime_checkable
class Membership(Protocol):
    """A mesh whose processes come and go during the run (elastic): where a joiner starts, who
    writes each step's records, which shards a checkpoint lists."""

    joined_at: int | None
    """The step a process that joined a running mesh trains from (None: it started with it)."""
    records: RecordSink
    checkpoint_membership: ShardMembership


@runtime_checkable
class MessageMonitors(Protocol):
    """A runtime where every message passes this process on arrival (the simulator): monitors
    (a verifier) inspect it there."""

    monitor_release: bool
    """Whether a monitor's ``release_s`` decides when the message leaves it on the clock."""

    def attach_monitor(self, monitor: MessageMonitor, charge_time: bool = True) -> None: ...


@runtime_checkable
class TimeModels(Protocol):
    """The link and compute models a simulating runtime charges virtual time with: a plugin that
    simulates processes beside the mesh (the anchor circuit) charges them with the same."""

    network: Network
    compute: ComputeModel
