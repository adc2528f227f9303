"""Architecture warm-up against the usual remedies, at a learning rate where the baseline is unstable.

The model is ``configs/warmup.toml``: 16 layers at d_model = 128 (byte-level Shakespeare, 32-token
sequences, 16 per batch), trained by the real trainer with ``--set`` overrides. Three parts, each
written to docs/results/warmup.{json,md} with a run report (plots) under docs/results/warmup/:

1. **Sweep** of the baseline's peak lr (tracker off). The comparison lr is the lowest swept lr at
   which the baseline spikes or diverges (``--lr`` overrides it).
2. **Single process** at that lr, side by side: baseline, architecture warm-up, QK-norm, logit
   soft-capping (and attention soft-capping with ``--attn-softcap``), each with the curvature
   tracker on (``curvature.every``):
   loss, λ_max(H) beside 2/η, λ_max(G) beside (2+2β₁)/((1−β₁)η), spikes, final val loss, and the
   tracker's cost measured against the training step. The tracker changes nothing in training
   (tested), so this baseline must reproduce the sweep's run at the same lr: checked here too.
3. **Pipeline**: the same at mesh.stages = 4 (1F1B, simulator), baseline vs warm-up, with per-stage
   curvature (diagonal Hessian blocks).

Spikes: ``meshlearn.warmup.find_spikes`` (train loss above its running EMA by more than δ nats).

``--setting unstable`` (issue 29) runs instead at the setting ``bench/warmup_search.py`` found
unstable (the same config at peak lr 1.0: the baseline spikes again and again), single process,
for each seed: baseline, architecture warm-up without and with an lr ramp at unlock, QK-norm, and
warm-up with the ramp plus QK-norm, tracker on; written to docs/results/warmup_unstable.{json,md}
(with ``--lr X``: docs/results/warmup_lrX.{json,md}).

    python bench/warmup.py [--lrs 3e-3,3e-2,1e-1,3e-1,1] [--lr X] [--steps N] [--attn-softcap] [--reuse]
    python bench/warmup.py --setting unstable [--lr 1] [--seeds 1337,1] [--methods a,b] [--curvature-every 30]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from common import RESULTS, ROOT, finished_run, load_average, markdown_table, write_results

from meshlearn.config import load_config
from meshlearn.report import render_report
from meshlearn.train import Trainer
from meshlearn.warmup import SPIKE_DELTA_NATS, SPIKE_EMA_BETA, WarmupSchedule, find_spikes

CONFIG = ROOT / "configs" / "warmup.toml"
OUT = ROOT / "bench" / "out" / "warmup"
METHODS = {
    "baseline": [],
    "arch-warmup": ["warmup.enabled=true"],
    "qk-norm": ["model.qk_norm=true"],
    "logit-softcap-30": ["model.logit_softcap=30"],
}
ATTN_SOFTCAP = {"attn-softcap-50": ["model.attn_softcap=50"]}  # --attn-softcap: the explicit attention
# path costs about 1.6x a step here (measured on a trial run), so it is optional
UNSTABLE_LR = 1.0  # bench/warmup_search.py: the baseline spikes 8 times here (6 at 0.5: run --lr 0.5)
UNSTABLE_RAMP = 15  # = warmup.unlock_every of the config: one ramp ends as the next group unlocks
UNSTABLE_METHODS = {
    "baseline": [],
    "arch-warmup": ["warmup.enabled=true", "warmup.lr_ramp_steps=0"],
    f"arch-warmup-ramp{UNSTABLE_RAMP}": ["warmup.enabled=true", f"warmup.lr_ramp_steps={UNSTABLE_RAMP}"],
    "qk-norm": ["model.qk_norm=true"],
    f"arch-warmup-ramp{UNSTABLE_RAMP}+qk-norm": ["warmup.enabled=true",
                                                  f"warmup.lr_ramp_steps={UNSTABLE_RAMP}",
                                                  "model.qk_norm=true"],
}
UNLOCK_WINDOW = 5  # steps after an unlock read for its jump (fresh Adam state's first updates)
PIPELINE = ["mesh.stages=4", "mesh.microbatches=4", "mesh.schedule=1f1b"]
PIPELINE_METHODS = ("baseline", "arch-warmup")
CURVATURE_KEYS = ("step", "lambda_max", "lambda_max_converged", "lambda_max_residual", "lambda_max_iters",
                  "lambda_min", "lambda_max_precond", "lambda_max_precond_converged",
                  "lambda_max_precond_iters",
                  "lambda_max_stage", "lambda_max_stage_converged", "lambda_max_precond_stage",
                  "lambda_max_precond_stage_converged", "gd_threshold", "adam_threshold", "gd_ratio",
                  "stability_ratio", "curvature_hvps")


def run(group: str, name: str, overrides: list[str], reuse: bool) -> dict:
    """Train one run through the real trainer (or reuse a finished one); read back its records."""
    run_dir = OUT / group / name
    cfg = load_config(CONFIG, [*overrides, f"name={name}"])
    summary = finished_run(run_dir, cfg) if reuse else None
    diverged, started = None, time.perf_counter()
    load_file = run_dir / "load_average.txt"  # the load the run trained under, kept for --reuse
    if summary is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        load = load_average()
        try:
            summary = Trainer(cfg, run_dir, progress=False).train()
        except FloatingPointError as err:  # the trainer stops at a non-finite loss
            diverged = str(err)
        load_file.write_text(load)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    losses = [r["train_loss"] for r in train]
    spikes = find_spikes(losses)
    curv = [r for r in records if r["kind"] == "curvature"]
    row = {
        "run": name, "overrides": overrides, "lr": cfg.train.lr,
        "dir": str(run_dir.relative_to(ROOT)),
        "steps_done": len(train), "diverged": diverged,
        "final_val_loss": None if summary is None else summary["final_val_loss"],
        "final_train_loss": None if summary is None else summary["final_train_loss"],
        "min_train_loss": min(losses) if losses else None,
        "spikes": spikes.count, "spike_steps": spikes.onsets, "spike_above_steps": spikes.above_steps,
        "max_excursion": spikes.max_excursion,
        "step_wall_s": sum(r["step_wall_s"] for r in train) / max(1, len(train)),
        "train_wall_s": sum(r["step_wall_s"] for r in train), "run_wall_s": time.perf_counter() - started,
        "losses": losses, "val": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
        "load": load_file.read_text() if load_file.is_file() else None,
        "trained_wall_s": max((r.get("wall_time_s", 0.0) for r in records), default=0.0),
        "unlock_excursions": unlock_excursions(losses, unlock_steps(cfg)),
    }
    if curv:
        row |= curvature_stats(curv, row["train_wall_s"], row["step_wall_s"])
    status = "diverged" if diverged else f"val {row['final_val_loss']:.4f}"
    print(f"{group}/{name}: {status}, {spikes.count} spikes {spikes.onsets}, max excursion "
          f"{spikes.max_excursion:+.3f}, {row['step_wall_s']:.3f} s/step", flush=True)
    return row


def unlock_steps(cfg) -> list[int]:
    """The steps after which the config's warm-up would unlock a group (whether or not it is on), so
    that every run is read at the same steps."""
    w = cfg.warmup
    return WarmupSchedule.from_config(w, cfg.model.n_layer, cfg.mesh.stages, cfg.train.warmup_steps).steps


def unlock_excursions(losses: list[float], steps: list[int]) -> list[float | None]:
    """For each unlock after step u: the largest train loss of steps u+1 … u+UNLOCK_WINDOW over the
    spike EMA of the losses up to u (the spike margin's reference, ``find_spikes``)."""
    out: list[float | None] = []
    for u in steps:
        window = losses[u:u + UNLOCK_WINDOW]
        if u < 1 or not window:
            out.append(None)
            continue
        ema = losses[0]
        for loss in losses[1:u]:
            ema = SPIKE_EMA_BETA * ema + (1 - SPIKE_EMA_BETA) * loss
        out.append(max(window) - ema)
    return out


def curvature_stats(curv: list[dict], train_wall_s: float, step_wall_s: float) -> dict:
    """Peaks of the converged estimates and ratios (an unconverged value is a lower bound, not a
    value), how many were unconverged, and the tracker's cost beside the training step's."""
    def converged(key: str) -> list[dict]:
        return [r for r in curv if r.get(key) is not None and r.get(f"{key}_converged") is not False]

    def peak(key: str, flag: str) -> float | None:
        values = [r[key] for r in converged(flag) if r.get(key) is not None]
        return max(values) if values else None

    ratios = [r["stability_ratio"] for r in converged("lambda_max_precond")
              if r.get("stability_ratio") is not None]
    seconds = sum(r["curvature_s"] for r in curv)
    hvps = sum(r["curvature_hvps"] for r in curv)
    unconverged = {key: sum(r.get(f"{key}_converged") is False for r in curv)
                   for key in ("lambda_max", "lambda_max_precond")}
    return {
        "curvature": [{k: r.get(k) for k in CURVATURE_KEYS} for r in curv],
        "peak_lambda_max": peak("lambda_max", "lambda_max"),
        "peak_lambda_max_precond": peak("lambda_max_precond", "lambda_max_precond"),
        "peak_gd_ratio": peak("gd_ratio", "lambda_max"),
        "peak_stability_ratio": peak("stability_ratio", "lambda_max_precond"),
        "estimates_unstable": sum(s > 1 for s in ratios), "estimates": len(curv),
        "unconverged_lambda_max": unconverged["lambda_max"],
        "unconverged_lambda_max_precond": unconverged["lambda_max_precond"],
        "tracker_s_per_estimate": seconds / len(curv), "hvps_per_estimate": hvps / len(curv),
        "tracker_s_per_hvp": seconds / max(1, hvps),
        "tracker_over_step": seconds / len(curv) / step_wall_s,
        "tracker_fraction": seconds / train_wall_s,
    }


def choose_lr(sweep: list[dict]) -> float:
    """The lowest swept lr whose baseline spikes or diverges; the highest if none does."""
    unstable = [r["lr"] for r in sweep if r["diverged"] or r["spikes"]]
    return min(unstable) if unstable else max(r["lr"] for r in sweep)


def short_list(steps: list[int], shown: int = 8) -> str:
    return ", ".join(map(str, steps[:shown])) + (" …" if len(steps) > shown else "")


def fmt(value: float | None, spec: str = ".4f") -> str:
    return "div" if value is None else format(value, spec)


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        cells = {"run": r["run"], "lr": r["lr"],
                 "val": fmt(r["final_val_loss"]) if not r["diverged"] else f"div @ {r['steps_done']}",
                 "min_train": fmt(r["min_train_loss"]), "spikes": r["spikes"],
                 "spike_steps": short_list(r["spike_steps"]),
                 "excursion": fmt(r["max_excursion"], "+.3f"), "step_s": r["step_wall_s"],
                 "unlock": ", ".join("—" if e is None else f"{e:+.2f}"
                                     for e in r.get("unlock_excursions", [])),
                 "load": r.get("load") or "—"}
        if "peak_stability_ratio" in r:
            cells |= {"lam": fmt(r["peak_lambda_max"], ".3g"),
                      "lam_pre": fmt(r["peak_lambda_max_precond"], ".3g"),
                      "gd_ratio": fmt(r["peak_gd_ratio"], ".3g"), "S": fmt(r["peak_stability_ratio"], ".3g"),
                      "unstable": f"{r['estimates_unstable']}/{r['estimates']}",
                      "unconv": f"{r['unconverged_lambda_max']} / {r['unconverged_lambda_max_precond']}",
                      "tracker": f"{r['tracker_s_per_estimate']:.2f} s = {r['tracker_over_step']:.1f} steps",
                      "fraction": f"{100 * r['tracker_fraction']:.0f}%"}
        out.append(cells)
    return out


BASE_COLUMNS = [("run", "run", ""), ("lr", "peak lr", ".0e"), ("val", "final val loss", ""),
                ("min_train", "min train loss", ""), ("spikes", "spikes", "d"),
                ("spike_steps", "at steps", ""), ("excursion", "max ℓ − EMA", ""),
                ("step_s", "s/step (wall)", ".3f")]
CURV_COLUMNS = [("unconv", "unconverged H / G", ""), ("lam", "peak λ_max(H)", ""),
                ("gd_ratio", "peak η·λ/2", ""), ("lam_pre", "peak λ_max(G)", ""), ("S", "peak S", ""),
                ("unstable", "estimates S > 1", ""),
                ("tracker", "tracker per estimate", ""), ("fraction", "tracker / training", "")]


def render(group: str, rows: list[dict]) -> str:
    report = render_report([ROOT / r["dir"] for r in rows], RESULTS / "warmup" / group)
    return str(report.parent.relative_to(RESULTS))


def mean(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def unstable(args: argparse.Namespace) -> None:
    """``--setting unstable``: the methods at ``UNSTABLE_LR`` (or ``--lr``) for each seed."""
    steps = [f"train.steps={args.steps}"] if args.steps else []
    lr = args.lr or UNSTABLE_LR
    group = "unstable" if lr == UNSTABLE_LR else f"lr{lr:g}"
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = {name: UNSTABLE_METHODS[name] for name in
               (args.methods.split(",") if args.methods else UNSTABLE_METHODS)}
    rows: list[dict] = []
    for seed in seeds:
        for name, extra in methods.items():
            overrides = [*steps, f"seed={seed}", f"train.lr={lr}",
                         f"curvature.every={args.curvature_every}", *extra]
            rows.append(run(group, f"{name}-s{seed}", overrides, args.reuse))
    summary = []
    for name in methods:
        mine = [r for r in rows if r["run"].startswith(f"{name}-s") and r["run"][len(name) + 2:].isdigit()]
        summary.append({"method": name,
                        "val": " / ".join(fmt(r["final_val_loss"]) for r in mine),
                        "mean_val": fmt(mean([r["final_val_loss"] for r in mine])),
                        "spikes": " / ".join(str(r["spikes"]) for r in mine),
                        "unlock": " / ".join(fmt(max(e for e in r["unlock_excursions"] if e is not None),
                                                 "+.2f") for r in mine),
                        "lam": " / ".join(fmt(r.get("peak_lambda_max"), ".3g") for r in mine),
                        "S": " / ".join(fmt(r.get("peak_stability_ratio"), ".3g") for r in mine)})
    total = sum(r["trained_wall_s"] for r in rows)  # the runs' own wall time, also under --reuse
    cfg = load_config(CONFIG, steps)
    tracked = args.curvature_every > 0
    seeds_text = " / ".join(map(str, seeds))
    unlock = f"max ℓ − EMA ≤ {UNLOCK_WINDOW} steps after an unlock step"
    columns = [("method", "method", ""), ("val", f"final val loss (seed {seeds_text})", ""),
               ("mean_val", "mean", ""), ("spikes", "spikes", ""), ("unlock", unlock, "")]
    columns += [("lam", "peak λ_max(H)", ""), ("S", "peak S", "")] if tracked else []
    per_run = [*BASE_COLUMNS, ("unlock", f"{unlock} ({', '.join(map(str, unlock_steps(cfg)))})", ""),
               *(CURV_COLUMNS if tracked else []), ("load", "load avg before (— = not recorded)", "")]
    command = (f"python bench/warmup.py --setting unstable{f' --lr {lr:g}' if args.lr else ''} --seeds "
               f"{args.seeds}{f' --methods {args.methods}' if args.methods else ''} --curvature-every "
               f"{args.curvature_every}")
    md = [f"# Architecture warm-up at peak lr {lr:g} (issue 29)\n\n"
          f"`{command}` ({total / 60:.0f} min of runs on one CPU thread, shared machine; load average before "
          f"each run in the last column). `configs/warmup.toml` ({cfg.model.n_layer} layers, d_model "
          f"{cfg.model.d_model}, {cfg.train.steps} steps, grad clip {cfg.train.grad_clip}, "
          f"{cfg.train.warmup_steps}-step LR warm-up) at peak lr **{lr:g}** "
          f"([warmup_search.md](warmup_search.md): the baseline spikes repeatedly at 1). Warm-up locks 8 "
          f"of 16 blocks and unlocks 2 every {cfg.warmup.unlock_every} steps from step "
          f"{cfg.train.warmup_steps}; `ramp{UNSTABLE_RAMP}`: each unlocked group's lr ramps linearly over "
          f"{UNSTABLE_RAMP} steps. Spike: train loss > its EMA (β {SPIKE_EMA_BETA}) + {SPIKE_DELTA_NATS} "
          f"nats. The unlock column reads every run at the same steps, warm-up or not. "
          + (f"Tracker (Lanczos, converged estimates only) every {args.curvature_every} steps."
             if tracked else "Tracker off.") + "\n",
          f"## Per method\n\n{markdown_table(summary, columns)}\n",
          f"## Per run\n\n{markdown_table(table_rows(rows), per_run)}\n"
          + ("\nS = η·λ_max(G)(1−β₁)/(2+2β₁) with G = P^-½HP^-½ (Adam's preconditioner): stable while "
             "< 1.\n" if tracked else "")]
    name = "warmup_unstable" if group == "unstable" else f"warmup_{group}"
    write_results(name, {"config": str(CONFIG.relative_to(ROOT)), "lr": lr, "seeds": seeds,
                         "command": command, "unlock_window": UNLOCK_WINDOW,
                         "spike": {"delta_nats": SPIKE_DELTA_NATS, "ema_beta": SPIKE_EMA_BETA},
                         "total_wall_s": total, "runs": rows, "summary": summary}, "\n".join(md))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=("config", "unstable"), default="config",
                        help="config: the sweep and comparison at the config's setting; unstable: "
                             "every method at the lr where the baseline spikes repeatedly (issue 29)")
    parser.add_argument("--seeds", default="1337,1", help="--setting unstable: run seeds")
    parser.add_argument("--methods", default="", help=f"--setting unstable: some of {list(UNSTABLE_METHODS)}")
    parser.add_argument("--lrs", default="3e-3,3e-2,1e-1,3e-1,1", help="baseline peak lrs of the sweep")
    parser.add_argument("--steps", type=int, default=0, help="train.steps (default: the config's)")
    parser.add_argument("--lr", type=float, default=0.0, help="comparison lr (default: from the sweep)")
    parser.add_argument("--attn-softcap", action="store_true", help="also attention soft-capping")
    parser.add_argument("--curvature-every", type=int, default=15)  # --setting unstable: use 30
    parser.add_argument("--pipeline-curvature-every", type=int, default=50)
    parser.add_argument("--reuse", action="store_true", help="keep runs in bench/out/warmup/ that finished "
                                                             "with the same config")
    args = parser.parse_args()
    if args.setting == "unstable":
        unstable(args)
        return
    started = time.perf_counter()
    steps = [f"train.steps={args.steps}"] if args.steps else []
    sweep = [run("sweep", f"baseline-lr{lr:g}", [*steps, f"train.lr={lr}"], args.reuse)
             for lr in (float(x) for x in args.lrs.split(","))]
    lr = args.lr or choose_lr(sweep)
    tracked = [*steps, f"train.lr={lr}", f"curvature.every={args.curvature_every}"]
    methods = METHODS | (ATTN_SOFTCAP if args.attn_softcap else {})
    single = [run("single", name, [*tracked, *extra], args.reuse) for name, extra in methods.items()]
    same = next((r for r in sweep if r["lr"] == lr), None)
    tracker_neutral = None if same is None else same["losses"] == single[0]["losses"]
    piped = [*steps, f"train.lr={lr}", f"curvature.every={args.pipeline_curvature_every}", *PIPELINE]
    pipeline = [run("pipeline", name, [*piped, *METHODS[name]], args.reuse) for name in PIPELINE_METHODS]
    reports = {group: render(group, rows) for group, rows in
               (("sweep", sweep), ("single", single), ("pipeline", pipeline))}
    total = time.perf_counter() - started

    cfg = load_config(CONFIG, steps)
    setup = (f"`configs/warmup.toml`: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, "
             f"{cfg.model.n_head} heads, seq {cfg.model.seq_len}, batch {cfg.train.batch_size}, byte "
             f"Shakespeare, AdamW (β₁ 0.9, β₂ 0.95, wd {cfg.optim.weight_decay}), grad clip "
             f"{cfg.train.grad_clip}, {cfg.train.steps} steps, {cfg.train.warmup_steps}-step linear LR "
             f"warm-up then cosine to {cfg.train.min_lr_ratio}× peak. Warm-up: 8 of 16 blocks locked "
             f"(interleaved), 4 groups unlocked every {cfg.warmup.unlock_every} steps from step "
             f"{cfg.train.warmup_steps}. Spike: train loss > its EMA (β {SPIKE_EMA_BETA}) over the steps "
             f"before + {SPIKE_DELTA_NATS} nats, consecutive steps counted once.")
    md = [f"# Architecture warm-up bench\n\n`python bench/warmup.py --lrs {args.lrs}"
          f"{f' --steps {args.steps}' if args.steps else ''}` "
          f"({total / 60:.0f} min on one CPU thread). {setup}\n",
          f"## 1. Baseline LR sweep (tracker off)\n\n{markdown_table(table_rows(sweep), BASE_COLUMNS)}\n\n"
          f"Comparison lr: **{lr:g}** ({'--lr' if args.lr else 'lowest swept lr that spikes or diverges'}). "
          f"Report: [{reports['sweep']}]({reports['sweep']}/index.html).\n",
          f"## 2. Single process at lr {lr:g}, tracker every {args.curvature_every} steps\n\n"
          f"{markdown_table(table_rows(single), BASE_COLUMNS + CURV_COLUMNS)}\n\n"
          f"G = P^-½HP^-½ (Adam's preconditioner). S = η·λ_max(G)(1−β₁)/(2+2β₁): stable while < 1; "
          f"η·λ_max(H)/2 is gradient descent's ratio. Lanczos, at most {cfg.curvature.iters} "
          f"products per estimate to a relative residual of {cfg.curvature.tol:g}; peaks and S counts are "
          f"over converged estimates only; 'unconverged' counts the estimates flagged unconverged "
          f"(lower bounds, hollow in the plots), of 'estimates S > 1''s total. Tracker neutral "
          f"(baseline identical to the sweep's run at this lr): {tracker_neutral}. Plots: "
          f"[loss and curvature]({reports['single']}/curvature.png), "
          f"[loss]({reports['single']}/loss_vs_step.png).\n",
          f"## 3. Pipeline, mesh.stages = 4 (1F1B, simulator), tracker every "
          f"{args.pipeline_curvature_every}\n\n"
          f"{markdown_table(table_rows(pipeline), BASE_COLUMNS + CURV_COLUMNS)}\n\n"
          f"λ_max is the full model's; per-stage values (diagonal blocks, lower bounds) are in the JSON. "
          f"Plots: [loss and curvature]({reports['pipeline']}/curvature.png).\n"]
    write_results("warmup", {"config": str(CONFIG.relative_to(ROOT)), "lrs": args.lrs, "lr": lr,
                             "spike": {"delta_nats": SPIKE_DELTA_NATS, "ema_beta": SPIKE_EMA_BETA},
                             "tracker_neutral": tracker_neutral, "total_wall_s": total, "sweep": sweep,
                             "single": single, "pipeline": pipeline, "reports": reports},
                  "\n".join(md))


if __name__ == "__main__":
    main()
