"""Simulator fidelity: the simulator's predicted tokens/s against a real multi-process run.

The demo model on P=4 stages, D=1, identity codec, every link 200 (then 50) Mbit/s with 50 ms
one-way latency. The prediction is the SimDriver's virtual clock with ``sim.compute=measured``
(compute durations timed here, one intra-op thread as each real worker has); the measurement is
``--backend dist``: four processes over gloo on this machine, each sender pacing its link in
process (``dist.shaping=sender``), timed by the wall clock of rank 0 around each step. Simulator
and real runs alternate, so both see the same machine load; the first ``--warmup`` steps of each
run are left out (lazy initialisation). Reported: tokens/s of each, and sim ÷ dist (1.0 = exact).

    python bench/sim_fidelity.py [--steps 10] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from common import DEMO, demo_config, markdown_table, write_results

from meshlearn.entry.launch import launch_local
from meshlearn.jsonl import read_records
from meshlearn.train import Trainer


def overrides(bandwidth: float, steps: int) -> list[str]:
    return ["mesh.stages=4", "mesh.replicas=1", "codec.name=identity", f"link.bandwidth_mbit={bandwidth}",
            "link.latency_ms=50", f"train.steps={steps}", "train.eval_every=100000",
            "train.checkpoint_every=0", "sim.compute=measured", "dist.threads=1"]


def step_times(run_dir: Path, key: str, warmup: int) -> list[float]:
    return [r[key] for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"][warmup:]


def simulate(bandwidth: float, steps: int, warmup: int) -> list[float]:
    """Virtual seconds per step, compute timed with one thread (as each dist worker runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-fidelity-sim-"))
    try:
        trainer = Trainer(demo_config(*overrides(bandwidth, steps)), run_dir, progress=False)
        for _ in range(steps):
            trainer.step()
        trainer.metrics.close()
        return step_times(run_dir, "step_sim_s", warmup)
    finally:
        torch.set_num_threads(before)
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(bandwidth: float, steps: int, warmup: int) -> list[float]:
    """Wall seconds per step of the real run (rank 0's clock around each step)."""
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-fidelity-dist-"))
    sets = [*overrides(bandwidth, steps), "backend=dist"]
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    code = launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO())
    if code != 0:
        raise SystemExit(f"the dist run failed (exit {code}); see {run_dir / 'logs'}")
    times = step_times(run_dir, "step_wall_s", warmup)
    shutil.rmtree(run_dir, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidths", default="200,50", help="Mbit/s, comma-separated")
    args = parser.parse_args()

    cfg = demo_config(*overrides(200, args.steps))
    tokens = cfg.train.batch_size * cfg.model.seq_len
    load_before = os.getloadavg()
    rows, raw = [], {}
    for bandwidth in (float(b) for b in args.bandwidths.split(",")):
        sim_s, dist_s = [], []
        for _ in range(args.repeats):  # alternate, so both see the same machine load
            sim_s.append(statistics.mean(simulate(bandwidth, args.steps, args.warmup)))
            dist_s.append(statistics.mean(measure(bandwidth, args.steps, args.warmup)))
        sim_tps = [tokens / s for s in sim_s]
        dist_tps = [tokens / s for s in dist_s]
        raw[f"{bandwidth:g}"] = {"sim_step_s": sim_s, "dist_step_s": dist_s}
        rows.append({
            "link": f"{bandwidth:g} Mbit/s, 50 ms",
            "sim_tokens_per_s": statistics.mean(sim_tps),
            "dist_tokens_per_s": statistics.mean(dist_tps),
            "ratio": statistics.mean(sim_tps) / statistics.mean(dist_tps),
            "spread": (f"sim {min(sim_tps):.0f}–{max(sim_tps):.0f}, "
                       f"dist {min(dist_tps):.0f}–{max(dist_tps):.0f}"),
        })
    payload = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "tokens_per_step": tokens,
               "mesh": "P=4, D=1, identity codec, 1 intra-op thread per worker, dist.shaping=sender",
               "model": vars(cfg.model) | {}, "rows": rows, "step_seconds": raw,
               "cpu_count": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(rows, [("link", "link", ""), ("sim_tokens_per_s", "sim tok/s (predicted)", ".0f"),
                                  ("dist_tokens_per_s", "dist tok/s (measured)", ".0f"),
                                  ("ratio", "sim ÷ dist", ".3f"), ("spread", "range over repeats", "")])
    write_results("sim_fidelity", payload,
                  f"Simulator fidelity: demo model, P=4 D=1, {args.steps} steps ({args.warmup} warm-up "
                  f"left out) × {args.repeats} repeats, 4 gloo processes with in-process shaping on "
                  f"{os.cpu_count()} cores (load average {load_before[0]:.1f} at start); "
                  f"`python bench/sim_fidelity.py`\n\n{table}")


if __name__ == "__main__":
    main()
