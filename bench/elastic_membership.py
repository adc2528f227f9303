"""The two memberships of an elastic run beside the fixed-membership driver, nobody failing.

The demo model on P=2 stages × D=2 replicas, every link 100 Mbit/s with 20 ms one-way latency,
sender-paced (``bench/elastic.py``'s setting), four processes on this machine, one run each, one
after the other: the fixed-membership DistDriver on gloo, and on framed streams (pipeline links
and DP sums: what ``"control"`` runs on, and a cluster run's default); elastic with
``elastic.membership = "torchft"`` (a lighthouse per stage, a quorum asked for at every step;
gloo), compared with the first; elastic with ``"control"`` (a record on the run's store, reused
until a change is signalled, on framed streams; docs/elastic.md, "Membership on the control
service"), compared with the second.

Reported per run: the median wall time per step (steps after the first), the quorum's own median
time per step (``quorum_s``), and under ``"control"`` the median of the quorum's requests to the
store per step (``quorum_requests``) — on one machine the store is on loopback, so that count,
not the time, says what the quorum would cost a step over a WAN (one round trip each).

    python bench/elastic_membership.py [--steps 16]
"""

from __future__ import annotations

import argparse
import os
import statistics

from common import markdown_table, write_results
from elastic import run

# The fixed driver on the streams "control" uses: framed pipeline links and framed DP sums (a
# cluster run's default, on its authenticated streams) — the like-for-like baseline.
FRAMED = ("dist.links=tcp", "dist.trusted_links=false")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    runs = {"fixed membership (DistDriver), gloo": run(args.steps, False, None, 0),
            "fixed membership, framed links and sums": run(args.steps, False, None, 0, extra=FRAMED)}
    for membership in ("torchft", "control"):
        runs[f"elastic, membership {membership}"] = run(args.steps, True, None, 0,
                                                       extra=(f"elastic.membership={membership}",))

    def median(rows: list[dict], key: str):
        values = [r[key] for r in rows[1:] if r.get(key) is not None]
        return statistics.median(values) if values else "—"
    table = [{"run": name, "step_s": median(rows, "step_wall_s"), "quorum_s": median(rows, "quorum_s"),
              "quorum_requests": median(rows, "quorum_requests")} for name, rows in runs.items()]
    markdown = markdown_table(table, [("run", "run", ""), ("step_s", "median s/step", ".3f"),
                                      ("quorum_s", "median quorum s/step", ".4f"),
                                      ("quorum_requests", "median quorum requests/step", "")])
    for row, baseline in ((table[2], table[0]), (table[3], table[1])):
        extra = row["step_s"] - baseline["step_s"]
        markdown += (f"\n\n{row['run']}: {extra:+.3f} s/step against {baseline['run']} "
                     f"({extra / baseline['step_s'] * 100:+.1f}%).")
    markdown += (f"\n\nDemo model, P=2 × D=2, 100 Mbit/s, 20 ms, {args.steps} steps, one run each, "
                 f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} at the end. "
                 f"`OMP_NUM_THREADS=1 python bench/elastic_membership.py --steps {args.steps}`.")
    write_results("elastic_membership", {"args": vars(args), "table": table,
                                         "records": {name: rows for name, rows in runs.items()}}, markdown)


if __name__ == "__main__":
    main()
