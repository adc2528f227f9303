"""Mesh adaptation's throughput goals at the paper's shape, per-link bandwidth against one uplink
per participant (``links.access = uplink``).

The paper's shape (issue 12): a Llama-3.2-1B-like model, sequence 2048, P = 8 stages × 7 fast
replicas, the async pipeline with one update per step, A100, 200 Mbit/s and 50 ms links, 16
sequences per replica and step (8 microbatches of 2). Rows: dense (all-reduce),
dense + DP compression, M95 (mask stand-in, keep 0.05; all-reduce), M95 + DP, M90 + DP; DP
compression both as PowerSGD r = 64 every step and as the paper's combination, Streaming DiLoCo
H = 10 with PowerSGD r = 64 pseudo-gradients; and a what-if, that DiLoCo with its DP messages
sent at 10^6 Mbit/s (the DP axis free, to see what binds a masked pipeline then). And with the
anchor circuit, Z = 1 (``plan.anchor``: the circuit's own passes, hand-offs, relay and shares
in cost-only mode; K = 20, top-64 factors in bf16): dense, dense + DP, M90 + DP and M95 + DP with
the anchor on the agreed (outer) weights, which fast (0, s) follows by relaying its stage's
DP results, and dense + DP and M95 + DP with per-stage snapshots instead; under uplinks what
leaves fast (0, s) for the anchor shares (0, s)'s uplink. Each row: ``plan.steady.predict``
with its critical path (``plan.critical``), and ``binds`` is ``with_path``'s: the resource with
the largest share of it (PP / DP link: those bytes' serialization, on their own link or on the
shared uplink; the anchor's bytes on a fast uplink count as PP link), beside the busiest
uplink's, PP link's and DP link's busy shares and the bytes per token, measured over ``LONG``
steps (``long_window``; anchored rows over ``LONG_ANCHOR``: whole hand-off periods).

Goals (issue 12): M95 + DP ÷ dense + DP ≥ 9× (paper 13.6×), M95 + DP ÷ dense ≥ 40× (paper 42×),
and with the anchor (the paper's M95 + AP): M95 + DP + anchor ÷ dense + DP (paper 12.9×) and
÷ dense (paper 42×).

    python bench/plan_access.py
"""

from __future__ import annotations

import argparse
import time

from common import markdown_table, write_results
from plan_papers import ADAPT_1B

from meshlearn.config import RunConfig, load_config
from meshlearn.plan.cost import CostRun, Window
from meshlearn.plan.steady import FAR, horizon, predict, with_path

SHAPE = [*ADAPT_1B, "model.seq_len=2048"]
LONG = 30  # steps of the window bytes and busy shares are measured over: whole DP periods (1, 10) and 6
LONG_ANCHOR = 60  # anchored rows: also whole hand-off periods (K = 20)
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
ANCHOR = ["optim.spectral.enabled=true", "anchor.z=1", "anchor.delay=20", "anchor.max_late=10",
          "anchor.send=factors", "anchor.rank=64", "anchor.wire_dtype=bf16"]
OUTER, SNAPSHOT = [*ANCHOR, "anchor.weights=outer"], [*ANCHOR, "anchor.weights=snapshot"]
ROWS += [("dense + anchor", [*ALLREDUCE, *OUTER], None),
         ("dense + DP (DiLoCo H=10 + PowerSGD) + anchor", [*DILOCO, *OUTER], None),
         ("M90 + DP (DiLoCo H=10 + PowerSGD) + anchor", [*DILOCO, *OUTER], 0.10),
         ("M95 + DP (DiLoCo H=10 + PowerSGD) + anchor", [*DILOCO, *OUTER], 0.05),
         ("dense + DP (DiLoCo H=10 + PowerSGD) + anchor (snapshot)", [*DILOCO, *SNAPSHOT], None),
         ("M95 + DP (DiLoCo H=10 + PowerSGD) + anchor (snapshot)", [*DILOCO, *SNAPSHOT], 0.05)]
PAPER = {"dense": (1100, 22900), "dense + DP (DiLoCo H=10 + PowerSGD)": (3600, 6900),
         "M95 + DP (DiLoCo H=10 + PowerSGD)": (48900, 370), "M90 + DP (DiLoCo H=10 + PowerSGD)": (29300, 713),
         "M90 + DP (DiLoCo H=10 + PowerSGD) + anchor": (27800, 790),
         "M95 + DP (DiLoCo H=10 + PowerSGD) + anchor": (46500, 446)}


