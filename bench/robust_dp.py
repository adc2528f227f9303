"""Robust DP aggregation against a poisoned DP contribution (issue 32), on the demo mesh with 4
replicas: every DP strategy × {no attack, ×−4 scaling, sign flip, slow bias ramp} × {dp.robust
none, each robust rule}. One attacker (``--attacker``, by default r1s1: a middle stage; 25% of its
stage's replicas) corrupts its DP contribution only (``attack.target = dp``) from ``--attack-start``.
Warm-up is a tenth of ``--steps`` unless ``--warmup`` says otherwise (the demo's own is 20).

Per row: final validation loss, virtual tokens/s (the simulator's device model, links at the demo's
200 Mbit/s), DP bytes per token, the DP outlier scores seen (0: the run scored none), the marks of
the attacker and of honest replicas (a score above ``dp.outlier_score``), and who was evicted as a
DP outlier at which step (docs/dp_robust.md, Attribution). ``--report-only`` sets
``verify.ban = false`` on the robust rows: attribution reports but never evicts, so a robust row
is the rule alone (rows under the mean score nothing and are shared with the evicting table). Each
strategy's clean run under the mean, the reference of its rows' goals, is always in the table.
Goals checked per row: under attack,
within 0.05 of the clean loss of the same strategy with dp.robust = none; clean cost of each rule
≤ 2% in loss and ≤ 20% in virtual tokens/s against none. Runs are independent processes
(``--jobs``), one torch thread each.

    OMP_NUM_THREADS=1 python bench/robust_dp.py [--steps 40] [--jobs 1]
    python bench/robust_dp.py --strategies allreduce --rules none,median  # a slice
    # the issue's red-team setting: r1s2 from step 51 of 100, the demo's warm-up
    python bench/robust_dp.py --steps 100 --attack-start 50 --attacker r1s2 --warmup 20 --tag redteam
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from common import ROOT, demo_config, finished_run, load_average, markdown_table, write_results

from meshlearn.dp.robust import RULES
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "robust_dp"
STRATEGIES = {
    "allreduce": [],
    "sparse": ["dp.name=sparse", "dp.fraction=0.25", "dp.delay=0", "dp.rule=avg"],
    "powersgd": ["dp.name=powersgd", "dp.rank=4"],
    "diloco": ["dp.name=diloco", "dp.inner_steps=5", "dp.fragments=1"],
}
ATTACKS = {
    "clean": [],
    "scale_-4": ["attack.kind=scaling", "attack.scale=-4"],
    "sign_flip": ["attack.kind=sign_flip"],
    "bias_ramp": ["attack.kind=bias", "attack.bias=2", "attack.ramp_steps=8"],
}
LOSS_GOAL, CLEAN_LOSS_COST, CLEAN_SPEED_COST = 0.05, 0.02, 0.20


@dataclass(frozen=True)
class Job:
    """One run of the grid."""

    strategy: str
    attack: str
    rule: str
    steps: int
    start: int  # attack.start_step
    attacker: str
    warmup: int  # train.warmup_steps
    report_only: bool  # verify.ban = false (a robust rule's rows only: under the mean nothing is scored)
    runs: Path  # the folder of the runs (reused when their config agrees)

    @property
    def reports_only(self) -> bool:
        return self.report_only and self.rule != "none"

    def overrides(self) -> list[str]:
        base = ["mesh.replicas=4", f"train.steps={self.steps}", f"train.eval_every={self.steps}",
                "train.checkpoint_every=0", f"train.warmup_steps={self.warmup}", f"dp.robust={self.rule}",
                *STRATEGIES[self.strategy], *(["verify.ban=false"] if self.reports_only else [])]
        if self.attack != "clean":
            base += [*ATTACKS[self.attack], f"attack.workers={self.attacker}", "attack.target=dp",
                     f"attack.start_step={self.start}"]
        return base

    def run_dir(self) -> Path:
        """Its folder under ``runs``: a setting other than the first table's (r1s1, a tenth of the steps
        for warm-up, evicting) is in the name, so each setting's finished runs are reused."""
        name = f"{self.strategy}-{self.attack}-{self.rule}-{self.steps}"
        if (self.attacker, self.warmup) != ("r1s1", max(1, self.steps // 10)):
            name += f"-{self.attacker}-w{self.warmup}"
        return self.runs / (name + ("-report" if self.reports_only else ""))


def run_one(job: Job) -> dict:
    torch.set_num_threads(1)
    cfg = demo_config(*job.overrides())
    summary = finished_run(job.run_dir(), cfg)
    if summary is None:
        summary = Trainer(cfg, job.run_dir(), progress=False).train()
    marks = summary.get("dp_outliers", {})
    attacked = job.attack != "clean"
    return {"strategy": job.strategy, "attack": job.attack, "robust": job.rule,
            "val_loss": summary["final_val_loss"], "tokens_per_s": summary["sim_tokens_per_s"],
            "dp_bytes_per_token": summary["bytes_per_token_dp"], "scored": summary.get("dp_scored", 0),
            "attacker_marks": marks.get(job.attacker, 0) if attacked else "-",
            "honest_marks": sum(n for w, n in marks.items() if not attacked or w != job.attacker),
            "evicted": ", ".join(f"{b['worker']}@{b['step']}" for b in summary.get("banned_workers", []))
            or "-",
            "wall_s": summary["wall_time_s"]}  # the run's own, also when an earlier invocation ran it


def check_goals(rows: list[dict]) -> None:
    """Each row's goal: attacked rows against the clean, non-robust run of their strategy; clean
    robust rows against that run's loss and virtual tokens/s."""
    ref = {r["strategy"]: r for r in rows if r["attack"] == "clean" and r["robust"] == "none"}
    for row in rows:
        base = ref.get(row["strategy"])
        if base is None:
            row["goal"], row["met"] = "no reference", "-"
            continue
        row["d_loss"] = row["val_loss"] - base["val_loss"]
        if row["attack"] != "clean":
            row["goal"] = f"Δloss ≤ {LOSS_GOAL}"
            row["met"] = "yes" if row["d_loss"] <= LOSS_GOAL else "MISS"
        elif row["robust"] != "none":
            speed = row["tokens_per_s"] / base["tokens_per_s"] - 1
            row["goal"] = f"Δloss ≤ {CLEAN_LOSS_COST:.0%}, tok/s ≥ −{CLEAN_SPEED_COST:.0%} ({speed:+.1%})"
            ok = row["d_loss"] <= CLEAN_LOSS_COST * base["val_loss"] and speed >= -CLEAN_SPEED_COST
            row["met"] = "yes" if ok else "MISS"
        else:
            row["goal"], row["met"] = "reference", "-"


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces this table (a flag only when it is set)."""
    words = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
             for k, v in vars(args).items() if v is not False]
    return "OMP_NUM_THREADS=1 python bench/robust_dp.py " + " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--attack-start", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--tag", default="", help="results as robust_dp_TAG (a slice beside the full table)")
    parser.add_argument("--report-only", action="store_true",
                        help="verify.ban = false: DP outliers are reported, never evicted (the rule alone)")
    parser.add_argument("--attacker", default="r1s1", help="the attacking worker (a middle stage)")
    parser.add_argument("--warmup", type=int, default=0, help="train.warmup_steps (0: a tenth of --steps)")
    parser.add_argument("--runs", default="robust_dp",
                        help="folder under bench/out of the runs (another one: the same configs run anew, "
                             "e.g. after a change of code)")
    args = parser.parse_args()
    warmup = args.warmup or max(1, args.steps // 10)
    grid = [(s, a, r) for s in args.strategies.split(",") for a in args.attacks.split(",")
            for r in args.rules.split(",")]
    # every strategy's clean, non-robust run is the reference of its rows' goals: always in the table
    grid = [(s, "clean", "none") for s in args.strategies.split(",")
            if (s, "clean", "none") not in grid] + grid
    runs = OUT.parent / args.runs
    jobs = [Job(s, a, r, args.steps, args.attack_start, args.attacker, warmup, args.report_only, runs)
            for s, a, r in grid]
    load_before = load_average()
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, jobs))
    check_goals(rows)
    misses = [r for r in rows if r["met"] == "MISS"]
    payload = {"steps": args.steps, "attack_start": args.attack_start, "attacker": args.attacker,
               "warmup": warmup,
               "replicas": 4, "link": "200 Mbit/s, 50 ms (demo)", "load_average_before": load_before,
               "load_average_after": load_average(), "wall_s": time.perf_counter() - started,
               "report_only": args.report_only, "command": command(args),
               "rows": rows, "misses": len(misses)}
    columns = [("strategy", "strategy", ""), ("attack", "attack", ""), ("robust", "dp.robust", ""),
               ("val_loss", "val loss", ".4f"), ("d_loss", "Δ vs clean/none", "+.4f"),
               ("tokens_per_s", "virtual tok/s", ".0f"), ("dp_bytes_per_token", "DP B/token", ".1f"),
               ("scored", "scores", ""), ("attacker_marks", "attacker marks", ""),
               ("honest_marks", "honest marks", ""), ("evicted", "evicted (worker@step)", ""),
               ("goal", "goal", ""), ("met", "met", "")]
    for row in rows:
        row.setdefault("d_loss", 0.0)
    markdown = (f"# Robust DP aggregation (issue 32)\n\n`{payload['command']}`: demo config, 4 replicas, "
                f"{args.steps} steps (shortened from the demo's 300 to fit the CPU budget), attacker "
                f"{args.attacker} on its DP contribution from step {args.attack_start}, "
                f"warm-up {warmup} steps"
                f"{' (verify.ban = false: reported, never evicted)' if args.report_only else ''}. "
                f"Load average before {load_before}, after {payload['load_average_after']}; "
                f"{payload['wall_s']:.0f} s wall (runs reused from earlier invocations take none; "
                f"the runs' own training wall time: {sum(r['wall_s'] for r in rows):.0f} s in all).\n\n"
                + markdown_table(rows, columns) + f"\n\nMisses: {len(misses)} of {len(rows)} rows.\n")
    write_results(f"robust_dp_{args.tag}" if args.tag else "robust_dp", payload, markdown)
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "last.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
