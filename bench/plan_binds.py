"""The binding resource two ways: read off one simulation's critical path, and by doubling.

``meshlearn plan`` names what binds each row from the row's own simulation: its steady state's
critical path, split by resource (``plan.critical``). The reference is the way it replaces:
simulate the steady state again with each resource twice as good (FLOP rate, PP bandwidth, DP
bandwidth, half the latency) and see which gains most (``plan.steady.with_gains``). This bench
runs both on every method row of the validation shapes (``bench/plan_validation.py``, the demo
model) and of the 8B table (the subspace paper's mesh), and reports every row where they
disagree, and whether each doubling's gain stays under the critical path's bound
1 / (1 − share / 2).

    python bench/plan_binds.py [--no-8b]
"""

from __future__ import annotations

import argparse
import time

from common import demo_config, markdown_table, write_results
from plan_validation import SHAPES

from meshlearn.config import RunConfig, load_config
from meshlearn.plan.methods import methods, subspace_rank
from meshlearn.plan.parallel import default_processes, run_all
from meshlearn.plan.presets import preset_overrides
from meshlearn.plan.steady import doublings, with_gains, with_path

TABLE_8B = [*preset_overrides("llama-8b"), "sim.device=l4", "mesh.stages=32", "mesh.replicas=2",
            "mesh.microbatches=8", "mesh.schedule=gpipe", "train.batch_size=64", "link.bandwidth_mbit=100"]


Row = tuple[str, str, RunConfig, float | None]  # (group, label, config, mask keep)


def rows_of(group: str, name: str, cfg: RunConfig, rank: int = 0) -> list[Row]:
    """The shape as given and every method row of its table."""
    variants, _ = methods(cfg, subspace_rank(cfg, rank), (0.05,))
    return [(group, f"{name}: as given", cfg, None)] + [(group, f"{name}: {v.label}", v.cfg, v.mask_keep)
                                                        for v in variants]


def compare(rows: list[Row], processes: int) -> list[dict]:
    jobs = []
    for _, _, cfg, keep in rows:
        jobs += [("steady", cfg, keep, True), ("steady", cfg, keep, False)]
        jobs += [("steady", c, keep, False) for c in doublings(cfg).values()]
    done = run_all(jobs, processes)

    def lookup(c: RunConfig, keep: float | None):
        return done[("steady", c, keep, False)]

    out = []
    for group, label, cfg, keep in rows:
        path = with_path(cfg, done[("steady", cfg, keep, True)])
        dbl = with_gains(cfg, lookup(cfg, keep), keep, lookup)
        shares = path.window.path
        over = {r: g / (1 / (1 - shares[r] / 2)) for r, g in dbl.gains.items()}  # ≤ 1: under the bound
        out.append({"group": group, "row": label, "path_binds": path.binds, "doubling_binds": dbl.binds,
                    "agree": path.binds == dbl.binds,
                    "same_tokens_per_s": path.tokens_per_s == dbl.tokens_per_s,
                    "shares": shares, "gains": dbl.gains, "worst_gain_over_bound": max(over.values()),
                    "path": " ".join(f"{k} {v:.2f}" for k, v in shares.items() if abs(v) >= 0.005),
                    "doubling": " ".join(f"{k} {v:.2f}" for k, v in dbl.gains.items())})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-8b", action="store_true", help="the validation shapes only")
    args = parser.parse_args()
    rows = []
    for name, overrides in SHAPES:
        rows += rows_of("validation", name, demo_config(*overrides, "model.vocab_size=256"))
    if not args.no_8b:
        rows += rows_of("8B table", "8B 32×2 100 Mbit/s", load_config(None, TABLE_8B), rank=40)
    started = time.perf_counter()
    result = compare(rows, default_processes())
    seconds = time.perf_counter() - started
    groups = {}
    for r in result:
        g = groups.setdefault(r["group"], {"rows": 0, "agree": 0})
        g["rows"] += 1
        g["agree"] += r["agree"]
    disagreements = [r for r in result if not r["agree"]]
    summary = "; ".join(f"{name}: {g['agree']} of {g['rows']} rows agree" for name, g in groups.items())
    columns = [("row", "row", ""), ("path_binds", "critical path", ""), ("path", "shares", ""),
               ("doubling_binds", "doubling", ""), ("doubling", "tokens/s × if doubled", "")]
    markdown = (f"Binding resource from one simulation's critical path against doubling each resource "
                f"(`python bench/plan_binds.py`): {summary}. Every tokens/s of a critical-path "
                f"simulation equals the plain one: {all(r['same_tokens_per_s'] for r in result)}. "
                f"Largest doubling gain ÷ the path's bound 1/(1 − share/2): "
                f"{max(r['worst_gain_over_bound'] for r in result):.4f}. {len(result)} rows, "
                f"{seconds:.0f} s wall.\n\n"
                + ("Disagreements:\n\n" + markdown_table(disagreements, columns) if disagreements
                   else "No disagreement.") + "\n\nAll rows:\n\n" + markdown_table(result, columns))
    write_results("plan_binds", {"groups": groups, "rows": result}, markdown)


if __name__ == "__main__":
    main()
