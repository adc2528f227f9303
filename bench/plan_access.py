"""Mesh adaptation's throughput goals at the paper's shape, per-link bandwidth against one uplink
per participant (``links.access = uplink``).

The paper's shape (issue 12): a Llama-3.2-1B-like model, sequence 2048, P = 8 stages × 7 fast
replicas, the async pipeline with one update per step, A100, 200 Mbit/s and 50 ms links, 16
sequences per replica and step (8 microbatches of 2). The anchor replica is not modelled (the
planner has no anchor circuit; the paper's anchor adds 76 B/token). Rows: dense (all-reduce),
dense + DP compression, M95 (mask stand-in, keep 0.05; all-reduce), M95 + DP, M90 + DP; DP
compression both as PowerSGD r = 64 every step and as the paper's combination, Streaming DiLoCo
H = 10 with PowerSGD r = 64 pseudo-gradients; and a what-if, that DiLoCo with its DP messages
sent at 10^6 Mbit/s (the DP axis free, to see what binds a masked pipeline then). Each row:
``plan.steady.predict`` with its critical path (``plan.critical``), so ``binds`` is the
resource with the largest share of it (PP / DP link: those bytes' serialization, on their own
link or on the shared uplink), beside the busiest uplink's, PP link's and DP link's busy shares
and the bytes per token, measured over ``LONG`` steps (``long_window``).

Goals (issue 12): M95 + DP ÷ dense + DP ≥ 9× (paper 13.6×), M95 + DP ÷ dense ≥ 40× (paper 42×).

    python bench/plan_access.py
"""

from __future__ import annotations

import time

from common import markdown_table, write_results
from plan_papers import ADAPT_1B

from meshlearn.config import RunConfig, load_config
from meshlearn.plan.cost import CostRun, Window
from meshlearn.plan.steady import FAR, RESOURCES, horizon, predict

SHAPE = [*ADAPT_1B, "model.seq_len=2048"]
LONG = 30  # steps of the window bytes and busy shares are measured over: whole DP periods (1, 10) and 6
ACCESS = {"per link": "links.access=off", "uplink": "links.access=uplink"}
ALLREDUCE = ["dp.name=allreduce"]
POWERSGD = ["dp.name=powersgd", "dp.rank=64"]
DILOCO = ["dp.name=diloco", "dp.inner_steps=10", "dp.compress=powersgd", "dp.rank=64"]
FREE_DP = [*DILOCO, "links.dp_bandwidth_mbit=1000000"]  # what-if: DP bytes cost no time, PP as it is
ROWS = [("dense", ALLREDUCE, None), ("dense + DP (PowerSGD r=64)", POWERSGD, None),
        ("dense + DP (DiLoCo H=10 + PowerSGD)", DILOCO, None), ("M95", ALLREDUCE, 0.05),
        ("M95 + DP (PowerSGD r=64)", POWERSGD, 0.05), ("M95 + DP (DiLoCo H=10 + PowerSGD)", DILOCO, 0.05),
        ("M90 + DP (DiLoCo H=10 + PowerSGD)", DILOCO, 0.10),
        ("dense + DP (DP free)", FREE_DP, None), ("M95 + DP (DP free)", FREE_DP, 0.05)]
PAPER = {"dense": (1100, 22900), "dense + DP (DiLoCo H=10 + PowerSGD)": (3600, 6900),
         "M95 + DP (DiLoCo H=10 + PowerSGD)": (48900, 370), "M90 + DP (DiLoCo H=10 + PowerSGD)": (29300, 713)}


def long_window(cfg: RunConfig, keep: float | None) -> Window:
    """Bytes and busy shares over ``LONG`` steps after the fill: ``predict``'s window is as long
    as the step times' period, and the bytes of a DP round that has queued on an uplink land in
    a pattern of their own (PowerSGD every step on uplinks: every 6th step's window has a stage's
    whole backlog, a busy share of 1.6 in one step with the step times all equal)."""
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=keep)
    start = run.run(horizon(cfg).warm)
    return run.window(start, run.run(LONG))


