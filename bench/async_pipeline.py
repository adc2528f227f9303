"""The asynchronous pipeline (``mesh.schedule = async``) against the flushing schedules, side by side.

Part 1, schedules. The demo model at P = 4 and an 8-layer demo model at P = 8, one replica
(``mesh.replicas = 1``, the same ``train.batch_size`` so every run sees the same tokens), 200 Mbit/s /
50 ms links, device model (RTX 4090 @ 40%): GPipe, 1F1B, async + AdamW, async + NAdamW with weight
stashing, async + NAdamW without (No-WS). 1F1B and async + NAdamW (WS) each run at every lr of one
grid (``--lrs``, default 1.5e-3 … 1.2e-2, factor 2) and are compared at their best, so neither is
handicapped by the other's lr; the other schedules run at the config's ``train.lr`` (3e-3). Every
async run uses ``mesh.async_lr_rule``'s default (each stage's lr × 1/√(n·(1 + τ_s)),
optim/async_lr.py); one more async + NAdamW run at 3e-3 with the rule off shows what it changes.
Per run: validation loss at equal tokens (end of run) and
at equal virtual time (the fastest run's end; eval records interpolated linearly over
``sim_time_s``, with an evaluation of the initial weights at t = 0), virtual tokens/s (whole run,
drains included, and steady state = batch tokens / median step time), idle fraction, mean
staleness, stash memory, and the machine's load average before and after (as ``uptime`` prints it;
the virtual-time numbers and losses do not depend on it, the wall seconds do).

Part 2, latency hiding. The subspace model (configs/subspace.toml, k = 8, bf16 coefficients), one
replica, 200 Mbit/s / 50 ms, with the device's peak FLOP/s lowered (``sim.peak_tflops``) so that the
slowest stage's forward + backward of one microbatch takes as long as one link latency (``--compute-ms``,
default 50 ms: a ~1B-parameter model's stage on a consumer GPU). Sweep ``mesh.in_flight``: tokens/s,
staleness and validation loss per depth, against the compute-bound throughput (tokens per microbatch
÷ the slowest stage's F + B + U time, from the compute model and measured with free links) and
against 1F1B's validation loss on the same model.

    python bench/async_pipeline.py [--steps 100] [--sweep-steps 100] [--lrs 1.5e-3,3e-3,6e-3,1.2e-2]
                                   [--depths default,2,4,8,16,auto:8,auto:12,auto] [--compute-ms 50]
                                   [--no-extras] [--part all|schedules|sweep] [--reuse]

Runs live in bench/out/async_pipeline/; results go to docs/results/async_pipeline.{json,md}.
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
    load_average,
    markdown_table,
    scratch_trainer,
    slug,
    time_to_loss,
    val_at_time,
    write_results,
)

from meshlearn.assemble import resolve
from meshlearn.config import RunConfig, load_config
from meshlearn.mesh.compute import DEVICES, ComputeModel, StageShape
from meshlearn.mesh.schedule import stage_in_flight
from meshlearn.models.split import init_model, split_model
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "async_pipeline"
SUBSPACE = ROOT / "configs" / "subspace.toml"
D1 = ["mesh.replicas=1"]  # train.batch_size stays 32: equal tokens per step in every run
SCHEDULES = {
    "gpipe": ["mesh.schedule=gpipe"],
    "1f1b": ["mesh.schedule=1f1b"],
    "async + adamw": ["mesh.schedule=async", "optim.name=adamw"],
    "async + nadamw (WS)": ["mesh.schedule=async", "optim.name=nadamw"],
    "async + nadamw (No-WS)": ["mesh.schedule=async", "optim.name=nadamw", "mesh.weight_stashing=false"],
}
SCENARIOS = {
    "demo P=4": [],
    "8 layers P=8": ["model.n_layer=8", "mesh.stages=8"],
}
TUNED = ("1f1b", "async + nadamw (WS)")
"""The two schedules the goal compares: each runs at every lr of the grid and is judged at its best."""
LR_GRID = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
"""Factor 2 apart around the shipped train.lr (3e-3); 1F1B was best at 6e-3 on the old ×½/×2 check."""
RULE_OFF = ("async + nadamw (WS), rule off", [*SCHEDULES["async + nadamw (WS)"], "mesh.async_lr_rule=off"])
"""The look-ahead run at the config's lr without the async lr rule (the bench's setting before it)."""
GOAL_LOSS = 0.03  # async + look-ahead within 3% of 1F1B's validation loss ...
GOAL_SPEED = 1.5  # ... with ≥ 1.5× its virtual tokens/s
GOAL_BOUND = 0.9  # latency hiding: ≥ 0.9 of the compute-bound throughput


# --- running ---------------------------------------------------------------------------------


def run(cfg: RunConfig, run_dir: Path, reuse: bool, eval_at_start: bool) -> dict:
    """Train ``cfg`` in ``run_dir`` (or reuse a finished run with the same config); return its
    summary and metrics records. ``eval_at_start`` evaluates the initial weights first (t = 0)."""
    summary = finished_run(run_dir, cfg) if reuse else None
    wall, load = None, "reused run"
    if summary is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        load_before = load_average()
        started = time.perf_counter()
        trainer = Trainer(cfg, run_dir, progress=False)
        if eval_at_start:
            trainer.evaluate()
        summary = trainer.train()
        wall = time.perf_counter() - started
        load = f"{load_before} → {load_average()}"
        (run_dir / "bench_wall_s.txt").write_text(f"{wall:.3f}\n")
    elif (run_dir / "bench_wall_s.txt").is_file():
        wall = float((run_dir / "bench_wall_s.txt").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records, "bench_wall_s": wall, "load_avg": load}


def train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def describe(name: str, result: dict, tokens_per_step: int) -> dict:
    """One table row from a run: speed, idle fraction, staleness, stash."""
    s, train = result["summary"], train_records(result["records"])
    stale = [r["staleness"] for r in train if r.get("staleness")]
    per_stage = [statistics.fmean(col) for col in zip(*stale, strict=True)] if stale else []
    median_step = statistics.median(r["step_sim_s"] for r in train)
    return {
        "run": name,
        "final_val_loss": s["final_val_loss"],
        "sim_time_s": s["sim_time_s"],
        "sim_tokens_per_s": s["sim_tokens_per_s"],
        "steady_tokens_per_s": tokens_per_step / median_step,
        "idle_fraction": s["idle_fraction"],
        "worker_utilization": s["worker_utilization"],
        "staleness_per_stage": per_stage,
        "mean_staleness": statistics.fmean(per_stage) if per_stage else 0.0,
        "stash_mb": s["stash_bytes_peak"] / 1e6,
        "bytes_per_token_pp": s["bytes_per_token_pp"],
        "wall_s": result["bench_wall_s"] if result["bench_wall_s"] is not None else s["wall_time_s"],
        "load_avg": result["load_avg"],
    }


# --- part 1: schedules ------------------------------------------------------------------------


def cases(lrs: tuple[float, ...], extras: bool) -> dict[str, tuple[str, list[str]]]:
    """run name → (schedule family, overrides); a family outside :data:`TUNED` runs at train.lr."""
    out = {}
    for family, overrides in SCHEDULES.items():
        if family in TUNED:
            for lr in lrs:
                out[f"{family}, lr {lr:g}"] = (family, [*overrides, f"train.lr={lr}"])
        else:
            out[family] = (family, overrides)
    if extras:
        out[RULE_OFF[0]] = (RULE_OFF[0], RULE_OFF[1])
    return out


def schedules(steps: int, eval_every: int, reuse: bool, extras: bool, lrs: tuple[float, ...]) -> dict:
    common = [*D1, f"train.steps={steps}", f"train.eval_every={eval_every}", "train.checkpoint_every=0"]
    out = {}
    for scenario, base in SCENARIOS.items():
        results, rows = {}, []
        for name, (family, overrides) in cases(lrs, extras).items():
            cfg = demo_config(*base, *common, *overrides, f"name={name}")
            tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
            results[name] = run(cfg, OUT / slug(scenario) / slug(name), reuse, eval_at_start=True)
            rows.append(describe(name, results[name], tokens_per_step)
                        | {"family": family, "lr": cfg.train.lr, "overrides": overrides})
            print(f"[{scenario}] {name}: val {rows[-1]['final_val_loss']:.4f}, "
                  f"{rows[-1]['sim_tokens_per_s']:.0f} tok/s, wall {rows[-1]['wall_s']:.0f} s, "
                  f"load {rows[-1]['load_avg']}", flush=True)
        best = {family: min((r for r in rows if r["family"] == family), key=lambda r: r["final_val_loss"])
                for family in TUNED}
        for r in rows:
            r["best_of_grid"] = r is best.get(r["family"])
        budget = min(r["sim_time_s"] for r in rows)  # the fastest run's end
        ref = best["1f1b"]
        for r in rows:
            curve = eval_curve(results[r["run"]]["records"])
            r["val_at_budget"] = val_at_time(curve, budget)
            r["val_vs_1f1b"] = r["final_val_loss"] / ref["final_val_loss"] - 1.0
            r["speed_vs_1f1b"] = r["sim_tokens_per_s"] / ref["sim_tokens_per_s"]
            r["steady_speed_vs_1f1b"] = r["steady_tokens_per_s"] / ref["steady_tokens_per_s"]
            r["time_to_1f1b_loss_s"] = time_to_loss(curve, ref["final_val_loss"])
            r["eval_curve"] = curve
        out[scenario] = {"overrides": base, "time_budget_s": budget, "reference": ref["run"], "rows": rows}
    return out


# --- part 2: latency hiding -------------------------------------------------------------------


def sweep_config(*overrides: str) -> RunConfig:
    return load_config(SUBSPACE, [*D1, *overrides])


def slowest_stage(cfg: RunConfig) -> dict:
    """Per-stage F, B, U seconds of one microbatch from the compute model; the slowest stage."""
    cfg = resolve(cfg, 256)
    compute = ComputeModel(cfg.sim, cfg.model)
    micro = cfg.train.batch_size // cfg.mesh.replicas // cfg.mesh.microbatches
    P = cfg.mesh.stages
    stages = split_model(init_model(cfg.model, cfg.seed), P)
    per_stage = []
    for s in range(P):
        shape = StageShape(cfg.model.n_layer // P, s == 0, s == P - 1)
        n_params = sum(p.numel() for p in stages[s].parameters())
        f, b = (compute.compute_s(shape, kind, micro, 0.0) for kind in ("F", "B"))
        per_stage.append({"stage": s, "F_s": f, "B_s": b, "U_s": compute.update_s(n_params, 0.0),
                          "n_params": n_params})
    slow = max(per_stage, key=lambda st: st["F_s"] + st["B_s"] + st["U_s"])
    return {"per_stage": per_stage, "slowest": slow["stage"],
            "microbatch_tokens": micro * cfg.model.seq_len,
            "compute_bound_tokens_per_s": micro * cfg.model.seq_len
            / (slow["F_s"] + slow["B_s"] + slow["U_s"])}


def peak_for(compute_ms: float) -> float:
    """``sim.peak_tflops`` at which the slowest stage's F + B of one microbatch takes ``compute_ms``."""
    cfg = sweep_config()
    bound = slowest_stage(cfg)
    slow = bound["per_stage"][bound["slowest"]]
    return DEVICES[cfg.sim.device][0] * (slow["F_s"] + slow["B_s"]) / (compute_ms / 1e3)


