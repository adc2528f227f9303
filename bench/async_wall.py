"""Wall clock, real processes: the async schedule against the synchronous 1F1B in one run.

The demo model on P=4 stages, D=1, identity codec, every link 200 Mbit/s with 50 ms one-way latency,
``--backend dist``: four processes over gloo on this machine, each sender pacing its link in process
(``dist.shaping=sender``), one intra-op thread each. The two schedules alternate (``--repeats``), so
both see the same machine load. Throughput is summary.json's ``wall_tokens_per_s`` (all tokens over
rank 0's wall time of every step, the final drain included), the same accounting for both.

    python bench/async_wall.py [--steps 16] [--repeats 2]
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

from meshlearn.entry.launch import launch_local

SCHEDULES = {"1f1b": ["mesh.schedule=1f1b"], "async (nadamw, stashing)": ["mesh.schedule=async",
                                                                       "optim.name=nadamw"]}


def overrides(steps: int) -> list[str]:
    return ["mesh.stages=4", "mesh.replicas=1", "codec.name=identity", "link.bandwidth_mbit=200",
            "link.latency_ms=50", f"train.steps={steps}", f"train.eval_every={steps}",
            "train.checkpoint_every=0", "dist.threads=1", "backend=dist"]


def measure(schedule: list[str], steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-async-wall-"))
    sets = [*overrides(steps), *schedule]
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    code = launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO())
    if code != 0:
        raise SystemExit(f"the dist run failed (exit {code}); see {run_dir / 'logs'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    load_before = os.getloadavg()
    measured: dict[str, list[dict]] = {name: [] for name in SCHEDULES}
    for _ in range(args.repeats):
        for name, schedule in SCHEDULES.items():
            measured[name].append(measure(schedule, args.steps))
    base = statistics.mean(s["wall_tokens_per_s"] for s in measured["1f1b"])
    rows = []
    for name, runs in measured.items():
        tps = [s["wall_tokens_per_s"] for s in runs]
        rows.append({"schedule": name, "wall_tokens_per_s": statistics.mean(tps),
                     "ratio": statistics.mean(tps) / base,
                     "val_loss": statistics.mean(s["final_val_loss"] for s in runs),
                     "spread": f"{min(tps):.0f}–{max(tps):.0f}"})
    payload = {"steps": args.steps, "repeats": args.repeats,
               "mesh": "demo model, P=4, D=1, identity codec, 200 Mbit/s / 50 ms, 1 thread per worker, "
                       "dist.shaping=sender", "rows": rows, "cpu_count": os.cpu_count(),
               "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(rows, [("schedule", "schedule", ""),
                                  ("wall_tokens_per_s", "wall tok/s (measured)", ".0f"),
                                  ("ratio", "÷ 1F1B", ".2f"), ("val_loss", "val loss", ".3f"),
                                  ("spread", "range over repeats", "")])
    write_results("async_wall", payload,
                  f"Async vs 1F1B in real processes: demo model, P=4 D=1, {args.steps} steps × "
                  f"{args.repeats} repeats, 4 gloo processes with in-process shaping (200 Mbit/s, 50 ms) "
                  f"on {os.cpu_count()} cores (load average {load_before[0]:.1f} at start); "
                  f"`python bench/async_wall.py`\n\n{table}")


if __name__ == "__main__":
    main()
