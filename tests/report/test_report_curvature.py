"""The curvature figure: present when a run tracked curvature, absent otherwise."""

from __future__ import annotations

import json

from meshlearn.report import render_report
from meshlearn.report.plots_training import split_by_convergence


def add_curvature(run_dir, lr: float = 3e-4, beta1: float = 0.9) -> None:
    records = [{"kind": "curvature", "step": step, "lambda_max": 10.0 * step,
                "lambda_max_converged": step > 5, "lambda_max_precond": 1e3 * step, "lr": lr,
                "gd_threshold": 2 / lr, "adam_threshold": (2 + 2 * beta1) / ((1 - beta1) * lr)}
               for step in (5, 10, 15, 20)]
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_curvature_figure_appears_only_with_curvature_records(make_run):
    plain = make_run("plain")
    out = render_report([plain]).parent
    assert not (out / "curvature.png").exists()
    assert "curvature.png" not in (out / "index.html").read_text()

    tracked = make_run("tracked", name="tracked")
    add_curvature(tracked)
    out = render_report([plain, tracked]).parent
    assert (out / "curvature.png").read_bytes().startswith(b"\x89PNG")
    assert 'src="curvature.png"' in (out / "index.html").read_text()
    assert "](curvature.png)" in (out / "report.md").read_text()


def test_unconverged_estimates_are_drawn_apart_from_converged_ones():
    records = [{"step": 1, "lambda_max": 2.0, "lambda_max_converged": True},
               {"step": 2, "lambda_max": 1e-4, "lambda_max_converged": False},
               {"step": 3, "lambda_max": 3.0}]  # no flag: a run from before the flag
    settled, loose = split_by_convergence(records, "lambda_max")
    assert [r["step"] for r in settled] == [1, 3] and [r["step"] for r in loose] == [2]
    assert split_by_convergence(records, "lambda_max_precond") == (records, [])
