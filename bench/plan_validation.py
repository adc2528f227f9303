"""Planner validation: ``meshlearn plan``'s tokens/s against the simulator's, on shapes we can run.

For each shape the planner's prediction (``plan.steady.predict``: cost-only workers, a few
simulated steps, the run's drain points amortized) is set beside a real simulated training run
of the same config (``meshlearn train``: real forward/backward on this CPU, the virtual clock's
device model, its summary's ``sim_tokens_per_s``). Both use the same event loop, links and
device model, so the two can differ only by the planner's extrapolation from few steps; the goal
is planner ÷ simulated within 5% on every shape. The simulator itself is checked against real
processes over shaped links by ``bench/sim_fidelity.py`` (docs/results/sim_fidelity.md).

    python bench/plan_validation.py [--steps 40] [--access uplink]

``--access uplink``: every shape with one uplink per participant (``links.access``), results in
``plan_validation_uplink``.
"""

from __future__ import annotations

import argparse
import time

from common import demo_config, markdown_table, scratch_trainer, write_results

from meshlearn.mesh.network import ACCESS
from meshlearn.plan.steady import predict

SHAPES: list[tuple[str, list[str]]] = [
    ("4×2 1F1B all-reduce, 200 Mbit/s", []),
    ("4×2 async sparse averaging", ["mesh.schedule=async", "dp.name=sparse", "dp.delay=4"]),
    ("2×4 GPipe PowerSGD, 50 Mbit/s", ["mesh.stages=2", "mesh.replicas=4", "mesh.schedule=gpipe",
                                        "dp.name=powersgd", "link.bandwidth_mbit=50"]),
    ("4×2 1F1B DiLoCo H=5", ["dp.name=diloco", "dp.inner_steps=5"]),
    ("4×1 async int8, 20 Mbit/s", ["mesh.replicas=1", "mesh.schedule=async", "codec.name=int8",
                                    "link.bandwidth_mbit=20"]),
    ("8×1 1F1B, 8 layers, 8 microbatches", ["mesh.stages=8", "mesh.replicas=1", "model.n_layer=8",
                                             "mesh.microbatches=8"]),
    ("4×2 async subspace k=16, DP 25 Mbit/s", ["mesh.schedule=async", "model.subspace_rank=16",
                                              "model.subspace_dense_tail=1", "codec.name=subspace",
                                              "links.dp_bandwidth_mbit=25"]),
    ("4×2 async all-reduce on an H100", ["mesh.schedule=async", "sim.device=h100"]),
]


def run_shape(name: str, overrides: list[str], steps: int) -> dict:
    cfg = demo_config(*overrides, f"train.steps={steps}", f"train.eval_every={steps // 2}",
                      "train.eval_batches=1", "train.checkpoint_every=0")
    trainer = scratch_trainer(cfg)
    started = time.process_time()
    planned = predict(trainer.cfg)  # the trainer's resolved config (vocab from the tokenizer)
    plan_cpu_s = time.process_time() - started
    started = time.process_time()
    summary = trainer.train()
    train_cpu_s = time.process_time() - started
    simulated = summary["sim_tokens_per_s"]
    return {"shape": name, "overrides": " ".join(overrides), "steps": steps,
            "planner_tokens_per_s": planned.tokens_per_s, "simulated_tokens_per_s": simulated,
            "ratio": planned.tokens_per_s / simulated, "planner_steps": planned.steps_simulated,
            "planner_whole_run": planned.whole_run, "planner_cpu_s": plan_cpu_s,
            "train_cpu_s": train_cpu_s, "within_5pct": abs(planned.tokens_per_s / simulated - 1) <= 0.05}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of each simulated training run")
    parser.add_argument("--access", choices=ACCESS, default="off", help="links.access of every shape")
    args = parser.parse_args()
    access = [] if args.access == "off" else [f"links.access={args.access}"]
    rows = [run_shape(name, [*overrides, *access], args.steps) for name, overrides in SHAPES]
    worst = max(abs(r["ratio"] - 1) for r in rows)
    columns = [("shape", "shape (demo model unless said)", ""),
               ("planner_tokens_per_s", "planner tok/s", ".0f"),
               ("simulated_tokens_per_s", "simulated tok/s", ".0f"), ("ratio", "planner ÷ sim", ".4f"),
               ("planner_steps", "steps the planner simulated", "d"),
               ("planner_cpu_s", "planner CPU s", ".2f"), ("train_cpu_s", "training CPU s", ".1f")]
    markdown = (f"Planner validation: `meshlearn plan`'s prediction (cost-only, few steps, drain "
                f"points amortized) against simulated training runs of {args.steps} steps (eval "
                f"every {args.steps // 2}); `python bench/plan_validation.py --steps {args.steps}"
                f"{'' if args.access == 'off' else ' --access ' + args.access}`. "
                f"Worst |planner ÷ sim − 1| = {worst:.4f} (goal ≤ 0.05: "
                f"{'met' if worst <= 0.05 else 'missed'}).\n\n" + markdown_table(rows, columns))
    name = "plan_validation" + ("" if args.access == "off" else f"_{args.access}")
    write_results(name, {"steps": args.steps, "access": args.access, "worst_abs_error": worst, "rows": rows},
                  markdown)


if __name__ == "__main__":
    main()
