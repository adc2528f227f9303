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

    python bench/warmup.py [--lrs 3e-3,3e-2,1e-1,3e-1,1] [--lr X] [--steps N] [--attn-softcap] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from common import RESULTS, ROOT, finished_run, markdown_table, write_results

from meshlearn.config import load_config
from meshlearn.report import render_report
from meshlearn.train import Trainer
from meshlearn.warmup import SPIKE_DELTA_NATS, SPIKE_EMA_BETA, find_spikes

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
    if summary is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            summary = Trainer(cfg, run_dir, progress=False).train()
        except FloatingPointError as err:  # the trainer stops at a non-finite loss
            diverged = str(err)
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
    }
    if curv:
        row |= curvature_stats(curv, row["train_wall_s"], row["step_wall_s"])
    status = "diverged" if diverged else f"val {row['final_val_loss']:.4f}"
    print(f"{group}/{name}: {status}, {spikes.count} spikes {spikes.onsets}, max excursion "
          f"{spikes.max_excursion:+.3f}, {row['step_wall_s']:.3f} s/step", flush=True)
    return row


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
                 "excursion": fmt(r["max_excursion"], "+.3f"), "step_s": r["step_wall_s"]}
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lrs", default="3e-3,3e-2,1e-1,3e-1,1", help="baseline peak lrs of the sweep")
    parser.add_argument("--steps", type=int, default=0, help="train.steps (default: the config's)")
    parser.add_argument("--lr", type=float, default=0.0, help="comparison lr (default: from the sweep)")
    parser.add_argument("--attn-softcap", action="store_true", help="also attention soft-capping")
    parser.add_argument("--curvature-every", type=int, default=15)
    parser.add_argument("--pipeline-curvature-every", type=int, default=50)
    parser.add_argument("--reuse", action="store_true", help="keep runs in bench/out/warmup/ that finished "
                                                             "with the same config")
    args = parser.parse_args()
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