def sweep(steps: int, depths: list[str], compute_ms: float, reuse: bool) -> dict:
    peak = peak_for(compute_ms)
    common = [f"sim.peak_tflops={peak:.6g}", f"train.steps={steps}", f"train.eval_every={steps}",
              "train.checkpoint_every=0", "optim.name=nadamw", "mesh.schedule=async"]
    bound = slowest_stage(sweep_config(*common))
    # Measured compute-bound rate: free links (no bandwidth limit, no latency), a few steps.
    free = scratch_trainer(sweep_config(*common, "link.bandwidth_mbit=inf", "link.latency_ms=0",
                                        "train.steps=50", "train.eval_every=50"))
    for _ in range(12):
        free.step()
    free_records = train_records([json.loads(line) for line in
                                  (free.run_dir / "metrics.jsonl").read_text().splitlines()])
    tokens_per_step = free.cfg.train.batch_size * free.cfg.model.seq_len
    bound["measured_free_links_tokens_per_s"] = tokens_per_step / statistics.median(
        r["step_sim_s"] for r in free_records)
    compute_bound = bound["compute_bound_tokens_per_s"]
    rows = []
    ref_cfg = sweep_config(*common, "mesh.schedule=1f1b", "optim.name=adamw", "name=1f1b")
    ref = describe("1f1b (AdamW)", run(ref_cfg, OUT / "sweep" / "1f1b", reuse, False), tokens_per_step)
    ref |= {"in_flight": "—", "in_flight_per_stage": []}
    rows.append(ref)
    print(f"[sweep] 1f1b: val {ref['final_val_loss']:.4f}, {ref['sim_tokens_per_s']:.0f} tok/s", flush=True)
    for depth in depths:
        # "auto:N" = mesh.in_flight=auto capped at mesh.max_in_flight=N (windows that shrink with s)
        keys = ([f"mesh.in_flight={depth}"] if ":" not in depth else
                ["mesh.in_flight=auto", f"mesh.max_in_flight={depth.split(':')[1]}"])
        cfg = sweep_config(*common, *keys, f"name=async-{depth}")
        row = describe(f"async + nadamw, in_flight={depth}",
                       run(cfg, OUT / "sweep" / f"async-{depth.replace(':', '-')}", reuse, False),
                       tokens_per_step)
        row |= {"in_flight": depth,
                "in_flight_per_stage": [stage_in_flight(resolve(cfg, 256), s)
                                        for s in range(cfg.mesh.stages)]}
        rows.append(row)
        print(f"[sweep] in_flight={depth}: val {row['final_val_loss']:.4f}, "
              f"{row['sim_tokens_per_s']:.0f} tok/s, steady {row['steady_tokens_per_s']:.0f}", flush=True)
    for r in rows:
        r["of_compute_bound"] = r["sim_tokens_per_s"] / compute_bound
        r["steady_of_compute_bound"] = r["steady_tokens_per_s"] / compute_bound
        r["val_vs_1f1b"] = r["final_val_loss"] / ref["final_val_loss"] - 1.0
    return {"peak_tflops": peak, "compute_ms": compute_ms, "overrides": common, "compute": bound,
            "rows": rows}


