"""Subspace networks against dense fp32 and the lossy baselines, on the demo mesh over 200 Mbit/s.

Every run trains the demo config for its full length; compute time on the virtual clock comes from
the device model (RTX 4090 at 40%), so throughput is what the links allow. Baselines run on the
dense model at (about) the subspace codec's bytes: top-k with 4 bf16 values + int16 positions per
token, a fixed random rank-8 projection in bf16, and 4-/8-bit quantization at their own sizes.
Then short runs measure virtual tokens/s with unlimited bandwidth (same 50 ms latency), for the
fraction of it each codec keeps at 200 Mbit/s, on the demo model and on a wider one.

    python bench/subspace.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import RESULTS, ROOT, demo_config, finished_run, markdown_table, scratch_trainer, write_results

from meshlearn.report import render_report
from meshlearn.train import Trainer

SUBSPACE = ["model.subspace_dense_tail=1", "codec.name=subspace", "codec.wire_dtype=bf16"]
RUNS = {
    "dense-fp32": ["codec.name=identity"],
    "subspace-k8": ["model.subspace_rank=8", *SUBSPACE],
    "subspace-k32": ["model.subspace_rank=32", *SUBSPACE],
    "topk-4": ["codec.name=topk", "codec.topk=4", "codec.wire_dtype=bf16"],
    "lowrank-8": ["codec.name=lowrank", "codec.lowrank=8", "codec.wire_dtype=bf16"],
    "int4": ["codec.name=int4"],
    "int8": ["codec.name=int8"],
}
WIDE = ["model.d_model=512", "model.n_head=8", "model.seq_len=256", "train.batch_size=64"]
THROUGHPUT = {  # (scenario base, codec overrides)
    "demo dense-fp32": ([], RUNS["dense-fp32"]),
    "demo subspace-k8": ([], RUNS["subspace-k8"]),
    "demo subspace-k32": ([], RUNS["subspace-k32"]),
    "wide dense-fp32": (WIDE, RUNS["dense-fp32"]),
    "wide subspace-k16": (WIDE, ["model.subspace_rank=16", *SUBSPACE]),
    "wide subspace-k64": (WIDE, ["model.subspace_rank=64", *SUBSPACE]),
    # One replica: no data-parallel all-reduce, so the pipeline boundary is the only traffic.
    "wide-D1 dense-fp32": ([*WIDE, "mesh.replicas=1"], RUNS["dense-fp32"]),
    "wide-D1 subspace-k16": ([*WIDE, "mesh.replicas=1"], ["model.subspace_rank=16", *SUBSPACE]),
}
UNLIMITED = ["link.bandwidth_mbit=inf"]


def train_runs(steps: int, out: Path, reuse: bool) -> list[dict]:
    rows = []
    for name, overrides in RUNS.items():
        run_dir = out / name
        cfg = demo_config(*overrides, f"train.steps={steps}", f"name={name}",
                          "train.checkpoint_every=0")
        summary = finished_run(run_dir, cfg) if reuse else None
        if summary is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            summary = Trainer(cfg, run_dir, progress=False).train()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows.append({"run": name, "summary": summary, "records": records})
        print(f"{name}: val {summary['final_val_loss']:.4f}, {summary['sim_tokens_per_s']:.0f} tok/s")
    return rows


def loss_at_time(records: list[dict], budget_s: float) -> float:
    """Mean train loss of the last 10 steps finished within ``budget_s`` of virtual time."""
    done = [r["train_loss"] for r in records if r["kind"] == "train" and r["sim_time_s"] <= budget_s]
    return sum(done[-10:]) / len(done[-10:]) if done else float("nan")


def throughput(steps: int) -> list[dict]:
    rows = []
    for label, (base, codec) in THROUGHPUT.items():
        speeds = {}
        for links, extra in (("200 Mbit/s", []), ("unlimited", UNLIMITED)):
            trainer = scratch_trainer(demo_config(*base, *codec, *extra, f"train.steps={steps}"))
            for _ in range(steps):
                trainer.step()
            speeds[links] = trainer.summary()
        s = speeds["200 Mbit/s"]
        rows.append({"case": label, "tokens_per_s": s["sim_tokens_per_s"],
                     "unlimited_tokens_per_s": speeds["unlimited"]["sim_tokens_per_s"],
                     "kept": s["sim_tokens_per_s"] / speeds["unlimited"]["sim_tokens_per_s"],
                     "bytes_per_token_pp": s["bytes_per_token_pp"],
                     "bytes_per_token_dp": s["bytes_per_token_dp"]})
    for row in rows:
        dense = next(r for r in rows if r["case"].split()[0] == row["case"].split()[0]
                     and "dense" in r["case"])
        row["over_dense"] = row["tokens_per_s"] / dense["tokens_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--throughput-steps", type=int, default=2)
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs in bench/out/subspace/ that finished with the same config")
    args = parser.parse_args()
    out = ROOT / "bench" / "out" / "subspace"
    runs = train_runs(args.steps, out, args.reuse)
    budget = min(r["summary"]["sim_time_s"] for r in runs)
    dense = next(r for r in runs if r["run"] == "dense-fp32")["summary"]
    table_rows = []
    for r in runs:
        s = r["summary"]
        table_rows.append({
            "run": r["run"], "final_val_loss": s["final_val_loss"],
            "val_gap": s["final_val_loss"] - dense["final_val_loss"],
            "loss_at_budget": loss_at_time(r["records"], budget),
            "bytes_per_token_pp": s["bytes_per_token_pp"],
            "pp_ratio": dense["bytes_per_token_pp"] / s["bytes_per_token_pp"],
            "sim_tokens_per_s": s["sim_tokens_per_s"], "sim_time_s": s["sim_time_s"]})
    report = render_report([out / r["run"] for r in runs], RESULTS / "subspace")
    speed = throughput(args.throughput_steps)
    quality = markdown_table(table_rows, [
        ("run", "run", ""), ("final_val_loss", f"val loss @ {args.steps} steps", ".4f"),
        ("val_gap", "− dense", "+.4f"), ("loss_at_budget", f"train loss @ {budget:.0f} s virtual", ".4f"),
        ("bytes_per_token_pp", "PP bytes/token", ".1f"), ("pp_ratio", "PP compression", ".1f"),
        ("sim_tokens_per_s", "virtual tokens/s", ".0f"), ("sim_time_s", "virtual time (s)", ".0f")])
    speed_table = markdown_table(speed, [
        ("case", "model / codec", ""), ("tokens_per_s", "tokens/s @ 200 Mbit/s", ".0f"),
        ("over_dense", "÷ dense", ".2f"), ("unlimited_tokens_per_s", "tokens/s unlimited", ".0f"),
        ("kept", "kept at 200 Mbit/s", ".3f"), ("bytes_per_token_pp", "PP B/token", ".1f"),
        ("bytes_per_token_dp", "DP B/token", ".0f")])
    write_results("subspace", {"steps": args.steps, "runs": RUNS, "time_budget_s": budget,
                               "quality": table_rows, "throughput": speed,
                               "report": str(report.relative_to(ROOT))},
                  f"Demo mesh (4 stages × 2 replicas, 200 Mbit/s, 50 ms), device model RTX 4090 @ "
                  f"40%; `python bench/subspace.py --steps {args.steps}`\n\n{quality}\n\n"
                  f"Throughput (virtual clock, {args.throughput_steps} steps; unlimited = infinite "
                  f"bandwidth, same 50 ms latency; wide = {' '.join(WIDE)})\n\n{speed_table}\n\n"
                  f"Plots: [loss vs step](subspace/loss_vs_step.png), "
                  f"[loss vs virtual time](subspace/loss_vs_sim_time.png), "
                  f"[bytes per token](subspace/bytes_per_token.png)")


if __name__ == "__main__":
    main()
