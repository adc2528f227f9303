"""Real processes: does the training loop wait on the DP axis? All-reduce against AsyncMesh's sparse rounds.

The demo model on P = 2 stages × D = 2 replicas (4 processes, ``--backend dist`` over gloo on this
machine, one intra-op thread each), every link 200 Mbit/s / 50 ms shaped in process
(``dist.shaping=sender``), ``train.batch_size = 32``. Cases: the 1F1B and async pipelines with the
blocking fp32 gradient all-reduce, and with ``dp.name=sparse`` (AsyncMesh: fraction 0.05, delay 10,
rule ema; under async also with ``dp.deadline_s=1`` instead of the derived deadline). Per run:
wall tokens/s (summary.json: tokens over rank 0's wall time of every step), and the wall time
updates waited on the DP axis per worker and step:

- sparse: summary.json's ``dp_wait_s`` (summed over workers): the time from the end of an update's
  optimizer step to its apply, i.e. delivering what already arrived, waiting for a round only if it
  is due and missing (bounded by its deadline), and the merge itself.
- allreduce: the DistDriver accumulates the same counter around its all-reduce (from the call to
  the shaped release: waiting for the slowest replica plus the modelled ring time) but summary.json
  reports ``dp_wait_s`` only for message-based strategies. This script exports it: the workers
  import this file as their ``__mp_main__`` (forkserver), and the patch below makes
  ``DPAxis.summary`` (distributed/dp_axis.py) gather that counter for ``allreduce`` too (marked
  ``dp_wait_source``). As a cross-check independent of the patch, the table also shows the wall
  time per step of each all-reduce run minus its sparse twin's.

    python bench/asyncmesh_wall.py [--steps 12] [--repeats 1]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from common import DEMO, demo_config, markdown_table, write_results

from meshlearn.distributed.dp_axis import DPAxis
from meshlearn.entry.launch import launch_local

_original_dp_summary = DPAxis.summary


def _dp_summary_with_allreduce(self, sum_over_workers) -> dict:
    """As the driver's, plus the all-reduce's own wait counter when the strategy is ``allreduce``."""
    if self.strategy is not None or self.mesh.replicas == 1:
        return _original_dp_summary(self, sum_over_workers)
    [total] = sum_over_workers([self.wait_s])
    return {"dp_wait_s": total, "dp_wait_source": "bench patch: DPAxis.wait_s"}


DPAxis.summary = _dp_summary_with_allreduce  # in this process and every worker

SPARSE = ["dp.name=sparse", "dp.fraction=0.05", "dp.delay=10", "dp.rule=ema"]
ASYNC = ["mesh.schedule=async", "optim.name=nadamw"]
CASES = {
    "1f1b + allreduce": ["mesh.schedule=1f1b", "dp.name=allreduce"],
    "1f1b + sparse (AsyncMesh)": ["mesh.schedule=1f1b", *SPARSE],
    "async + allreduce": [*ASYNC, "dp.name=allreduce"],
    "async + sparse (AsyncMesh)": [*ASYNC, *SPARSE],
    # the derived deadline (2 × the modelled transfer of one round, ~0.11 s here) against one that
    # leaves room for replicas that start a round at different wall times (CPU contention)
    "async + sparse (AsyncMesh), dp.deadline_s=1": [*ASYNC, *SPARSE, "dp.deadline_s=1"],
}
TWIN = {"1f1b + allreduce": "1f1b + sparse (AsyncMesh)",
        "async + allreduce": "async + sparse (AsyncMesh), dp.deadline_s=1"}


def overrides(steps: int, extra: list[str]) -> list[str]:
    return ["mesh.stages=2", "mesh.replicas=2", "mesh.microbatches=4", "train.batch_size=32",
            "codec.name=identity", "link.bandwidth_mbit=200", "link.latency_ms=50", *extra,
            f"train.steps={steps}", f"train.eval_every={steps}", "train.checkpoint_every=0",
            "dist.threads=1", "backend=dist"]


def measure(case: list[str], steps: int, extra: list[str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-asyncmesh-wall-"))
    sets = [*overrides(steps, extra), *case]
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    code = launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO())
    if code != 0:  # kept, not fatal: a failure is a result (see docs/asyncmesh.md, known bugs)
        errors = sorted({line.strip() for log in (run_dir / "logs").glob("*.log")
                         for line in log.read_text().splitlines() if "error:" in line})
        return {"failed": f"exit {code}: " + " | ".join(errors)[:300], "logs": str(run_dir / "logs")}
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dp-bandwidth", type=float, default=0.0,
                        help="links.dp_bandwidth_mbit (0 = the 200 Mbit/s of every link)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    extra = [f"links.dp_bandwidth_mbit={args.dp_bandwidth:g}"] if args.dp_bandwidth else []
    cfg = demo_config(*overrides(args.steps, extra))
    workers = cfg.mesh.stages * cfg.mesh.replicas
    tokens = cfg.train.batch_size * cfg.model.seq_len
    load_before = os.getloadavg()
    measured: dict[str, list[dict]] = {name: [] for name in CASES}
    for _ in range(args.repeats):  # alternate, so every case sees the same machine load
        for name, case in CASES.items():
            measured[name].append(measure(case, args.steps, extra))
            s = measured[name][-1]
            if "failed" in s:
                print(f"{name}: FAILED {s['failed']}", flush=True)
                continue
            print(f"{name}: {s['wall_tokens_per_s']:.0f} tok/s, dp_wait_s {s.get('dp_wait_s')}, "
                  f"rounds {s.get('dp_rounds')}, dropped {s.get('dp_dropped_rounds')}", flush=True)
    rows = []
    for name, tries in measured.items():
        runs = [s for s in tries if "failed" not in s]
        failures = [s["failed"] for s in tries if "failed" in s]
        if not runs:
            rows.append({"run": name, "failed_runs": len(failures), "failures": failures})
            continue
        step_s = statistics.mean(s["wall_time_s"] / args.steps for s in runs)
        waits = [s["dp_wait_s"] / (workers * args.steps) for s in runs if "dp_wait_s" in s]
        rows.append({
            "run": name, "wall_tokens_per_s": statistics.mean(s["wall_tokens_per_s"] for s in runs),
            "wall_step_s": step_s,
            "dp_wait_per_worker_step_s": statistics.mean(waits) if waits else None,
            "dp_wait_share": (statistics.mean(waits) / step_s) if waits else None,
            "dp_wait_source": runs[0].get("dp_wait_source", "summary.json" if waits else "absent"),
            "dp_rounds": sum(s.get("dp_rounds", 0) for s in runs),
            "dp_dropped_rounds": sum(s.get("dp_dropped_rounds", 0) for s in runs),
            "bytes_per_token_dp": statistics.mean(s["bytes_per_token_dp"] for s in runs),
            "val_loss": statistics.mean(s["final_val_loss"] for s in runs),
            "failed_runs": len(failures), "failures": failures,
            "spread": "–".join(f"{v:.0f}" for v in sorted({round(s["wall_tokens_per_s"]) for s in runs})),
        })
    by = {r["run"]: r for r in rows}
    for r in rows:
        twin = by.get(TWIN.get(r["run"], ""))
        ok = twin and "wall_step_s" in twin and "wall_step_s" in r
        r["step_minus_sparse_twin_s"] = r["wall_step_s"] - twin["wall_step_s"] if ok else None
    keys = [k for k in rows[0] if k not in ("run", "failed_runs", "failures")]
    shown = [r | {k: "—" if r.get(k) is None else r[k] for k in keys}
             | {"runs": f"{args.repeats - r['failed_runs']}/{args.repeats}"} for r in rows]
    payload = {"steps": args.steps, "repeats": args.repeats, "tokens_per_step": tokens,
               "mesh": "demo model, P=2, D=2, identity codec, 200 Mbit/s / 50 ms"
                       + (f", DP links {args.dp_bandwidth:g} Mbit/s" if args.dp_bandwidth else "")
                       + ", 1 thread per worker, dist.shaping=sender",
               "rows": rows, "raw": measured, "cpu_count": os.cpu_count(),
               "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(shown, [
        ("run", "run", ""), ("wall_tokens_per_s", "wall tok/s", ".0f"),
        ("wall_step_s", "wall s / step", ".3f"),
        ("dp_wait_per_worker_step_s", "DP wait s / worker-step", ".4f"),
        ("dp_wait_share", "÷ step", ".1%"), ("step_minus_sparse_twin_s", "step − sparse twin (s)", ".3f"),
        ("dp_rounds", "DP rounds", "d"), ("dp_dropped_rounds", "dropped", "d"),
        ("bytes_per_token_dp", "DP B/token", ".0f"), ("val_loss", "val loss", ".3f"),
        ("dp_wait_source", "DP wait from", ""), ("runs", "runs ok", "")])
    failed = [f"- {r['run']}: {f}" for r in rows for f in r["failures"]]
    if failed:
        table += "\n\nFailed runs (not in the means):\n\n" + "\n".join(failed)
    name = "asyncmesh_wall" + (f"_{args.tag}" if args.tag else "")
    write_results(name, payload,
                  f"DP wait in real processes: demo model, P=2 D=2, {args.steps} steps × {args.repeats} "
                  f"repeat(s), 4 gloo processes with in-process shaping (200 Mbit/s, 50 ms"
                  f"{f'; DP links {args.dp_bandwidth:g} Mbit/s' if args.dp_bandwidth else ''}) on "
                  f"{os.cpu_count()} cores (load average {load_before[0]:.1f} at start); "
                  f"`python bench/asyncmesh_wall.py --steps {args.steps} --repeats {args.repeats}"
                  f"{f' --dp-bandwidth {args.dp_bandwidth:g}' if args.dp_bandwidth else ''}`\n\n{table}")


if __name__ == "__main__":
    main()