# --- the report --------------------------------------------------------------------------------


def goal_lines(part1: dict, config_lr: float) -> list[str]:
    """The goal for async + NAdamW (WS) at its best lr of the grid, and at the config's lr (the rule's
    promise: no retuning), each against 1F1B at its best lr."""
    lines = []
    for scenario, result in part1.items():
        rows = result["rows"]
        picks = [("best lr of the grid", next(r for r in rows if r["best_of_grid"]
                                               and r["family"] == "async + nadamw (WS)")),
                 (f"the config's lr {config_lr:g}, not retuned",
                  next(r for r in rows if r["family"] == "async + nadamw (WS)" and r["lr"] == config_lr))]
        for label, r in picks:
            ok = r["val_vs_1f1b"] <= GOAL_LOSS and r["speed_vs_1f1b"] >= GOAL_SPEED
            lines.append(
                f"- {scenario}, {r['run']} ({label}): val {r['final_val_loss']:.4f} vs "
                f"{result['reference']} {r['final_val_loss'] / (1 + r['val_vs_1f1b']):.4f}, "
                f"{r['val_vs_1f1b']:+.1%} (goal ≤ +3%), {r['speed_vs_1f1b']:.2f}× its virtual tokens/s "
                f"(goal ≥ 1.5×; steady state {r['steady_speed_vs_1f1b']:.2f}×): {'met' if ok else 'missed'}")
    return lines


