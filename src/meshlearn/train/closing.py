"""The line that ends a run and its exit code, the same under every driver and however the run ended.

A run ends in one of three ways (docs/runs.md, "How a run ends"):

- it reached ``train.steps``: ``done: …``, exit 0;
- it reached ``train.stop_at_step``: ``stopped at step N of M (train.stop_at_step) …`` with the
  resume command, exit 0 (the run did what it was asked);
- a SIGINT or SIGTERM came: ``stopped by SIGINT after step N of M …`` with the resume command,
  exit 128 + the signal's number (130, 143) — also when the signal came too late to move the stop
  (during the last steps or the final evaluation): the caller asked to stop, and a shell or a
  scheduler reads the exit code.

Each line says what the run has: its last validation loss, or that none was computed yet (a run
stopped before its first evaluation), and the throughput the caller measured. A ``[cluster]`` run
resumes with one command per machine, each with its own ``--host`` (docs/cluster.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Closing:
    """What a run prints last (``line``; to stderr when ``code`` is not 0) and its exit code."""

    line: str
    code: int


def resume_hint(run_dir: Path | str, cluster: bool = False) -> str:
    """How to continue a run: ``cluster`` (a ``[cluster]`` run under ``--backend dist``, elastic or
    not) on every machine, each naming itself with ``--host``."""
    if cluster:
        return f"continue on every machine with: meshlearn train --resume {run_dir} --host NAME --key FILE"
    return f"continue with: meshlearn train --resume {run_dir}"


def closing(summary: dict, steps: int, stop_at_step: int, signal_name: str | None, signal_code: int,
            run_dir: Path, rates: str, cluster: bool = False) -> Closing:
    """The closing of a run whose ``summary`` (Trainer.summary) is in hand.

    ``steps``/``stop_at_step``: the config's ``train.steps`` and ``train.stop_at_step``;
    ``signal_name``: the signal that asked the run to stop (None: none came), ``signal_code`` its
    exit code; ``rates``: the throughput, as the driver measures it (``12k tok/s wall``);
    ``cluster``: a ``[cluster]`` run, resumed on each machine with its ``--host``."""
    done = summary["steps"]
    val = summary["final_val_loss"]
    validation = f"val loss {val:.4f}" if val is not None else "no validation yet"
    resume = resume_hint(run_dir, cluster)
    if signal_name is not None and done < steps:
        return Closing(f"meshlearn: stopped by {signal_name} after step {done} of {steps} with a checkpoint "
                       f"({validation}); {resume}", signal_code)
    if done < steps:
        return Closing(f"stopped at step {done} of {steps} (train.stop_at_step = {stop_at_step}) with a "
                       f"checkpoint, {validation}, {rates} → {run_dir}; {resume}", 0)
    line = f"done: {done} steps, {validation}, {rates} → {run_dir}"
    if signal_name is not None:  # at the last step or during the final evaluation
        return Closing(f"{line} ({signal_name} came as the run finished: nothing was left to stop)",
                       signal_code)
    return Closing(line, 0)


def rate(tokens_per_s: float | None, what: str) -> str:
    """``12345 tok/s wall``, or ``— tok/s wall`` when nothing was timed (no step ran)."""
    return f"{tokens_per_s:.0f} tok/s {what}" if tokens_per_s is not None else f"— tok/s {what}"
