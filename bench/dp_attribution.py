"""Attribution of DP outliers (issue 32, step 3): how often an honest replica is marked, and how
soon a ×−4 DP attacker is reported, on the demo mesh with 4 replicas and ``dp.robust = median``.

Two runs, one process each: a clean one (every (worker, step) score is an honest one: the
false-positive rate of a mark at each threshold, and whether anybody is reported) and one where
r1s1 scales its DP contribution by −4 from ``--attack-start`` (its scores, the step its report
comes at, and whether anybody else is marked). Every score is kept (a callback beside the built-in
ones), so thresholds other than the default can be read off the same runs.

    OMP_NUM_THREADS=1 python bench/dp_attribution.py [--steps 100] [--attack-steps 60] [--attack-start 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from common import ROOT, demo_config, load_average, markdown_table, write_results

from meshlearn.dp.attribution import COUNT, WINDOW
from meshlearn.hooks import Callback, PluginContext, StepOutput, register_plugin
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "dp_attribution"
ATTACKER = "r1s1"
THRESHOLDS = (2.0, 2.5, 3.0, 4.0, 5.0)


class ScoreLog(Callback):
    """Every step's scores, as the attribution callback sees them."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_step_end(self, step: int, report) -> StepOutput:
        self.steps.append(dict(report.dp_scores))
        return StepOutput()


LOG = ScoreLog()  # this process's (one run at a time per process)


def score_log(ctx: PluginContext) -> Callback:
    LOG.steps = []
    return LOG


def run_one(job: tuple[str, int, int]) -> dict:
    name, steps, start = job
    torch.set_num_threads(1)
    register_plugin("score_log", score_log)
    sets = ["mesh.replicas=4", "dp.robust=median", f"train.steps={steps}", f"train.eval_every={steps}",
            "train.checkpoint_every=0"]
    if name != "clean":
        sets += ["attack.kind=scaling", "attack.scale=-4", f"attack.workers={ATTACKER}", "attack.target=dp",
                 f"attack.start_step={start}"]
    cfg = demo_config(*sets)
    run_dir = OUT / f"{name}-{steps}"
    started = time.perf_counter()
    summary = Trainer(cfg, run_dir, progress=False).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"name": name, "steps": steps, "attack_start": start if name != "clean" else None,
            "threshold": cfg.dp.outlier_score, "wall_s": time.perf_counter() - started,
            "scores": LOG.steps, "reports": [r for r in records if r["kind"] == "dp_outlier"],
            "dp_outliers": summary["dp_outliers"],
            "val_loss": summary["final_val_loss"], "load_after": load_average()}


def honest_scores(run: dict) -> list[float]:
    """Every score of a replica that never attacks (in the attacked run: all but the attacker's)."""
    return [s for step in run["scores"] for w, s in step.items() if run["name"] == "clean" or w != ATTACKER]


def row(run: dict) -> dict:
    honest = sorted(honest_scores(run))
    out = {"run": run["name"], "steps": run["steps"], "honest scores": len(honest),
           "honest max": honest[-1], "honest median": statistics.median(honest)}
    for t in THRESHOLDS:
        out[f"marks >{t:g}"] = sum(s > t for s in honest)
    reported = {r["worker"]: r["step"] for r in run["reports"]}
    out["reported"] = ", ".join(f"{w}@{s}" for w, s in reported.items()) or "nobody"
    if run["name"] != "clean":
        start = run["attack_start"]  # 0-based step index of the first attacked update
        mine = [step[ATTACKER] for step in run["scores"][start:]]
        out["attacker min"], out["attacker median"] = min(mine), statistics.median(mine)
        out["steps to report"] = reported[ATTACKER] - start if ATTACKER in reported else "never"
    else:
        out["attacker min"] = out["attacker median"] = out["steps to report"] = "-"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the clean run")
    parser.add_argument("--attack-steps", type=int, default=60, help="steps of the attacked run")
    parser.add_argument("--attack-start", type=int, default=30, help="attack.start_step (0-based)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    load_before = load_average()
    jobs = [("clean", args.steps, 0), ("scale_-4", args.attack_steps, args.attack_start)]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(run_one, jobs))
    rows = [row(run) for run in runs]
    columns = [("run", "run", ""), ("steps", "steps", "d"), ("honest scores", "honest scores", "d"),
               ("honest median", "honest median", ".2f"), ("honest max", "honest max", ".2f"),
               *[(f"marks >{t:g}", f"honest marks >{t:g}", "d") for t in THRESHOLDS],
               ("attacker min", "attacker min", ".2f"), ("attacker median", "attacker median", ".2f"),
               ("reported", "reported (worker@step)", ""), ("steps to report", "steps to report", "")]
    note = (f"demo, mesh.replicas=4, dp.robust=median, dp.outlier_score={runs[0]['threshold']:g}, "
            f"reported at {COUNT} marks in {WINDOW}; attacker {ATTACKER} ×−4 on its DP contribution from "
            f"step {args.attack_start + 1}; {args.jobs} jobs, OMP_NUM_THREADS=1; load before {load_before}, "
            f"after {runs[-1]['load_after']}; wall "
            + ", ".join(f"{r['name']} {r['wall_s']:.0f} s" for r in runs))
    title = "# DP outlier attribution (bench/dp_attribution.py)"
    write_results("dp_attribution", {"runs": runs, "rows": rows, "note": note},
                  f"{title}\n\n{note}\n\n{markdown_table(rows, columns)}")


if __name__ == "__main__":
    main()