def sweep_goal(part2: dict) -> str:
    rows = [r for r in part2["rows"] if r["in_flight"] != "—"]
    good = [r for r in rows if r["val_vs_1f1b"] <= GOAL_LOSS]
    fast = [r for r in rows if r["of_compute_bound"] >= GOAL_BOUND]
    both = [r for r in good if r["of_compute_bound"] >= GOAL_BOUND]
    if both:
        best = max(both, key=lambda r: r["of_compute_bound"])
        return (f"met at in_flight={best['in_flight']}: {best['of_compute_bound']:.3f} of compute-bound "
                f"(steady {best['steady_of_compute_bound']:.3f}), val {best['val_vs_1f1b']:+.1%} vs 1F1B")
    parts = []
    if good:
        b = max(good, key=lambda r: r["of_compute_bound"])
        parts.append(f"the fastest depth within 3% of 1F1B's loss (in_flight={b['in_flight']}) reaches "
                     f"{b['of_compute_bound']:.3f} of compute-bound (steady "
                     f"{b['steady_of_compute_bound']:.3f}; goal 0.9, short by "
                     f"{GOAL_BOUND - b['of_compute_bound']:.3f})")
    else:
        parts.append("no depth is within 3% of 1F1B's loss")
    if fast:
        b = min(fast, key=lambda r: r["val_vs_1f1b"])
        parts.append(f"the best loss among depths ≥ 0.9 of compute-bound (in_flight={b['in_flight']}) is "
                     f"{b['val_vs_1f1b']:+.1%} vs 1F1B (goal ≤ +3%, over by "
                     f"{b['val_vs_1f1b'] - GOAL_LOSS:.1%} points)")
    return "missed: " + "; ".join(parts)


