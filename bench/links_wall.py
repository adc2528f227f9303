"""Wall clock, real processes: a verified run's links over gloo against our framed TCP.

One small verified mesh (P=3 stages × D=2 replicas plus the SENTINEL verifier that relays every
pipeline hop: 7 processes), the same config three ways: pipeline links and collectives over gloo
(``dist.links = collective``, trusted), pipeline links over framed TCP with the DP all-reduce and
the gathers still gloo collectives (``tcp``, ``dist.trusted_links = "true"``), and everything
framed, no process group (``tcp``, ``"false"``); once with in-process link shaping (100 Mbit/s,
10 ms) and once unshaped (loopback speed). The number is the median ``step_wall_s`` of rank 0's
records after the first three steps (start-up and warm-up excluded); the settings alternate, so
all see the same machine load.

    python bench/links_wall.py [--steps 30]
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

MESH = ["model.n_layer=3", "model.d_model=64", "model.n_head=2", "model.seq_len=32", "mesh.stages=3",
        "mesh.replicas=2", "mesh.microbatches=2", "train.batch_size=8", "train.warmup_steps=1",
        "train.eval_batches=1", "train.checkpoint_every=0", "link.bandwidth_mbit=100",
        "link.latency_ms=10", "verify.name=sentinel", "verify.warmup_steps=3", "dist.threads=1",
        "backend=dist"]
SHAPINGS = ("sender", "none")
LINKS = (("collective", "true"), ("tcp", "true"), ("tcp", "false"))  # dist.links, dist.trusted_links


def measure(steps: int, shaping: str, links: str, trusted: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="meshlearn-links-wall-"))
    sets = [*MESH, f"train.steps={steps}", f"train.eval_every={steps}", f"dist.shaping={shaping}",
            f"dist.links={links}", f"dist.trusted_links={trusted}"]
    argv = ["--config", str(DEMO), "--out", str(run_dir), *(x for s in sets for x in ("--set", s))]
    code = launch_local(argv, demo_config(*sets), run_dir, out=io.StringIO())
    if code != 0:
        raise SystemExit(f"the dist run failed (exit {code}); see {run_dir / 'logs'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [r["step_wall_s"] for r in records if r["kind"] == "train"][3:]
    final = [r["train_loss"] for r in records if r["kind"] == "train"][-1]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"shaping": shaping, "links": links, "trusted_links": trusted,
            "median_step_wall_s": statistics.median(walls), "final_train_loss": final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [measure(args.steps, shaping, links, trusted) for shaping in SHAPINGS for links, trusted in LINKS]
    payload = {"steps": args.steps, "mesh": MESH, "rows": rows, "cpu_count": os.cpu_count(),
               "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    table = markdown_table(rows, [("shaping", "dist.shaping", ""), ("links", "dist.links", ""),
                                  ("trusted_links", "dist.trusted_links", ""),
                                  ("median_step_wall_s", "median s/step", ".3f"),
                                  ("final_train_loss", "final train loss", ".5f")])
    write_results("links_wall", payload,
                  f"A verified run's links, gloo (`collective`) vs framed TCP (`tcp`), its DP all-reduce "
                  f"and gathers gloo (`trusted_links` true) vs framed (false): P=3 × D=2 + the "
                  f"verifier (7 processes), demo corpus, d 64, 3 layers, seq 32, batch 8, "
                  f"{args.steps} steps, "
                  f"one run each on {os.cpu_count()} cores (load average {load_before[0]:.1f} at start, "
                  f"{payload['load_avg_after'][0]:.1f} at the end); `python bench/links_wall.py`\n\n{table}")


if __name__ == "__main__":
    main()
