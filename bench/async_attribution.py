"""DP attribution under ``mesh.schedule = async`` (issue 32): does counting marks per update,
3·K of the last 8·K updates (K updates a step), report no honest replica where the old countings
did, and still name a ×−4 attacker?

A small model (3 layers of width 32, the demo's corpus) on 3 stages × 4 replicas, M = 2
microbatches, ``update_every`` = 1 (K = 2), per seed and robust rule two runs: clean, and r1s1
scaling its DP contribution by −4 from step 2. Every worker's per-update scores are kept (a
callback beside the built-in ones) and counted three ways: a step's largest score, 3 of 8 steps
(the rule before); 3 of the last 8 updates; 3·K of the last 8·K updates (the rule built,
``dp/attribution.py``). The table sums the honest replicas reported over the seeds.

    OMP_NUM_THREADS=1 python bench/async_attribution.py [--steps 24] [--seeds 1337,0,1,2,3]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import ROOT, demo_config, load_average, markdown_table, write_results

from meshlearn.dp.attribution import OutlierLedger
from meshlearn.hooks import Callback, PluginContext, StepOutput, register_plugin
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "async_attribution"
ATTACKER = "r1s1"
SMALL = ["model.n_layer=3", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "mesh.stages=3",
         "mesh.replicas=4", "mesh.microbatches=2", "mesh.update_every=1", "mesh.schedule=async",
         "train.batch_size=16", "train.warmup_steps=1", "train.eval_every=1000", "train.eval_batches=1",
         "train.checkpoint_every=0"]
ATTACK = ["attack.kind=scaling", "attack.scale=-4", f"attack.workers={ATTACKER}", "attack.target=dp",
          "attack.start_step=1"]


class ScoreLog(Callback):
    """Every step's scores, each worker's per update, as the attribution callback sees them."""

    def __init__(self):
        self.steps: list[dict[str, list[float]]] = []

    def on_step_end(self, step: int, report) -> StepOutput:
        self.steps.append({w: list(s) for w, s in report.dp_scores.items()})
        return StepOutput()


LOG = ScoreLog()


def score_log(ctx: PluginContext) -> Callback:
    LOG.steps = []
    return LOG


def updates_per_step(cfg) -> int:
    """K, the updates of one step under async: ``mesh.microbatches // mesh.update_every``."""
    return cfg.mesh.microbatches // cfg.mesh.update_every


def countings(steps: list[dict[str, list[float]]], cfg) -> dict[str, dict[str, int]]:
    """Who each counting reports (worker → 1-based step) from one run's per-update scores, at the
    run's own ``dp.outlier_score``."""
    score = cfg.dp.outlier_score
    ledgers = {"step": OutlierLedger(score), "update": OutlierLedger(score),
               "built": OutlierLedger(score, updates_per_step(cfg))}
    for step, scores in enumerate(steps):
        ledgers["step"].observe(step, {w: [max(s)] for w, s in scores.items()})
        ledgers["update"].observe(step, scores)
        ledgers["built"].observe(step, scores)
    return {name: ledger.reported for name, ledger in ledgers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seeds", default="1337,0,1,2,3")
    parser.add_argument("--rules", default="centered_clip,median")
    args = parser.parse_args()
    torch.set_num_threads(1)
    register_plugin("score_log", score_log)
    load_before, started = load_average(), time.perf_counter()
    runs = []
    for rule in args.rules.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name, sets in (("clean", []), ("attacked", ATTACK)):
                cfg = demo_config(*SMALL, f"train.steps={args.steps}", f"dp.robust={rule}", f"seed={seed}",
                                  *sets)
                Trainer(cfg, OUT / f"{rule}-{seed}-{name}", progress=False).train()
                runs.append({"rule": rule, "seed": seed, "run": name, "reported": countings(LOG.steps, cfg)})
    rows, k = [], updates_per_step(demo_config(*SMALL))
    for rule in args.rules.split(","):
        for counting, label in (("step", "a step's largest, 3 of 8 steps (before)"),
                                ("update", "3 of the last 8 updates"),
                                ("built", f"{3 * k} of the last {8 * k} updates (built)")):
            mine = [r for r in runs if r["rule"] == rule]
            honest = {run: sum(len([w for w in r["reported"][counting] if w != ATTACKER or run == "clean"])
                               for r in mine if r["run"] == run) for run in ("clean", "attacked")}
            named = [r["reported"][counting].get(ATTACKER) for r in mine if r["run"] == "attacked"]
            rows.append({"rule": rule, "counting": label, "clean": honest["clean"],
                         "attacked": honest["attacked"],
                         "attacker": ", ".join("never" if s is None else str(s) for s in named)})
    columns = [("rule", "rule", ""), ("counting", "counting", ""),
               ("clean", "honest reported, clean runs", "d"),
               ("attacked", "honest reported, attacked runs", "d"),
               ("attacker", "attacker reported at step", "")]
    command = f"OMP_NUM_THREADS=1 python bench/async_attribution.py --steps {args.steps} --seeds {args.seeds}"
    header = (f"`{command}`: "
              f"{time.perf_counter() - started:.0f} s wall, load {load_before} before / {load_average()} "
              f"after (1, 5, 15 min). Seeds {args.seeds}, {args.steps} steps, r1s1 ×−4 from step 2 in the "
              "attacked runs.")
    write_results("async_attribution", {"steps": args.steps, "seeds": args.seeds, "runs": runs},
                  "# DP attribution under async\n\n" + header + "\n\n" + markdown_table(rows, columns))


if __name__ == "__main__":
    main()