def long_window(cfg: RunConfig, keep: float | None) -> tuple[Window, dict[str, int]]:
    """Bytes and busy shares over ``LONG`` steps after the fill (``LONG_ANCHOR`` with an anchor):
    ``predict``'s window is as long as the step times' period, and the bytes of a DP round that
    has queued on an uplink land in a pattern of their own (PowerSGD every step on uplinks: every
    6th step's window has a stage's whole backlog, a busy share of 1.6 in one step with the step
    times all equal). Also the anchor's bytes per term over the window ({} without one)."""
    run = CostRun(cfg, FAR, drain_at=FAR, mask_keep=keep)
    start = run.run(horizon(cfg).warm)
    before = dict(vars(run.anchor.circuit.bytes)) if run.anchor else {}
    window = run.window(start, run.run(LONG_ANCHOR if run.anchor else LONG))
    terms = {k: v - before[k] for k, v in vars(run.anchor.circuit.bytes).items()} if run.anchor else {}
    return window, terms


def predicted(network: str, label: str, dp: list[str], keep: float | None) -> dict:
    cfg = load_config(None, [*SHAPE, *dp, ACCESS[network]])
    started = time.process_time()
    p = predict(cfg, keep, critical_path=True)
    path = p.window.path
    w, terms = long_window(cfg, keep)
    paper = PAPER.get(label, (None, None))
    anchor = {}
    if w.anchor is not None:
        anchor = {"anchor": w.anchor.as_dict(), "anchor_bytes_per_token": w.anchor.bytes_per_token,
                  "anchor_terms_per_token": {k: v / w.tokens for k, v in terms.items()},
                  "anchor_keeps_up": w.anchor.keeps_up}
    return {"network": network, "setting": label, "tokens_per_s": p.tokens_per_s, **anchor,
            "bytes_per_token_pp": w.bytes_pp / w.tokens, "bytes_per_token_dp": w.bytes_dp / w.tokens,
            "binds": with_path(cfg, p).binds, "critical_path": path, "uplink_share": w.uplink_share,
            "pp_link_share": w.pp_link_share, "dp_link_share": w.dp_link_share,
            "compute_share": w.compute_share, "paper_tokens_per_s": paper[0],
            "paper_bytes_per_token": paper[1],
            "steps_simulated": p.steps_simulated, "cpu_s": time.process_time() - started}


def ratios(rows: list[dict]) -> list[dict]:
    """The goals' ratios per network model and DP compression; with the anchor, M95 + DP +
    anchor over the rows without one (the paper's dense and +DP rows have no anchor)."""
    at = {(r["network"], r["setting"]): r["tokens_per_s"] for r in rows}
    out = []
    for network in ACCESS:
        dense = at[(network, "dense")]
        for dp, anchor in [("PowerSGD r=64", ""), ("DiLoCo H=10 + PowerSGD", ""), ("DP free", ""),
                           ("DiLoCo H=10 + PowerSGD", " + anchor"),
                           ("DiLoCo H=10 + PowerSGD", " + anchor (snapshot)")]:
            m95 = at[(network, f"M95 + DP ({dp}){anchor}")]
            plus_dp = at[(network, f"dense + DP ({dp})")]
            out.append({"network": network, "dp": dp + anchor, "m95_over_dense_dp": m95 / plus_dp,
                        "m95_dp_over_dense": m95 / dense,
                        "goal_9x": m95 / plus_dp >= 9, "goal_40x": m95 / dense >= 40})
    return out


def anchor_text(r: dict) -> str:
    """The anchor's bytes per token, its largest terms, and whether it keeps up."""
    if "anchor" not in r:
        return "—"
    a, terms = r["anchor"], r["anchor_terms_per_token"]
    parts = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v >= 0.5)
    late = (f"keeps up, ≤ {a['late_max']} steps late" if a["keeps_up"] else
            f"LATE: {a['dropped_late']} shares dropped, {a['delivered']} delivered")
    return f"{a['bytes_per_token']:,.0f} ({parts}; {late})"


def path_text(path: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in path.items() if abs(v) >= 0.005)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: --help only
    rows = [predicted(network, label, dp, keep) for network in ACCESS for label, dp, keep in ROWS]
    goals = ratios(rows)
    for r in rows:
        r["path_text"] = path_text(r["critical_path"])
        r["paper_text"] = (f"{r['paper_tokens_per_s']:,} ({r['paper_bytes_per_token']:,} B)"
                           if r["paper_tokens_per_s"] else "—")
        r["anchor_text"] = anchor_text(r)
    columns = [("network", "network", ""), ("setting", "setting", ""), ("tokens_per_s", "tokens/s", ",.0f"),
               ("bytes_per_token_pp", "B/token PP", ",.0f"), ("bytes_per_token_dp", "B/token DP", ",.0f"),
               ("binds", "binds", ""), ("path_text", "critical path", ""),
               ("uplink_share", "busiest uplink", ".2f"), ("pp_link_share", "busiest PP link", ".2f"),
               ("dp_link_share", "busiest DP link", ".2f"), ("compute_share", "compute", ".2f"),
               ("anchor_text", "anchor B/token (keeps up)", ""),
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
