"""AsyncMesh on the data-parallel axis: every DP strategy on one mesh, side by side (device model).

The demo model (configs/demo.toml) on P = 4 stages × D = 4 replicas, every link 200 Mbit/s / 50 ms,
``train.batch_size = 32`` (D = 4 replicas × 4 microbatches of 2 sequences × 128 tokens: the demo's
tokens per step), simulator with the device model (RTX 4090 at 40%). Cases:

- FullSync: ``mesh.schedule=1f1b`` + ``dp.name=allreduce`` (the demo's AdamW): the exact baseline;
- async + allreduce: the no-flush pipeline (NAdamW, stashing) with the full gradient all-reduce at
  every update (the method note's "DP" baseline: full averaging every step);
- SPARTA: async + ``dp.name=sparse``, fraction 0.05, delay 0, rule avg (each round waited for);
- AsyncSPARTA: the same with ``dp.delay=10``;
- AsyncMesh: ``dp.rule=ema``, delay 10 (the note's default D = 10; λ = 1, m 0.5 → 0.99);
- PowerSGD: async + ``dp.name=powersgd``, rank 4 (error feedback, warm start);
- DiLoCo: async + ``dp.name=diloco``, streaming: H = 10 updates, 2 fragments, overlap 2, outer
  Nesterov lr 0.7 / momentum 0.9, merge weight 0.5 (the dp.* defaults except fragments/overlap).

Two scenarios: every link 200 Mbit/s, and the DP links at 50 Mbit/s (``links.dp_bandwidth_mbit=50``;
PP links stay at 200). Per run: validation loss at equal tokens (end of run; for drifting replicas
the loss of the fully averaged model, replica 0's own beside it), at equal virtual time (the
scenario's fastest run's end; eval records interpolated linearly over ``sim_time_s``, with an
evaluation of the initial weights at t = 0), the virtual time to reach FullSync's final loss,
virtual tokens/s (whole run, drains included; steady = batch tokens ÷ median step time), DP and PP
bytes per token, DP rounds / dropped rounds, and the virtual time updates waited on the DP axis
(``dp_wait_s`` of the simulator, which it also keeps for the all-reduce but reports in summary.json
only for message-based strategies: read here from the driver).

    python bench/asyncmesh.py [--steps 100] [--eval-every 0] [--scenarios dp200,dp50]
                              [--cases all] [--dp50-full all --prefix-steps 0] [--reuse]

Runs live in bench/out/asyncmesh/; results go to docs/results/asyncmesh.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from common import (
    ROOT,
    demo_config,
    eval_curve,
    finished_run,
    markdown_table,
    slug,
    time_to_loss,
    val_at_time,
    write_results,
)

from meshlearn.config import RunConfig
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "asyncmesh"
BASE = ["mesh.stages=4", "mesh.replicas=4", "mesh.microbatches=4", "train.batch_size=32",
        "link.bandwidth_mbit=200", "link.latency_ms=50", "train.checkpoint_every=0"]
ASYNC = ["mesh.schedule=async", "optim.name=nadamw"]
SPARSE = ["dp.name=sparse", "dp.fraction=0.05"]
FULLSYNC = "FullSync (1f1b + allreduce)"
ASYNCMESH = "AsyncMesh (ema, delay 10)"
CASES = {
    FULLSYNC: ["mesh.schedule=1f1b", "dp.name=allreduce"],
    "async + allreduce": [*ASYNC, "dp.name=allreduce"],
    "SPARTA (avg, delay 0)": [*ASYNC, *SPARSE, "dp.delay=0", "dp.rule=avg"],
    "AsyncSPARTA (avg, delay 10)": [*ASYNC, *SPARSE, "dp.delay=10", "dp.rule=avg"],
    ASYNCMESH: [*ASYNC, *SPARSE, "dp.delay=10", "dp.rule=ema"],
    "PowerSGD (rank 4)": [*ASYNC, "dp.name=powersgd", "dp.rank=4"],
    "DiLoCo (H 10, 2 fragments, overlap 2)": [*ASYNC, "dp.name=diloco", "dp.inner_steps=10",
                                              "dp.fragments=2", "dp.overlap=2"],
}
SCENARIOS = {
    "dp200": ("all links 200 Mbit/s / 50 ms", []),
    "dp50": ("DP links 50 Mbit/s (PP 200), all 50 ms", ["links.dp_bandwidth_mbit=50"]),
}
GOAL_LOSS = 0.03  # AsyncMesh within 3% of FullSync's val loss at equal tokens ...
GOAL_SPEED = {"dp200": 1.5, "dp50": 3.0}  # ... with at least this many times its virtual tokens/s


# --- running ---------------------------------------------------------------------------------


def run(cfg: RunConfig, run_dir: Path, reuse: bool) -> dict:
    """Train ``cfg`` in ``run_dir`` (or reuse a finished run with the same config), evaluating the
    initial weights first (t = 0); return its summary, records and the DP wait of the driver."""
    summary = finished_run(run_dir, cfg) if reuse else None
    extra_path = run_dir / "bench_extra.json"
    if summary is None or not extra_path.is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.perf_counter()
        trainer = Trainer(cfg, run_dir, progress=False)
        trainer.evaluate()
        summary = trainer.train()
        extra = {"bench_wall_s": time.perf_counter() - started,
                 # the simulator accumulates this for the all-reduce too (summed over workers)
                 "driver_dp_wait_s": float(getattr(trainer.driver, "dp_wait_s", 0.0))}
        extra_path.write_text(json.dumps(extra) + "\n")
    extra = json.loads(extra_path.read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records, **extra}


def describe(name: str, result: dict, cfg: RunConfig) -> dict:
    s, records = result["summary"], result["records"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    workers = cfg.mesh.stages * cfg.mesh.replicas
    steps = len(train)
    wait = s.get("dp_wait_s", result["driver_dp_wait_s"])
    return {
        "run": name,
        "final_val_loss": s["final_val_loss"],
        "val_replica0": evals[-1].get("val_loss_replica0", evals[-1]["val_loss"]),
        "sim_time_s": s["sim_time_s"],
        "sim_tokens_per_s": s["sim_tokens_per_s"],
        "steady_tokens_per_s": tokens_per_step / statistics.median(r["step_sim_s"] for r in train),
        "bytes_per_token_dp": s["bytes_per_token_dp"],
        "bytes_per_token_pp": s["bytes_per_token_pp"],
        "dp_rounds": s.get("dp_rounds", 0),
        "dp_dropped_rounds": s.get("dp_dropped_rounds", 0),
        "dp_wait_per_worker_step_s": wait / (workers * steps),
        "dp_wait_source": "summary.json" if "dp_wait_s" in s else "driver (not in summary.json)",
        "idle_fraction": s["idle_fraction"],
        "wall_s": result["bench_wall_s"],
    }


def scenario(key: str, steps: int, eval_every: int, cases: list[str], reuse: bool,
             prefix: dict[str, int], before: dict | None) -> dict:
    """``prefix``: cases run only to that step (``train.stop_at_step``: the same lr schedule, so
    the same arithmetic as the full run up to there); ``before``: an earlier scenario's results
    whose val loss at ``steps`` a prefix run stands for when its train losses are identical."""
    label, links = SCENARIOS[key]
    common = [*BASE, *links, f"train.steps={steps}", f"train.eval_every={eval_every}"]
    results, rows = {}, []
    for name in cases:
        stop = [f"train.stop_at_step={prefix[name]}"] if name in prefix else []
        cfg = demo_config(*common, *CASES[name], *stop, f"name={slug(name)}")
        results[name] = run(cfg, OUT / key / slug(name), reuse)
        rows.append(describe(name, results[name], cfg) | {"overrides": CASES[name] + stop})
        r = rows[-1]
        if name in prefix:
            r |= prefix_check(results[name], (before or {}).get("results", {}).get(name), prefix[name])
        print(f"[{key}] {name}: val {r['final_val_loss']:.4f}, {r['sim_tokens_per_s']:.0f} tok/s, "
              f"dp {r['bytes_per_token_dp']:.0f} B/token, dropped {r['dp_dropped_rounds']}/"
              f"{r['dp_rounds']}, wall {r['wall_s']:.0f} s", flush=True)
    full = [r for r in rows if "prefix_steps" not in r]
    budget = min(r["sim_time_s"] for r in full)
    ref = next((r for r in rows if r["run"] == FULLSYNC), None)
    for r in rows:
        curve = eval_curve(results[r["run"]]["records"])
        r["eval_curve"] = curve
        r["val_at_budget"] = val_at_time(curve, budget) if "prefix_steps" not in r else None
        r["time_to_fullsync_loss_s"] = None
        if ref is not None:
            if r["final_val_loss"] is not None:
                r["val_vs_fullsync"] = r["final_val_loss"] / ref["final_val_loss"] - 1.0
            r["speed_vs_fullsync"] = r["sim_tokens_per_s"] / ref["sim_tokens_per_s"]
            r["steady_vs_fullsync"] = r["steady_tokens_per_s"] / ref["steady_tokens_per_s"]
            if "prefix_steps" not in r:
                r["time_to_fullsync_loss_s"] = time_to_loss(curve, ref["final_val_loss"])
    return {"label": label, "overrides": common, "time_budget_s": budget, "rows": rows,
            "results": {n: {"records": res["records"]} for n, res in results.items()}}


def prefix_check(result: dict, full: dict | None, stop: int) -> dict:
    """A run stopped at ``stop``: its val loss at the end is not the run's; if its train losses
    equal (bitwise) those of the same case in ``full`` (another link profile, run to the end) and
    neither dropped a round, the arithmetic did not depend on the links, and the full run's val
    loss at the end stands in for it (marked)."""
    own = [r["train_loss"] for r in result["records"] if r["kind"] == "train"]
    out = {"prefix_steps": stop, "prefix_val_loss": result["summary"]["final_val_loss"],
           "final_val_loss": None, "val_inferred_from": None, "prefix_max_abs_diff": None}
    if full is None:
        return out
    other = [r["train_loss"] for r in full["records"] if r["kind"] == "train"][:len(own)]
    diff = max(abs(a - b) for a, b in zip(own, other, strict=True))
    out["prefix_max_abs_diff"] = diff
    full_evals = [r for r in full["records"] if r["kind"] == "eval"]
    at_stop = next((r["val_loss"] for r in full_evals if r.get("step") == stop), None)
    out["full_val_at_prefix"] = at_stop
    if diff == 0.0 and result["summary"].get("dp_dropped_rounds", 0) == 0:
        out["final_val_loss"] = full_evals[-1]["val_loss"]
        out["val_inferred_from"] = "dp200 run (identical train losses over the prefix, no drops)"
    return out


# --- the report --------------------------------------------------------------------------------


def goal_line(key: str, result: dict) -> str:
    rows = {r["run"]: r for r in result["rows"]}
    if FULLSYNC not in rows or ASYNCMESH not in rows:
        return f"- {key}: FullSync or AsyncMesh not run"
    r, speed_goal = rows[ASYNCMESH], GOAL_SPEED[key]
    loss_ok, speed_ok = r["val_vs_fullsync"] <= GOAL_LOSS, r["speed_vs_fullsync"] >= speed_goal
    parts = [f"val loss {r['val_vs_fullsync']:+.2%} vs FullSync (goal ≤ +3%: "
             + ("met" if loss_ok else f"missed by {r['val_vs_fullsync'] - GOAL_LOSS:.2%} points") + ")",
             f"{r['speed_vs_fullsync']:.2f}× its virtual tokens/s (steady {r['steady_vs_fullsync']:.2f}×; "
             f"goal ≥ {speed_goal:g}×: "
             + ("met" if speed_ok else f"missed by {speed_goal - r['speed_vs_fullsync']:.2f}×") + ")"]
    return f"- {result['label']}: AsyncMesh " + ", ".join(parts) + (
        ": **met**" if loss_ok and speed_ok else ": **missed**")


def markdown(args, results: dict, wall_s: float) -> str:
    runs_wall = sum(r["wall_s"] for res in results.values() for r in res["rows"])
    out = [f"# AsyncMesh on the DP axis: DP strategies side by side\n\n`python bench/asyncmesh.py "
           f"--steps {args.steps}`; wall time {wall_s / 60:.1f} min for this invocation"
           f"{' (--reuse)' if args.reuse else ''}, {runs_wall / 60:.1f} min summed over its training "
           f"runs on 2 shared CPU cores (OMP_NUM_THREADS=1). Demo model, P = 4 × D = 4, "
           f"train.batch_size 32 (4 microbatches of 2 × 128 tokens per replica), lr 3e-3, warm-up 20 "
           f"steps, cosine to 0.1×, grad clip 1.0; device model RTX 4090 @ 40%. FullSync uses the demo's "
           f"AdamW; every async run uses NAdamW with weight stashing (the look-ahead of "
           f"docs/async.md). {args.steps} steps = {args.steps * 32 * 128:,} tokens."]
    for key, res in results.items():
        eval_every = args.eval_every or max(1, args.steps // 5)
        out.append(
            f"\n## {res['label']}\n\n`{' '.join(SCENARIOS[key][1]) or 'all links 200 Mbit/s'}`. Equal "
            f"virtual time = {res['time_budget_s']:.1f} s (the fastest run's end); val loss there is "
            f"interpolated linearly between evaluations (every {eval_every} steps plus the initial "
            f"weights at t = 0) over each record's `sim_time_s`. Val = the fully averaged model where "
            f"replicas drift (replica 0's own beside it). Tokens/s over the whole run include the drain "
            f"at every evaluation; steady = batch tokens ÷ median step time. DP wait: virtual seconds "
            f"an update waited on the DP axis, per worker and step.\n")
        shown = []
        for r in res["rows"]:
            row = r | {k: "not reached" if r.get(k) is None else r[k]
                       for k in ("time_to_fullsync_loss_s", "val_at_budget")}
            if "prefix_steps" in r:
                row |= {"time_to_fullsync_loss_s": "—", "val_at_budget": "—",
                        "run": f"{r['run']} ({r['prefix_steps']} steps)", "val_replica0": "—"}
                for k in ("final_val_loss", "val_vs_fullsync"):
                    v = r.get(k)
                    row[k] = "—" if v is None else (f"{v:.4f}†" if k == "final_val_loss" else f"{v:+.1%}†")
            shown.append(row)
        out.append(markdown_table(shown, [
            ("run", "run", ""), ("final_val_loss", f"val @ {args.steps} steps", ".4f"),
            ("val_vs_fullsync", "÷ FullSync − 1", "+.1%"), ("val_replica0", "replica 0", ".4f"),
            ("val_at_budget", f"val @ {res['time_budget_s']:.0f} s virtual", ".4f"),
            ("time_to_fullsync_loss_s", "virtual s to FullSync's val", ".1f"),
            ("sim_tokens_per_s", "virtual tokens/s", ".0f"), ("speed_vs_fullsync", "÷ FullSync", ".2f"),
            ("steady_tokens_per_s", "steady tokens/s", ".0f"),
            ("bytes_per_token_dp", "DP B/token", ".0f"), ("bytes_per_token_pp", "PP B/token", ".0f"),
            ("dp_rounds", "DP rounds", "d"), ("dp_dropped_rounds", "dropped", "d"),
            ("dp_wait_per_worker_step_s", "DP wait / worker-step (s)", ".4f"),
            ("wall_s", "wall (s)", ".0f")]))
        if any("prefix_steps" in r for r in res["rows"]):
            p = next(r for r in res["rows"] if "prefix_steps" in r)["prefix_steps"]
            checks = "; ".join(
                f"{r['run']}: max |Δ train loss| {r['prefix_max_abs_diff']:.1e}, val @ {p} "
                f"{r['prefix_val_loss']:.4f} vs {r.get('full_val_at_prefix') or float('nan'):.4f}"
                for r in res["rows"] if "prefix_steps" in r and r["prefix_max_abs_diff"] is not None)
            out.append(
                f"\nRows marked (N steps) ran only the first {p} steps of the same {args.steps}-step "
                f"schedule (`train.stop_at_step={p}`, one evaluation and drain at step {p}: the same "
                f"drain density as the full runs), for tokens/s and bytes. † = val loss at "
                f"{args.steps} steps taken from the 200 Mbit/s run of the same case, because its train "
                f"losses over the prefix are identical to the last bit and no round was dropped "
                f"(blocking strategies never depend on link timing; non-blocking ones only through "
                f"drops). Prefix checks: {checks}.")
    out.append("\n## Goals (AsyncMesh vs FullSync at equal tokens)\n")
    out += [goal_line(key, res) for key, res in results.items()]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100,
                        help="steps (global batches of 32 × 128 tokens) of every run (default 100)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluation interval in steps; 0 = steps // 5 (each one drains the pipeline)")
    parser.add_argument("--scenarios", default="dp200,dp50", help=f"comma-separated, of {list(SCENARIOS)}")
    parser.add_argument("--cases", default="all",
                        help="comma-separated indices into the case list (0 = FullSync), or all")
    parser.add_argument("--dp50-full", default="all",
                        help="dp50, with --prefix-steps: case indices run to the end (e.g. 0,4 = FullSync, "
                             "AsyncMesh); the others run --prefix-steps steps (default all: every case)")
    parser.add_argument("--prefix-steps", type=int, default=0,
                        help="dp50: steps of the cases not in --dp50-full (default 0 = every case to the "
                             "end), for a shorter run")
    parser.add_argument("--tag", default="", help="results go to docs/results/asyncmesh{_tag}.*")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs in bench/out/asyncmesh/ that finished with the same config")
    args = parser.parse_args()
    names = list(CASES)
    cases = names if args.cases == "all" else [names[int(i)] for i in args.cases.split(",")]
    eval_every = args.eval_every or max(1, args.steps // 5)
    started = time.perf_counter()
    names_full = [names[int(i)] for i in args.dp50_full.split(",")] if args.dp50_full != "all" else names
    results, before = {}, None
    for key in args.scenarios.split(","):
        prefix = ({n: args.prefix_steps for n in cases if n not in names_full}
                  if key == "dp50" and args.prefix_steps else {})
        results[key] = scenario(key, args.steps, eval_every, cases, args.reuse, prefix, before)
        before = results[key] if key == "dp200" else before
    wall = time.perf_counter() - started
    name = "asyncmesh" + (f"_{args.tag}" if args.tag else "")
    write_results(name, {"steps": args.steps, "eval_every": eval_every, "config": "configs/demo.toml",
                         "compute_model": "device:rtx4090 at 40% utilization", "bench_wall_s": wall,
                         "scenarios": {k: {kk: vv for kk, vv in v.items() if kk != "results"}
                                       for k, v in results.items()}},
                  markdown(args, results, wall))


if __name__ == "__main__":
    main()
