"""Where each run stands: finished, stopped early (by a signal or ``train.stop_at_step``), still in
progress, or ended without a summary. A report of an unfinished run says so first, with the command
that continues it, because its numbers are not the run's final ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshlearn.report.records import RunData
from meshlearn.report.units import as_number
from meshlearn.train.closing import resume_hint
from meshlearn.train.rundir import running_holder


@dataclass(frozen=True)
class RunStatus:
    state: str  # finished | stopped | in progress | ended
    step: int | None  # the last step the run recorded
    total: int | None  # train.steps
    line: str  # what the report says, one sentence


def _total(run: RunData) -> int | None:
    steps = as_number((run.config.get("train") or {}).get("steps"))
    return int(steps) if steps is not None else None


def _last_step(run: RunData) -> int | None:
    steps = as_number((run.summary or {}).get("steps"))
    if steps is None and run.train_records:
        steps = as_number(run.train_records[-1].get("step"))
    return int(steps) if steps is not None else None


def _is_cluster(run: RunData) -> bool:
    """A ``[cluster]`` run under ``--backend dist``: it resumes on each machine with ``--host``."""
    return run.config.get("backend") == "dist" and bool((run.config.get("cluster") or {}).get("hosts"))


def run_status(run: RunData) -> RunStatus:
    step, total = _last_step(run), _total(run)
    at = f"step {step if step is not None else 0} of {total if total is not None else '?'}"
    resume = resume_hint(run.path, cluster=_is_cluster(run))
    holder = running_holder(run.path)
    if holder is not None:
        who = f" (pid {holder['pid']} on {holder['host']})" if "pid" in holder and "host" in holder else ""
        return RunStatus("in progress", step, total, f"{run.label}: in progress{who}, at {at}; the figures "
                                                     "show what it has written so far")
    if run.summary is None:
        return RunStatus("ended", step, total, f"{run.label}: ended at {at} without a summary (killed or "
                                               f"crashed); {resume} (from its last checkpoint)")
    signal = run.summary.get("interrupted")
    if signal:
        return RunStatus("stopped", step, total, f"{run.label}: stopped at {at} by {signal}; {resume}")
    if step is not None and total is not None and step < total:
        return RunStatus("stopped", step, total, f"{run.label}: stopped at {at} (train.stop_at_step); "
                                                 f"{resume}")
    return RunStatus("finished", step, total, f"{run.label}: finished ({at})")


def unfinished_lines(runs: Sequence[RunData]) -> list[str]:
    """One sentence per run that is not finished, for the top of the report."""
    return [status.line for status in map(run_status, runs) if status.state != "finished"]
