"""The dist verifier's wall cost: the same dist run with and without SENTINEL's verifier process.

With ``verify.name = sentinel`` every pipeline message goes worker → verifier → worker
(docs/sentinel.md, "The distributed backend"): one extra hop through a process that inspects it.
This bench runs the demo model over real processes (gloo on this machine, every sender pacing its
link in process, ``dist.shaping = sender``) twice per case, with the verifier and without (same
links, same seed), and reports:

- the wall seconds per step of rank 0 (the trainer's ``run_step`` time, which leaves out
  evaluation and checkpoints) over the second half of a run of 2 × ``--steps`` steps: the first
  half ends in a drain point (``train.eval_every = --steps``, one validation batch), so lazy
  initialisation stays out; under async the pipeline refills after it in both runs alike;
- the verifier process's own CPU seconds per step (every thread: receiving, checking, inspecting,
  forwarding, closing steps; ``trust.verifier_cost.process_cpu_s``) and the inspections' share
  (``cpu_s``, this thread's CPU inside ``Sentinel.inspect``).

Verified and plain runs alternate, so both see the same machine load. Nothing here is a virtual
clock: on a machine with fewer cores than processes the verifier's CPU competes with the
workers', which the wall overhead includes.

    python bench/sentinel_dist.py [--steps 8] [--repeats 2]
        [--meshes 4x1,2x2] [--schedules 1f1b,async] [--links 200:50,inf:0]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import DEMO, demo_config, markdown_table, write_results

from meshlearn.entry.launch import launch_local
from meshlearn.jsonl import read_records


def overrides(mesh: str, schedule: str, link: str, steps: int, verify: bool) -> list[str]:
    stages, replicas = mesh.split("x")
    bandwidth, latency = link.split(":")
    out = [f"mesh.stages={stages}", f"mesh.replicas={replicas}", f"mesh.schedule={schedule}",
           f"link.bandwidth_mbit={bandwidth}", f"link.latency_ms={latency}", f"train.steps={2 * steps}",
           f"train.eval_every={steps}", "train.eval_batches=1", "train.checkpoint_every=0",
           "dist.threads=1", "backend=dist"]
    if schedule == "async":
        out.append("optim.name=nadamw")  # the async pairing of docs/async.md
    if verify:
        # Fences on after the first half: the steps measured are scored, not warm-up.
        out += ["verify.name=sentinel", f"verify.warmup_steps={steps}", "verify.decision_log=none"]
    return out


def run_once(sets: list[str], steps: int) -> dict:
    """One dist run: rank 0's wall seconds per step after the first drain, and the verifier's cost."""
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-sentinel-dist-"))
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    started = time.monotonic()
    code = launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO())
    if code != 0:
        raise SystemExit(f"the dist run failed (exit {code}); see {run_dir / 'logs'}")
    train = [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    # wall_time_s: the trainer's summed run_step time when the record was written (at each
    # step's end under the flushing schedules, at the drain point under async).
    at_drain, at_end = train[steps - 1]["wall_time_s"], train[-1]["wall_time_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    cost = summary.get("trust", {}).get("verifier_cost")
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"step_wall_s": (at_end - at_drain) / steps, "run_wall_s": time.monotonic() - started,
            "final_train_loss": summary["final_train_loss"], "verifier_cost": cost}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="steps measured, after as many more")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--meshes", default="4x1,2x2", help="stages x replicas, comma-separated")
    parser.add_argument("--schedules", default="1f1b,async")
    parser.add_argument("--links", default="200:50,inf:0", help="Mbit/s:ms one way, comma-separated")
    args = parser.parse_args()

    cfg = demo_config()
    load_before = os.getloadavg()
    wall_started = time.monotonic()
    rows, raw = [], {}
    for mesh in args.meshes.split(","):
        for schedule in args.schedules.split(","):
            for link in args.links.split(","):
                case = {"plain": [], "verified": []}
                for _ in range(args.repeats):  # alternate, so both see the same machine load
                    for name, verify in (("plain", False), ("verified", True)):
                        sets = overrides(mesh, schedule, link, args.steps, verify)
                        case[name].append(run_once(sets, args.steps))
                raw[f"{mesh} {schedule} {link}"] = case
                plain = [r["step_wall_s"] for r in case["plain"]]
                verified = [r["step_wall_s"] for r in case["verified"]]
                costs = [r["verifier_cost"] for r in case["verified"]]
                stages, replicas = (int(x) for x in mesh.split("x"))
                messages = 2 * (stages - 1) * replicas * cfg.mesh.microbatches
                bandwidth, latency = link.split(":")
                links = "unshaped loopback" if bandwidth == "inf" else f"{bandwidth} Mbit/s, {latency} ms"
                rows.append({
                    "mesh": f"P={stages} D={replicas}", "schedule": schedule, "link": links,
                    "plain_s": statistics.mean(plain), "verified_s": statistics.mean(verified),
                    "overhead": statistics.mean(verified) / statistics.mean(plain) - 1,
                    "messages": messages,
                    "process_cpu_s": statistics.mean(c["process_cpu_s_per_step"] for c in costs),
                    "inspect_ms": statistics.mean(c["cpu_ms_per_message"] for c in costs),
                    "spread": (f"plain {min(plain):.3f}–{max(plain):.3f}, "
                               f"verified {min(verified):.3f}–{max(verified):.3f}"),
                })
    payload = {"steps": args.steps, "repeats": args.repeats,
               "model": vars(cfg.model) | {}, "microbatches": cfg.mesh.microbatches,
               "batch_size": cfg.train.batch_size, "rows": rows, "runs": raw,
               "cpu_count": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
               "wall_s": time.monotonic() - wall_started}
    table = markdown_table(rows, [
        ("mesh", "mesh", ""), ("schedule", "schedule", ""), ("link", "links", ""),
        ("plain_s", "s/step without verifier", ".3f"), ("verified_s", "s/step with verifier", ".3f"),
        ("overhead", "wall overhead", "+.1%"), ("messages", "messages/step", "d"),
        ("process_cpu_s", "verifier CPU s/step (process)", ".3f"),
        ("inspect_ms", "inspection CPU ms/message", ".2f"), ("spread", "range over repeats", "")])
    write_results("sentinel_dist", payload,
                  f"The dist verifier's wall cost: demo model over real gloo processes on "
                  f"{os.cpu_count()} cores (load average {load_before[0]:.1f} at start), "
                  f"the second {args.steps} steps of {2 * args.steps} (after a drain point) "
                  f"× {args.repeats} repeats, with and without the verifier process "
                  f"(verify.warmup_steps = {args.steps}: the measured steps are scored); "
                  f"`python bench/sentinel_dist.py --steps {args.steps} "
                  f"--repeats {args.repeats} --meshes {args.meshes} --schedules {args.schedules} "
                  f"--links {args.links}`; {(time.monotonic() - wall_started) / 60:.1f} min\n\n{table}")


if __name__ == "__main__":
    main()
