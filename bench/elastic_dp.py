"""The message-based DP strategies under elastic membership, beside the fixed-membership driver.

bench/elastic.py's setting (the demo model on P=2 × D=2, every link 100 Mbit/s with 20 ms one-way
latency, sender-paced, four processes on this machine), per strategy three runs: the fixed
driver, elastic with nobody failing, and elastic with r1s1 SIGKILLed once ``--fail-after`` steps
are logged. Reported: median wall s/step (steps after the first), the failover time and the steps
lost (bench/elastic.py's definition), and the last committed train loss of each run (the elastic
driver clips per stage, the fixed one by the row's norm: close, not equal).

    python bench/elastic_dp.py [--steps 16] [--fail-after 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics

from common import markdown_table, write_results
from elastic import failover_s, run

STRATEGIES = {
    "diloco": ("dp.name=diloco", "dp.inner_steps=4", "dp.fragments=2"),
    "powersgd": ("dp.name=powersgd", "dp.rank=4"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--fail-after", type=int, default=5)
    args = parser.parse_args()
    table, records = [], {}
    for name, sets in STRATEGIES.items():
        fixed = run(args.steps, False, None, 0, sets)
        clean = run(args.steps, True, None, 0, sets)
        killed = run(args.steps, True, signal.SIGKILL, args.fail_after, sets)
        records[name] = {"fixed": fixed, "elastic": clean, "kill": killed}
        clean_step = statistics.median(r["step_wall_s"] for r in clean[1:])
        kill_s, lost = failover_s(killed, clean_step)
        for label, rows in [("fixed", fixed), ("elastic", clean), (f"elastic, r1s1 SIGKILLed after step "
                                                                  f"{args.fail_after}", killed)]:
            committed = [r for r in rows if r["committed"]] if "committed" in rows[0] else rows
            table.append({"strategy": name, "run": label,
                          "step_s": statistics.median(r["step_wall_s"] for r in rows[1:]),
                          "failover_s": kill_s if rows is killed else "—",
                          "lost": str(lost) if rows is killed else "—",
                          "loss": committed[-1]["train_loss"]})
    markdown = markdown_table(table, [("strategy", "dp.name", ""), ("run", "run", ""),
                                      ("step_s", "median s/step", ".3f"),
                                      ("failover_s", "failover s", ".2f"), ("lost", "steps lost", ""),
                                      ("loss", "last train loss", ".4f")])
    markdown += (f"\n\nDemo model, P=2 × D=2, 100 Mbit/s, 20 ms, {args.steps} steps, dist.dead_after_s=2, "
                 f"dist.timeout_s=10, {'; '.join(f'{n}: ' + ' '.join(s) for n, s in STRATEGIES.items())}; "
                 f"load average {os.getloadavg()[0]:.1f}.")
    write_results("elastic_dp", {"args": vars(args), "table": table, "records": records}, markdown)


if __name__ == "__main__":
    main()