def predicted(network: str, label: str, dp: list[str], keep: float | None) -> dict:
    cfg = load_config(None, [*SHAPE, *dp, ACCESS[network]])
    started = time.process_time()
    p = predict(cfg, keep, critical_path=True)
    path = p.window.path
    binds = max(RESOURCES, key=path.get)  # ``with_path``'s choice, without its short-window flag
    w = long_window(cfg, keep)
    paper = PAPER.get(label, (None, None))
    return {"network": network, "setting": label, "tokens_per_s": p.tokens_per_s,
            "bytes_per_token_pp": w.bytes_pp / w.tokens, "bytes_per_token_dp": w.bytes_dp / w.tokens,
            "binds": binds, "critical_path": path, "uplink_share": w.uplink_share,
            "pp_link_share": w.pp_link_share, "dp_link_share": w.dp_link_share,
            "compute_share": w.compute_share, "paper_tokens_per_s": paper[0],
            "paper_bytes_per_token": paper[1],
            "steps_simulated": p.steps_simulated, "cpu_s": time.process_time() - started}


def ratios(rows: list[dict]) -> list[dict]:
    """The goals' ratios per network model and DP compression."""
    at = {(r["network"], r["setting"]): r["tokens_per_s"] for r in rows}
    out = []
    for network in ACCESS:
        dense = at[(network, "dense")]
        for dp in ("PowerSGD r=64", "DiLoCo H=10 + PowerSGD", "DP free"):
            m95, plus_dp = at[(network, f"M95 + DP ({dp})")], at[(network, f"dense + DP ({dp})")]
            out.append({"network": network, "dp": dp, "m95_over_dense_dp": m95 / plus_dp,
                        "m95_dp_over_dense": m95 / dense,
                        "goal_9x": m95 / plus_dp >= 9, "goal_40x": m95 / dense >= 40})
    return out


def path_text(path: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in path.items() if abs(v) >= 0.005)


def main() -> None:
    rows = [predicted(network, label, dp, keep) for network in ACCESS for label, dp, keep in ROWS]
    goals = ratios(rows)
    for r in rows:
        r["path_text"] = path_text(r["critical_path"])
        r["paper_text"] = (f"{r['paper_tokens_per_s']:,} ({r['paper_bytes_per_token']:,} B)"
                           if r["paper_tokens_per_s"] else "—")
    columns = [("network", "network", ""), ("setting", "setting", ""), ("tokens_per_s", "tokens/s", ",.0f"),
               ("bytes_per_token_pp", "B/token PP", ",.0f"), ("bytes_per_token_dp", "B/token DP", ",.0f"),
               ("binds", "binds", ""), ("path_text", "critical path", ""),
               ("uplink_share", "busiest uplink", ".2f"), ("pp_link_share", "busiest PP link", ".2f"),
               ("dp_link_share", "busiest DP link", ".2f"), ("compute_share", "compute", ".2f"),
               ("paper_text", "paper tokens/s (B/token)", ""),
               ("cpu_s", "CPU s", ".2f")]
    goal_columns = [("network", "network", ""), ("dp", "DP compression", ""),
                    ("m95_over_dense_dp", "M95 + DP ÷ dense + DP (goal ≥ 9×, paper 13.6×)", ".2f"),
                    ("m95_dp_over_dense", "M95 + DP ÷ dense (goal ≥ 40×, paper 42×)", ".1f")]
    markdown = ("Mesh adaptation's throughput at the paper's shape (Llama-3.2-1B-like, sequence 2048, "
                "8 stages × 7 fast replicas, async, A100, 200 Mbit/s, 50 ms), per-link bandwidth "
                "against one uplink per participant (`python bench/plan_access.py`; "
                "docs/throughput.md).\n\n" + markdown_table(rows, columns)
                + "\n\n" + markdown_table(goals, goal_columns))
    write_results("plan_access", {"rows": rows, "goals": goals}, markdown)


if __name__ == "__main__":
    main()