def markdown(args, part1: dict | None, part2: dict | None, wall_s: float) -> str:
    runs_wall = sum(r["wall_s"] for part in (part1 or {}).values() for r in part["rows"]) + sum(
        r["wall_s"] for r in (part2 or {}).get("rows", []))
    command = " ".join(["python bench/async_pipeline.py", f"--steps {args.steps}",
                        f"--sweep-steps {args.sweep_steps}", f"--lrs {args.lrs}", f"--part {args.part}",
                        *([f"--depths {args.depths}"] if args.part != "schedules" else [])])
    out = [f"# Asynchronous pipeline (`mesh.schedule = async`)\n\n`{command}`; wall time "
           f"{wall_s / 60:.1f} min for this invocation{' (--reuse)' if args.reuse else ''}, "
           f"{runs_wall / 60:.1f} min summed over its training runs "
           f"on 2 shared CPU cores (OMP_NUM_THREADS=1; each row's load average in the JSON). Device "
           f"model RTX 4090 @ 40%, 200 Mbit/s / 50 ms links, D = 1, train.batch_size 32 (4 microbatches "
           f"of 8 × 128 tokens), warm-up 20 steps, cosine to 0.1×. 1F1B and async + NAdamW (WS) at every "
           f"train.lr of {{{', '.join(f'{lr:g}' for lr in args.lr_grid)}}}, compared at their best (✓); "
           f"the other rows at train.lr 3e-3. Async runs apply `mesh.async_lr_rule = "
           f"microbatch_staleness` (each stage's lr × 1/√(n·(1 + τ_s)): ×1/4 … ×1/2 at P = 4, "
           f"×0.18 … ×1/2 at P = 8) unless the row says `rule off`."]
    if part1:
        eval_every = args.eval_every or max(1, args.steps // 5)
        for scenario, result in part1.items():
            out.append(f"\n## {scenario} ({' '.join(result['overrides']) or 'configs/demo.toml'}), "
                       f"{args.steps} steps\n\nEqual virtual time = {result['time_budget_s']:.1f} s, the "
                       f"fastest run's end; val loss there is interpolated linearly between evaluations "
                       f"(every {eval_every} steps, plus the initial weights at t = 0) over `sim_time_s`. "
                       f"Ratios are against {result['reference']}, 1F1B at its best lr. "
                       f"Whole-run tokens/s include the drain at every evaluation; steady = batch tokens ÷ "
                       f"median step time. Staleness: versions behind of the applied gradients, mean over "
                       f"the run, mean over stages (per stage in the JSON).\n")
            shown = [r | {"best": "✓" if r["best_of_grid"] else ""}
                     | ({"time_to_1f1b_loss_s": "not reached"} if r["time_to_1f1b_loss_s"] is None else {})
                     for r in result["rows"]]
            out.append(markdown_table(shown, [
                ("run", "run", ""), ("best", "best lr", ""),
                ("final_val_loss", f"val @ {args.steps} steps", ".4f"),
                ("val_vs_1f1b", "÷ 1F1B − 1", "+.1%"),
                ("val_at_budget", f"val @ {result['time_budget_s']:.0f} s virtual", ".4f"),
                ("time_to_1f1b_loss_s", "virtual s to 1F1B's val", ".1f"),
                ("sim_tokens_per_s", "virtual tokens/s", ".0f"), ("speed_vs_1f1b", "÷ 1F1B", ".2f"),
                ("steady_tokens_per_s", "steady tokens/s", ".0f"),
                ("idle_fraction", "idle", ".4f"), ("mean_staleness", "mean staleness", ".2f"),
                ("stash_mb", "stash peak (MB)", ".2f"), ("wall_s", "wall (s)", ".0f")]))
        out.append("\n### Goal: async + look-ahead within 3% of 1F1B's val loss at equal tokens, ≥ 1.5× its "
                   "virtual tokens/s\n")
        out += goal_lines(part1, demo_config().train.lr)
    if part2:
        c = part2["compute"]
        slow = c["per_stage"][c["slowest"]]
        out.append(
            f"\n## Latency hiding: `mesh.in_flight` sweep, {args.sweep_steps} steps\n\n"
            f"configs/subspace.toml (k = 8, bf16 coefficients), D = 1, 200 Mbit/s / 50 ms, async + NAdamW "
            f"with stashing; `sim.peak_tflops = {part2['peak_tflops']:.4g}` (RTX 4090 at 40% → "
            f"{part2['peak_tflops'] * 0.4 * 1e3:.1f} GFLOP/s effective) so that the slowest stage "
            f"(stage {c['slowest']}, with the head) computes F + B of one microbatch in "
            f"{(slow['F_s'] + slow['B_s']) * 1e3:.1f} ms ≈ the 50 ms latency (F {slow['F_s'] * 1e3:.1f} ms, "
            f"B {slow['B_s'] * 1e3:.1f} ms, U {slow['U_s'] * 1e6:.1f} µs). Compute-bound throughput = "
            f"{c['microbatch_tokens']} tokens ÷ its F + B + U = **{c['compute_bound_tokens_per_s']:.0f} "
            f"tokens/s** (measured with `link.bandwidth_mbit=inf link.latency_ms=0`, 12 steps, steady: "
            f"{c['measured_free_links_tokens_per_s']:.0f}). The 1F1B row (AdamW) is the loss reference; "
            f"one evaluation (and drain) at the end.\n")
        out.append(markdown_table(
            [r | {"per_stage": "/".join(str(n) for n in r["in_flight_per_stage"]) or "—",
                  "stale": "/".join(f"{v:.1f}" for v in r["staleness_per_stage"]) or "—"}
             for r in part2["rows"]], [
                ("run", "run", ""), ("per_stage", "in flight per stage", ""),
                ("sim_tokens_per_s", "virtual tokens/s", ".0f"),
                ("of_compute_bound", "÷ compute-bound", ".3f"),
                ("steady_of_compute_bound", "steady ÷ compute-bound", ".3f"),
                ("idle_fraction", "idle", ".3f"), ("stale", "staleness per stage", ""),
                ("final_val_loss", f"val @ {args.sweep_steps} steps", ".4f"),
                ("val_vs_1f1b", "÷ 1F1B − 1", "+.1%"), ("stash_mb", "stash peak (MB)", ".2f")]))
        out.append(f"\n### Goal: ≥ 0.9 of compute-bound at a depth within 3% of 1F1B's val loss\n\n- "
                   f"{sweep_goal(part2)}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100,
                        help="steps (global batches of 32 × 128 tokens) of every part-1 run (default 100)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="part 1 evaluation interval in steps; 0 = steps // 5 (each one drains the "
                             "async pipeline)")
    parser.add_argument("--sweep-steps", type=int, default=100,
                        help="steps of every part-2 (in-flight sweep) run (default 100)")
    parser.add_argument("--depths", default="default,2,4,8,16,auto:8,auto:12,auto",
                        help="comma-separated mesh.in_flight values for the sweep; auto:N = auto with "
                             "mesh.max_in_flight=N")
    parser.add_argument("--compute-ms", type=float, default=50.0,
                        help="part 2: the slowest stage's F + B per microbatch, in ms; sets sim.peak_tflops")
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LR_GRID),
                        help="train.lr grid of 1F1B and async + NAdamW (WS) in part 1")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip the async + NAdamW run with mesh.async_lr_rule = off")
    parser.add_argument("--part", choices=("all", "schedules", "sweep"), default="all")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs in bench/out/async_pipeline/ that finished with the same config")
    args = parser.parse_args()
    args.lr_grid = tuple(float(v) for v in args.lrs.split(","))
    started = time.perf_counter()
    eval_every = args.eval_every or max(1, args.steps // 5)
    part1 = (schedules(args.steps, eval_every, args.reuse, not args.no_extras, args.lr_grid)
             if args.part in ("all", "schedules") else None)
    part2 = (sweep(args.sweep_steps, args.depths.split(","), args.compute_ms, args.reuse)
             if args.part in ("all", "sweep") else None)
    wall = time.perf_counter() - started
    name = "async_pipeline" if args.part == "all" else f"async_pipeline_{args.part}"
    write_results(name, {"steps": args.steps, "sweep_steps": args.sweep_steps, "eval_every": eval_every,
                         "lr_grid": args.lr_grid, "uptime_after": load_average(),
                         "config": "configs/demo.toml", "compute_model": "device:rtx4090 at 40% utilization",
                         "links": "200 Mbit/s, 50 ms", "bench_wall_s": wall,
                         "schedules": part1, "sweep": part2},
                  markdown(args, part1, part2, wall))


if __name__ == "__main__":
    main()
