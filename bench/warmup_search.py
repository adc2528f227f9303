"""A cheap search for a setting where the warm-up bench's baseline is actually unstable (issue 29).

At ``configs/warmup.toml``'s own setting (150 steps, 16 layers, d_model 128, grad clip 1.0) the
baseline never diverges at any lr up to 1.0, so architecture warm-up has nothing to cure there. Each
probe here is the baseline (no remedy, tracker off) of that config with ``--set`` overrides that make
training harder: higher lr, no gradient clipping, no LR warm-up, more depth, more steps. Every probe
is recorded — spikes (``meshlearn.warmup.find_spikes``), largest excursion over the running EMA,
divergence, final val loss — because the search itself is a result (docs/results/warmup_search.md).

    python bench/warmup_search.py [--only NAME,NAME] [--reuse] [--render]
"""

from __future__ import annotations

import argparse
import json

from common import RESULTS, markdown_table, write_results
from warmup import run

PROBES: dict[str, list[str]] = {  # in the order they were tried; each ≤ ~2.5 min on a loaded core
    "noclip-lr0.03": ["train.grad_clip=0", "train.lr=0.03"],
    "noclip-lr0.1": ["train.grad_clip=0", "train.lr=0.1"],
    "noclip-lr0.3": ["train.grad_clip=0", "train.lr=0.3"],
    "noclip-nowarm-lr0.03": ["train.grad_clip=0", "train.warmup_steps=0", "train.lr=0.03"],
    "noclip-nowarm-lr0.1": ["train.grad_clip=0", "train.warmup_steps=0", "train.lr=0.1"],
    "noclip-32L-d64-lr0.1": ["train.grad_clip=0", "model.n_layer=32", "model.d_model=64", "train.lr=0.1"],
    "b2.999-lr0.01": ["optim.beta2=0.999", "train.lr=0.01"],
    "b2.999-lr0.03": ["optim.beta2=0.999", "train.lr=0.03"],
    "noclip-b2.999-lr0.03": ["train.grad_clip=0", "optim.beta2=0.999", "train.lr=0.03"],
    "d64-lr0.03-600": ["model.d_model=64", "train.lr=0.03", "train.steps=600", "train.warmup_steps=60"],
    "d64-lr0.1-600": ["model.d_model=64", "train.lr=0.1", "train.steps=600", "train.warmup_steps=60"],
    "d64-lr0.3-600": ["model.d_model=64", "train.lr=0.3", "train.steps=600", "train.warmup_steps=60"],
    "clip1-lr0.5": ["train.lr=0.5"],
    "clip1-lr1": ["train.lr=1"],
    "noclip-lr1": ["train.grad_clip=0", "train.lr=1"],
}
COLUMNS = [("probe", "probe", ""), ("setting", "overrides of configs/warmup.toml", ""),
           ("val", "final val loss", ""), ("spikes", "spikes", "d"), ("at", "at steps", ""),
           ("excursion", "max ℓ − EMA (nats)", "+.2f"), ("peak", "max train loss", ".2f"),
           ("wall", "wall (s)", ".0f"), ("load", "load avg", "")]


def probe(name: str, reuse: bool) -> dict:
    """Run one probe (or reuse its finished run; its wall time is then the reuse's)."""
    r = run("search", name, PROBES[name], reuse)
    return {"probe": name, "overrides": PROBES[name], "setting": " ".join(f"`{o}`" for o in PROBES[name]),
            "val": f"div @ {r['steps_done']}" if r["diverged"] else f"{r['final_val_loss']:.4f}",
            "spikes": r["spikes"], "at": ", ".join(map(str, r["spike_steps"][:8])),
            "excursion": r["max_excursion"], "peak": max(r["losses"]), "wall": r["run_wall_s"],
            "load": r["load"], "losses": r["losses"], "diverged": r["diverged"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated probes to run now; the others keep "
                                                   "their row in docs/results/warmup_search.json")
    parser.add_argument("--reuse", action="store_true", help="keep probes that finished with the same config")
    parser.add_argument("--render", action="store_true", help="run nothing; rewrite the table from the JSON")
    args = parser.parse_args()
    names = [] if args.render else args.only.split(",") if args.only else list(PROBES)
    recorded = RESULTS / "warmup_search.json"
    rows = {r["probe"]: r for r in json.loads(recorded.read_text())["probes"]} if recorded.is_file() else {}
    rows |= {name: probe(name, args.reuse) for name in names}
    table = [rows[name] for name in PROBES if name in rows]
    md = ("# Where does the warm-up bench's baseline become unstable?\n\n"
          "`python bench/warmup_search.py`: the baseline of `configs/warmup.toml` (16 layers, d_model 128, "
          "150 steps, 15-step LR warm-up, grad clip 1.0, AdamW β₂ 0.95) with the overrides shown, tracker "
          "off, one CPU thread on a shared machine (load average 1/5/15 min before each probe; the wall "
          "time moves with it). Spike: `meshlearn.warmup.find_spikes` (train loss > its EMA + 0.3 nats, "
          "consecutive steps counted once).\n\n"
          f"{markdown_table(table, COLUMNS)}\n")
    write_results("warmup_search", {"probes": table}, md)


if __name__ == "__main__":
    main()
