"""Checks the curvature tracker's last estimate of a finished bench/warmup.py run against long
cold-start power iteration on the same weights and probe batch (docs/warmup.md, "Curvature").

The run is resumed from its final checkpoint in a scratch copy; the plain iteration finds the
eigenvalue of largest magnitude, and, when that is negative or unsettled, the rerun on A + ‖A‖·I
(the tracker's own fallback) gets the same number of iterations.

    python bench/warmup_tracker_check.py bench/out/warmup/single/baseline 40
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from meshlearn.config import load_config
from meshlearn.curvature.power import HessianOperator, power_iteration, random_vector
from meshlearn.train import Trainer


def main() -> None:
    src, iters = Path(sys.argv[1]), int(sys.argv[2])
    dst = Path(tempfile.mkdtemp(prefix="meshlearn-check-")) / src.name
    shutil.copytree(src, dst)
    trainer = Trainer(load_config(dst / "config.toml", []), dst, resume=True, progress=False)
    tracker = trainer.plugins["curvature"]
    params = [p for w in tracker.workers for p in w.module.parameters() if p.requires_grad]
    operator = HessianOperator(tracker._loss, params)
    generator = torch.Generator().manual_seed(0)
    eig = power_iteration(operator, random_vector(params, generator), iters)
    print(f"probe loss {operator.loss:.4f}; {iters} cold iterations: dominant λ {eig.value:.6g} "
          f"(residual {eig.residual:.2g}, ‖A‖ ≈ {eig.scale:.6g})")
    print("history", [round(h, 4) for h in eig.history[::max(1, iters // 10)]])
    if eig.value < 0 or eig.residual > 0.1:
        top = power_iteration(operator, random_vector(params, generator), iters, shift=-eig.scale)
        print(f"rerun on A + ‖A‖·I, {iters} iterations: λ_max {top.value:.6g} (residual {top.residual:.2g})")
    last = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()
            if '"curvature"' in line][-1]
    print(f"tracker at step {last['step']}: λ_max {last['lambda_max']:.6g} "
          f"(residual {last['lambda_max_residual']:.2g})")
    shutil.rmtree(dst.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
