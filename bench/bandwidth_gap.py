"""The baseline gap: virtual-clock tokens/s of the demo mesh over 200 Mbit/s against no bandwidth limit.

Compute time comes from the device model (an RTX 4090 at 40% of peak), so the links — not this
machine's CPUs — set the pace, as for our users. The gap between the first two rows is what every
compression method has to close; the lossy casts show how far plain quantization gets.

    python bench/bandwidth_gap.py [--steps 5]
"""

from __future__ import annotations

import argparse

from common import demo_config, markdown_table, scratch_trainer, write_results

CASES = [
    ("unlimited bandwidth, 0 ms", ["link.bandwidth_mbit=inf", "link.latency_ms=0"]),
    ("unlimited bandwidth, 50 ms", ["link.bandwidth_mbit=inf"]),
    ("200 Mbit/s, 50 ms, fp32", []),
    ("200 Mbit/s, 50 ms, bf16", ["codec.name=bf16"]),
    ("200 Mbit/s, 50 ms, int8", ["codec.name=int8"]),
]
# The demo model is so small that a GPU computes a microbatch in microseconds and the 50 ms hops
# dominate. A wider model with longer sequences moves the bottleneck to bandwidth, as in the
# papers' setting; it is slow on CPUs, but the device model makes every step's virtual time equal,
# so two steps measure it.
SCENARIOS = {
    "demo": [],
    "wide": ["model.d_model=512", "model.n_head=8", "model.seq_len=256", "train.batch_size=64"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for scenario, base in SCENARIOS.items():
        for label, overrides in CASES:
            trainer = scratch_trainer(demo_config(*base, *overrides, f"train.steps={args.steps}"))
            for _ in range(args.steps):
                trainer.step()
            s = trainer.summary()
            rows.append({"scenario": scenario, "case": label,
                         "sim_tokens_per_s": s["sim_tokens_per_s"],
                         "bytes_per_token_pp": s["bytes_per_token_pp"],
                         "bytes_per_token_dp": s["bytes_per_token_dp"],
                         "idle_fraction": s["idle_fraction"]})
    for row in rows:
        same_latency = next(r for r in rows if r["scenario"] == row["scenario"]
                            and r["case"] == "unlimited bandwidth, 50 ms")
        row["fraction_of_unlimited"] = row["sim_tokens_per_s"] / same_latency["sim_tokens_per_s"]
    table = markdown_table(rows, [
        ("scenario", "model", ""), ("case", "links", ""),
        ("sim_tokens_per_s", "virtual tokens/s", ".0f"),
        ("fraction_of_unlimited", "÷ unlimited bandwidth (50 ms)", ".3f"),
        ("bytes_per_token_pp", "PP bytes/token", ".0f"),
        ("bytes_per_token_dp", "DP bytes/token", ".0f"), ("idle_fraction", "idle", ".3f")])
    write_results("bandwidth_gap", {"steps": args.steps, "config": "configs/demo.toml",
                                    "scenarios": SCENARIOS,
                                    "compute_model": "device:rtx4090 at 40% utilization",
                                    "rows": rows},
                  f"Demo mesh (4 stages × 2 replicas), device model RTX 4090 @ 40%, {args.steps} "
                  f"steps; `python bench/bandwidth_gap.py`. demo = configs/demo.toml; wide = "
                  f"{' '.join(SCENARIOS['wide'])}\n\n{table}")


if __name__ == "__main__":
    main()
