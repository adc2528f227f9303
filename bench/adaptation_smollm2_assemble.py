"""The table of ``bench/adaptation_smollm2.py`` rebuilt from its run folders (metrics.jsonl and
summary.json of each finished row), for a bench process that ended before writing its results
(it was OOM-killed during its 11th row on 2026-12-01; the finished rows' folders are complete).
Unfinished rows are listed with their last logged training step. Samples are not recoverable
(the runs keep no checkpoint) and are not reported.

    python bench/adaptation_smollm2_assemble.py RUNS_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptation import PAPER, binding
from common import markdown_table, write_results

NAMES = {"dense": "dense", "dense_DP": "dense + DP", "M90": "M90", "M90_anchor": "M90 + anchor",
         "M95": "M95", "M95_anchor": "M95 + anchor"}
COLUMNS = [("row", "row", ""), ("lr", "lr", "g"), ("val_end", "val after", ".4f"),
           ("gain", "gain vs start", "+.4f"), ("vs_dense", "÷ dense − 1", "+.2%"),
           ("tokens_per_s", "virtual tokens/s", ".1f"), ("speedup", "÷ dense", ".1f"),
           ("bytes_pp", "PP B/token", ".0f"), ("bytes_dp", "DP B/token", ".0f"),
           ("bytes_anchor", "anchor B/token", ".0f"), ("binds", "binds", ""),
           ("anchor", "anchor arrivals", ""), ("paper_tokens_per_s", "paper tokens/s", ".0f"),
           ("paper_bytes", "paper B/token", ".0f")]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs")
    args = parser.parse_args()
    runs = Path(args.runs)
    start = next(r["val_loss"] for r in records(runs / "lr2e-05_dense") if r["kind"] == "eval")
    probes = [{"lr": float(p.name.split("_")[1]),
               "val_end": json.loads((p / "summary.json").read_text())["final_val_loss"]}
              for p in sorted(runs.glob("probe_*"))]
    table, unfinished = [], []
    for lr in ("2e-05", "0.0003"):
        for key, name in NAMES.items():
            run = runs / f"lr{lr}_{key}"
            if not run.is_dir():
                continue
            if not (run / "summary.json").is_file():
                last = [r for r in records(run) if r["kind"] == "train"][-1]
                unfinished.append({"row": name, "lr": float(lr), "last_step": last["step"],
                                   "train_loss": last["train_loss"], "grad_norm": last["grad_norm"]})
                continue
            s = json.loads((run / "summary.json").read_text())
            paper_tps, paper_bpt = PAPER[name]
            table.append({"row": name, "lr": float(lr), "val_end": s["final_val_loss"],
                          "tokens_per_s": s["sim_tokens_per_s"], "bytes_pp": s["bytes_per_token_pp"],
                          "bytes_dp": s["bytes_per_token_dp"],
                          "bytes_anchor": s.get("bytes_per_token_anchor", 0.0), "binds": binding(s),
                          "anchor": (f"{s['anchor_delivered']} in / {s['anchor_dropped_late']} late"
                                     if "anchor_delivered" in s else "—"),
                          "paper_tokens_per_s": paper_tps, "paper_bytes": paper_bpt})
    for row in table:
        dense = next(r for r in table if r["lr"] == row["lr"] and r["row"] == "dense")
        row["gain"] = start - row["val_end"]
        row["vs_dense"] = row["val_end"] / dense["val_end"] - 1
        row["speedup"] = row["tokens_per_s"] / dense["tokens_per_s"]
    start_row = {key: "—" for key, _, _ in COLUMNS} | {"row": "no adaptation (pretrained start)",
                                                         "val_end": start, "gain": 0.0}
    lines = ["# Mesh adaptation of SmolLM2-135M to Shakespeare (issue 12's table)", "",
             "Assembled by `bench/adaptation_smollm2_assemble.py` from the run folders of "
             "`bench/adaptation_smollm2.py --steps 20 --anchor-delay 4 --eval-batches 8 --probe-steps 5 "
             "--lrs 2e-5,probe --probe-lrs 1e-4,3e-4,1e-3`, whose process was OOM-killed in its 11th row "
             "(see docs/adaptation.md).", "",
             f"No adaptation: val {start:.4f} nats/token. lr probe (dense, P = 1, D = 1, 5 steps): "
             + ", ".join(f"{p['lr']:g} → {p['val_end']:.4f}" for p in probes) + " (picked 3e-4).", "",
             markdown_table([start_row, *table], COLUMNS), ""]
    for u in unfinished:
        lines.append(f"- {u['row']}, lr {u['lr']:g}: not finished (the bench was killed); last logged "
                     f"step {u['last_step']}: masked train loss {u['train_loss']:.3f}, "
                     f"grad norm {u['grad_norm']:.3g}.")
    write_results("adaptation_smollm2", {"val_start": start, "probe": probes, "rows": table,
                                         "unfinished": unfinished, "training_tokens_per_row": 20 * 4 * 64},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
