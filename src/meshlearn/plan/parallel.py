"""The planner's simulations, spread over processes.

A table needs up to a few hundred cost-only simulations (every row, each row at each bandwidth
of the sweep; with ``binds = doubling`` each row with each resource doubled), each one
independent of the others and deterministic. They are listed first, duplicates dropped, and
run on ``processes`` forked children: each child runs the same ``steady``/``predict`` a
serial run would, so the numbers are the same, bit for bit, whatever the count
(``tests/plan/test_fast.py`` checks it).
The parent builds the meta-device stage modules before forking, so every child inherits them
and torch's one-time meta machinery instead of paying for both again.
"""

from __future__ import annotations

import gc
import multiprocessing
import os

from meshlearn.config import RunConfig
from meshlearn.plan.cost import meta_stages
from meshlearn.plan.steady import Prediction, horizon, predict, steady

# (what, config, mask keep, critical path): "steady" (a method row, a doubling, a sweep point) or
# "predict" (the configuration as given, over its whole run); critical path: its window splits
# its critical path by resource (``plan.critical``: the rows, when binds come from the path).
Job = tuple[str, RunConfig, float | None, bool]


def default_processes() -> int:
    """The CPUs this process may run on (each simulation is single-threaded Python)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _run(job: Job) -> Prediction:
    what, cfg, keep, critical = job
    return (predict if what == "predict" else steady)(cfg, keep, critical_path=critical)


def _cost(job: Job) -> int:
    """A rough size of a simulation (steps × workers × microbatches): the largest go first, so
    no child is left with a long one at the end."""
    cfg = job[1]
    return horizon(cfg).steps * cfg.mesh.stages * cfg.mesh.replicas * cfg.mesh.microbatches


def run_all(jobs: list[Job], processes: int) -> dict[Job, Prediction]:
    """Every job's prediction, keyed by the job."""
    unique = sorted(set(jobs), key=_cost, reverse=True)
    for model, stages in {(j[1].model, j[1].mesh.stages) for j in unique}:
        meta_stages(model, stages)  # built once here, inherited by every child
    # What lives as long as the process (the stage modules, torch's meta machinery) is moved out
    # of the collector's sight: a simulation allocates millions of short-lived objects, and each
    # full collection walked all of it again (about a tenth of a simulation's time).
    gc.freeze()
    if processes <= 1 or len(unique) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return {job: _run(job) for job in unique}
    with multiprocessing.get_context("fork").Pool(min(processes, len(unique))) as pool:
        return dict(zip(unique, pool.map(_run, unique, chunksize=1), strict=True))


__all__ = ["Job", "default_processes", "run_all"]
