"""Checks the curvature tracker of finished bench/warmup.py runs (docs/warmup.md, "Curvature").

For each run: its last curvature record against long cold-start Lanczos on the same weights, Adam
state and probe batch (the run is resumed from its final checkpoint in a scratch copy), plain and
preconditioned; beside it what the paper's power iteration gives with the old tracker's budget of 5
products (plain, and the old fallback on A + ‖A‖·I), so the old failure is measured on the same
weights. Over the whole run: how many estimates were flagged unconverged, per key.

    python bench/warmup_tracker_check.py bench/out/warmup/single/baseline [RUN ...] [--iters 120]

Writes docs/results/warmup_tracker_check.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, markdown_table, write_results

from meshlearn.config import load_config
from meshlearn.curvature import HessianOperator, lanczos, power_iteration
from meshlearn.curvature.power import Vector, random_vector
from meshlearn.train import Trainer

OLD_BUDGET = 5  # the power-iteration tracker's curvature.iters
REF_TOL = 1e-7  # the reference's stop, on the residual read off T; in fp32 that residual drops below
# the explicit one (~1e-5, reported as ref_residual_explicit) after a few steps, so the reference is
# a cold random start run to the fp32 floor, not a fixed --iters Krylov space
LABELS = {"lambda_max": "H", "lambda_max_precond": "G", "lambda_max_stage": "H stages",
          "lambda_max_precond_stage": "G stages"}
KEYS = tuple(LABELS)


def unconverged_counts(records: list[dict]) -> dict:
    """Per key: (estimates flagged unconverged, estimates), stage lists counted entry by entry."""
    out = {}
    for key in KEYS:
        flags = []
        for r in records:
            flag = r.get(f"{key}_converged")
            flags += flag if isinstance(flag, list) else [] if flag is None else [flag]
        if flags:
            out[key] = [sum(f is False for f in flags), len(flags)]
    return out


def check(src: Path, iters: int) -> dict:
    dst = Path(tempfile.mkdtemp(prefix="meshlearn-check-")) / src.name
    shutil.copytree(src, dst)
    try:
        trainer = Trainer(load_config(dst / "config.toml", []), dst, resume=True, progress=False)
        plugin = trainer.plugins["curvature"]
        named, _, pre = plugin.tracked()
        params = [p for _, p in named]
        with_state = [i for i in range(len(named)) if pre[i] is not None]
        operator = HessianOperator(plugin._loss, params)
        generator = torch.Generator().manual_seed(0)

        def sub(indices: list[int]):
            return lambda v: operator(v, indices)

        def start(indices: list[int]) -> Vector:
            return random_vector([params[i] for i in indices], generator)

        everything = list(range(len(named)))
        started = time.perf_counter()
        ref = lanczos(operator, start(everything), iters, tol=REF_TOL)
        ref_s = time.perf_counter() - started
        hy = operator(ref.vector)  # one more product: the residual checked explicitly, not from T
        explicit = (sum(float((h.double() - ref.value * y.double()).square().sum())
                        for h, y in zip(hy, ref.vector, strict=True)) ** 0.5 / abs(ref.value))
        ref_pre = lanczos(sub(with_state), start(with_state), iters, [pre[i] for i in with_state],
                          tol=REF_TOL)
        paper = power_iteration(operator, start(everything), OLD_BUDGET, tol=1e-12)
        shift = -paper.scale  # the old fallback's σ = −‖A‖ (its estimate from the first pass)
        old = power_iteration(lambda v: [y - shift * x for y, x in zip(operator(v), v, strict=True)],
                              start(everything), OLD_BUDGET, tol=1e-12)
        records = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()
                   if '"curvature"' in line]
        last = records[-1]
    finally:
        shutil.rmtree(dst.parent, ignore_errors=True)
    stage_max = max(last["lambda_max_stage"]) if last.get("lambda_max_stage") else None
    row = {
        "run": str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src),
        "step": last["step"], "probe_loss": operator.loss, "ref_iters": iters,
        "ref_lambda_max": ref.value, "ref_residual": ref.residual,
        "ref_iterations": ref.iterations, "ref_lambda_min": ref.bottom, "ref_s": ref_s,
        "ref_residual_explicit": explicit,
        "ref_lambda_max_precond": ref_pre.value, "ref_precond_residual": ref_pre.residual,
        "ref_precond_iterations": ref_pre.iterations,
        "tracker_lambda_max": last["lambda_max"], "tracker_converged": last.get("lambda_max_converged"),
        "tracker_residual": last.get("lambda_max_residual"), "tracker_iters": last.get("lambda_max_iters"),
        "tracker_lambda_min": last.get("lambda_min"),
        "tracker_lambda_max_precond": last.get("lambda_max_precond"),
        "tracker_precond_converged": last.get("lambda_max_precond_converged"),
        "tracker_stage_max": stage_max,
        "paper_power_5": paper.value, "paper_power_5_residual": paper.residual,
        "old_shifted_5": old.value + shift, "old_shifted_5_residual": old.residual,
        "rel_error": abs(last["lambda_max"] - ref.value) / abs(ref.value),
        "rel_error_precond": (None if last.get("lambda_max_precond") is None else
                              abs(last["lambda_max_precond"] - ref_pre.value) / abs(ref_pre.value)),
        "unconverged": unconverged_counts(records), "estimates": len(records),
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path, help="finished bench/warmup.py run folders")
    parser.add_argument("--iters", type=int, default=120, help="Lanczos iterations of the reference")
    args = parser.parse_args()
    rows = [check(run.resolve(), args.iters) for run in args.runs]
    table = [{"run": r["run"].split("/warmup/")[-1], "step": r["step"],
              "ref": f"{r['ref_lambda_max']:.4g} ({r['ref_iterations']} it, res "
                     f"{r['ref_residual_explicit']:.1g})",
              "ref_min": f"{r['ref_lambda_min']:.4g}",
              "tracker": f"{r['tracker_lambda_max']:.4g} ({'conv' if r['tracker_converged'] else 'UNCONV'}, "
                         f"{r['tracker_iters']} it)",
              "err": f"{100 * r['rel_error']:.2f}%",
              "pre": (f"{r['tracker_lambda_max_precond']:.4g} vs {r['ref_lambda_max_precond']:.4g}"
                      if r["tracker_lambda_max_precond"] is not None else "—"),
              "paper": f"{r['paper_power_5']:.4g}", "old": f"{r['old_shifted_5']:.4g} "
                                                          f"(res {r['old_shifted_5_residual']:.1g})",
              "unconv": "; ".join(f"{LABELS[k]} {a}/{b}" for k, (a, b) in r["unconverged"].items())}
             for r in rows]
    columns = [("run", "run", ""), ("step", "step", "d"), ("ref", "λ_max(H), reference Lanczos", ""),
               ("ref_min", "λ_min (ref)", ""), ("tracker", "tracker's λ_max(H)", ""),
               ("err", "tracker error", ""), ("pre", "λ_max(G): tracker vs ref", ""),
               ("paper", f"power iteration, {OLD_BUDGET} it", ""),
               ("old", f"old fallback A+‖A‖I, {OLD_BUDGET} it", ""),
               ("unconv", "unconverged estimates over the run", "")]
    md = (f"# Curvature tracker check\n\n`python bench/warmup_tracker_check.py "
          f"{' '.join(r['run'] for r in rows)} --iters {args.iters}`\n\n"
          f"Reference: cold-start Lanczos, {args.iters} iterations (unless its relative residual "
          f"reaches {REF_TOL:g}), on the run's final weights, Adam state and probe batch (res: its "
          f"relative residual recomputed with one more product). The tracker's value is its last "
          f"logged estimate (the same weights). 'power iteration' is the paper's estimator with the old "
          f"tracker's budget; 'old fallback' is its shifted rerun (res = residual relative to the "
          f"shifted eigenvalue, what the old tracker logged).\n\n{markdown_table(table, columns)}\n")
    write_results("warmup_tracker_check", {"iters": args.iters, "rows": rows}, md)


if __name__ == "__main__":
    main()
