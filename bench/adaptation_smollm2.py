"""Mesh adaptation of SmolLM2-135M to Shakespeare: the paper's table re-measured (issue 12).

Continual pretraining of the pretrained preset (``model.init = smollm2-135m``, untied: a P > 1 mesh
gives the last stage its own copy of the embedding) on the Shakespeare corpus, tokenized by the
model's own tokenizer, on a P = ``--stages`` × D = ``--replicas`` fast mesh, async schedule,
200 Mbit/s / 50 ms links, device model (RTX 4090 @ 40%). For each learning rate of ``--lrs`` (AdamW,
linear warm-up then cosine to 0.1 × lr) six rows, as in ``bench/adaptation.py``: dense, dense + DP
compression, M90, M90 + anchor, M95, M95 + anchor; plus "no adaptation" (the pretrained start,
evaluated once: every row starts from these weights, and evaluation is unmasked).

``--lrs`` may hold ``probe``: the learning rate among ``--probe-lrs`` whose dense run on one
worker (P = 1, D = 1, same global batch and sequence length) reaches the lowest validation loss
after ``--probe-steps`` steps. It stands for "a learning rate at which dense adaptation actually
moves"; the paper's 2e-5 hardly moves in a budget this small.

Per row: validation loss (nats/token, dense evaluation on the same ``--eval-batches`` batches)
after adaptation, virtual tokens/s, bytes per token on the PP and DP axes and the anchor's own
links, the binding resource, and a sample generation from replica 0's merged stages.

The runs keep no checkpoints: one would be 3.9 GB here (12 workers' weights and AdamW moments),
and the samples are taken from the trained workers in the same process.

    flock /tmp/meshlearn-bench.lock env PYTHONPATH=src OMP_NUM_THREADS=1 python bench/adaptation_smollm2.py \\
        [--steps 30] [--seq-len 64] [--batch-size 4] [--lrs 2e-5,probe]

Runs live in bench/out/adaptation_smollm2/; results go to docs/results/adaptation_smollm2.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from adaptation import PAPER, binding
from common import ROOT, dumps, markdown_table, write_results

from meshlearn.config import RunConfig, load_config, to_dict
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import DecoderConfig
from meshlearn.models.split import merge_stages
from meshlearn.sample import Generation, sample_from_pretrained
from meshlearn.train import Trainer

OUT = ROOT / "bench" / "out" / "adaptation_smollm2"
PROMPT = "**KING**  \nWhat news from"


class BenchTrainer(Trainer):
    """A trainer that writes no checkpoint (3.9 GB each at this size; nothing here resumes)."""

    def save_checkpoint(self) -> Path:
        return self.run_dir


def base_sets(args, lr: float, steps: int) -> list[str]:
    return [
        "model.init=smollm2-135m",
        "model.tie_embeddings=false",
        "data.corpus=shakespeare",
        f"model.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"train.eval_batches={args.eval_batches}",
        "train.checkpoint_every=0",
        f"train.lr={lr}",
        f"train.warmup_steps={max(1, steps // 10)}",
        "optim.name=adamw",
        "link.bandwidth_mbit=200",
        "link.latency_ms=50",
        "sim.compute=device",
        "sim.device=rtx4090",
        f"seed={args.seed}",
    ]


def mesh_sets(args) -> list[str]:
    return [
        f"mesh.stages={args.stages}",
        f"mesh.replicas={args.replicas}",
        "mesh.schedule=async",
        f"mesh.microbatches={args.microbatches}",
    ]


def rows(args) -> dict[str, list[str]]:
    """The paper's six rows (DP compression: mode B, streaming DiLoCo with PowerSGD; the masked rows
    compress the DP axis too, as the paper's byte counts imply)."""
    dp = [
        "dp.name=diloco",
        "dp.compress=powersgd",
        f"dp.rank={args.rank}",
        f"dp.inner_steps={args.inner_steps}",
    ]
    anchor = [
        "optim.spectral.enabled=true",
        "anchor.z=1",
        f"anchor.delay={args.anchor_delay}",
        f"anchor.max_late={args.anchor_delay}",
        f"anchor.bandwidth_mbit={args.anchor_bandwidth}",
    ]
    return {
        "dense": ["codec.name=bf16"],
        "dense + DP": ["codec.name=bf16", *dp],
        "M90": ["codec.name=mask", "codec.keep=0.1", *dp],
        "M90 + anchor": ["codec.name=mask", "codec.keep=0.1", *dp, *anchor],
        "M95": ["codec.name=mask", "codec.keep=0.05", *dp],
        "M95 + anchor": ["codec.name=mask", "codec.keep=0.05", *dp, *anchor],
    }


def train(cfg: RunConfig, run_dir: Path, evaluate_start: bool) -> tuple[BenchTrainer, dict, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    trainer = BenchTrainer(cfg, run_dir, progress=False)
    if evaluate_start:
        trainer.evaluate()
    summary = trainer.train()
    return trainer, summary, time.perf_counter() - started


def evals(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r["kind"] == "eval"]


def sample(trainer: Trainer, args) -> str:
    """Replica 0's stages merged into the unsplit model; sampled with the preset's sample below."""
    stages = [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(trainer.cfg.mesh.stages)]
    model = merge_stages(DecoderConfig(**to_dict(trainer.cfg)["model"]), stages).eval()
    tokenizer = trainer.corpus.tokenizer
    context = torch.tensor([tokenizer.encode(PROMPT)], dtype=torch.long)
    how = Generation(seed=args.seed)
    out = model.generate(
        context,
        args.sample_tokens,
        temperature=how.temperature,
        top_k=50,
        generator=torch.Generator().manual_seed(how.seed),
    )
    return tokenizer.decode(out[0].tolist())


def probe(args) -> tuple[float, list[dict]]:
    """The dense learning rate of ``--probe-lrs`` with the lowest validation loss after
    ``--probe-steps`` steps on one worker."""
    results = []
    for lr in args.probe_lrs:
        cfg = load_config(
            None,
            [
                *base_sets(args, lr, args.probe_steps),
                "mesh.stages=1",
                "mesh.replicas=1",
                "mesh.schedule=1f1b",
                f"mesh.microbatches={args.microbatches}",
                "codec.name=identity",
            ],
        )
        _, summary, wall = train(cfg, OUT / f"probe_{lr:g}", evaluate_start=False)
        results.append({"lr": lr, "val_end": summary["final_val_loss"], "wall_s": wall})
        print(f"probe lr {lr:g}: val {summary['final_val_loss']:.4f} ({wall:.0f} s)", flush=True)
    return min(results, key=lambda r: r["val_end"])["lr"], results


def describe(name: str, lr: float, summary: dict, val_end: float, text: str, wall: float) -> dict:
    paper_tps, paper_bpt = PAPER[name]
    return {
        "row": name,
        "lr": lr,
        "val_end": val_end,
        "tokens_per_s": summary["sim_tokens_per_s"],
        "bytes_pp": summary["bytes_per_token_pp"],
        "bytes_dp": summary["bytes_per_token_dp"],
        "bytes_anchor": summary.get("bytes_per_token_anchor", 0.0),
        "binds": binding(summary),
        "anchor": (
            f"{summary['anchor_delivered']} in / {summary['anchor_dropped_late']} late"
            if "anchor_delivered" in summary
            else "—"
        ),
        "paper_tokens_per_s": paper_tps,
        "paper_bytes": paper_bpt,
        "wall_s": wall,
        "sample": text,
    }


COLUMNS = [
    ("row", "row", ""),
    ("lr", "lr", "g"),
    ("val_end", "val after", ".4f"),
    ("gain", "gain vs start", "+.4f"),
    ("vs_dense", "÷ dense − 1", "+.2%"),
    ("tokens_per_s", "virtual tokens/s", ".1f"),
    ("speedup", "÷ dense", ".1f"),
    ("bytes_pp", "PP B/token", ".0f"),
    ("bytes_dp", "DP B/token", ".0f"),
    ("bytes_anchor", "anchor B/token", ".0f"),
    ("binds", "binds", ""),
    ("anchor", "anchor arrivals", ""),
    ("paper_tokens_per_s", "paper tokens/s", ".0f"),
    ("paper_bytes", "paper B/token", ".0f"),
    ("wall_s", "wall (s)", ".0f"),
]


def markdown(
    args, start: float, start_sample: str, table: list[dict], probes: list[dict], wall: float
) -> str:
    tokens = args.steps * args.batch_size * args.seq_len
    lines = [
        "# Mesh adaptation of SmolLM2-135M to Shakespeare (issue 12's table)",
        "",
        f"`python bench/adaptation_smollm2.py {' '.join(args.argv)}`; wall {wall / 60:.1f} min on 2 "
        "shared CPU cores (OMP_NUM_THREADS=1).",
        f"P = {args.stages}, D = {args.replicas} fast replicas, async, {args.microbatches} "
        f"microbatches, 200 Mbit/s / 50 ms, device model RTX 4090 @ 40%; {args.steps} steps × "
        f"{args.batch_size} sequences × {args.seq_len} tokens = {tokens:,} training tokens per row; "
        f"AdamW, warm-up {max(1, args.steps // 10)} steps then cosine to 0.1 × lr; validation "
        f"{args.eval_batches} × {args.batch_size} × {args.seq_len} tokens (dense evaluation). DP "
        f"compression: streaming DiLoCo H = {args.inner_steps} with PowerSGD rank {args.rank}. Anchor "
        f"rows: Z = 1, K = {args.anchor_delay}, cap {args.anchor_delay} steps late, bf16 anchor wire, "
        "α = 0.3, τ = 1e-3 absolute, β_anc = 0.95.",
        "",
        f"No adaptation (the pretrained start, evaluated once: every row starts there): val **{start:.4f}** "
        "nats/token.",
        "",
    ]
    if probes:
        lines += [
            "lr probe (dense, P = 1, D = 1, "
            f"{args.probe_steps} steps): " + ", ".join(f"{p['lr']:g} → {p['val_end']:.4f}" for p in probes),
            "",
        ]
    start_row = {key: "—" for key, _, _ in COLUMNS} | {
        "row": "no adaptation (pretrained start)",
        "val_end": start,
        "gain": 0.0,
    }
    lines += [markdown_table([start_row, *table], COLUMNS), ""]
    for lr in dict.fromkeys(r["lr"] for r in table):
        at = {r["row"]: r for r in table if r["lr"] == lr}
        if not {"dense", "dense + DP", "M95", "M95 + anchor"} <= set(at):
            continue
        dense, dp, m95, m95a = at["dense"], at["dense + DP"], at["M95"], at["M95 + anchor"]
        lines.append(
            f"- lr {lr:g}: dense gains {start - dense['val_end']:.4f} nats over the start; "
            f"M95 + anchor {m95a['vs_dense']:+.2%} of dense (goal: within 2%), M95 {m95['vs_dense']:+.2%}; "
            f"M95 ÷ dense + DP tokens/s {m95['tokens_per_s'] / dp['tokens_per_s']:.1f}× (paper 13.6×), "
            f"M95 + anchor ÷ dense {m95a['speedup']:.1f}× (paper 42×)."
        )
    lines += [
        "",
        "## Samples",
        "",
        f"Prompt `{PROMPT!r}`, {args.sample_tokens} tokens, temperature 0.8, top-k 50, seed {args.seed}.",
        "",
        "**Pretrained start:**",
        "",
        "```",
        start_sample,
        "```",
        "",
    ]
    for r in table:
        lines += [f"**{r['row']}, lr {r['lr']:g}:**", "", "```", r["sample"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="global (all replicas)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--lrs", default="2e-5,probe", help="comma-separated; 'probe' = the probe's pick")
    parser.add_argument("--probe-lrs", default="1e-4,3e-4,1e-3")
    parser.add_argument("--probe-steps", type=int, default=6)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--anchor-delay", type=int, default=5)
    parser.add_argument("--anchor-bandwidth", type=float, default=0.0,
                        help="Mbit/s of the anchor's own links (0 = the PP links')")
    parser.add_argument("--rows", default="", help="comma-separated row names to run (default: all six)")
    parser.add_argument("--dense-from", default="",
                        help="a results JSON of this script whose dense rows the ratios use (with --rows)")
    parser.add_argument("--results", default="adaptation_smollm2", help="name under docs/results/")
    parser.add_argument("--sample-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    args.probe_lrs = [float(v) for v in args.probe_lrs.split(",")]
    started = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    lrs, probes = [], []
    for value in args.lrs.split(","):
        if value == "probe":
            picked, probes = probe(args)
            lrs.append(picked)
        else:
            lrs.append(float(value))
    start_sample = sample_from_pretrained(
        "smollm2-135m", PROMPT, args.sample_tokens, Generation(seed=args.seed)
    )
    start, table = None, []
    for lr in lrs:
        wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
        for name, sets in rows(args).items():
            if wanted and name not in wanted:
                continue
            cfg = load_config(None, [*base_sets(args, lr, args.steps), *mesh_sets(args), *sets])
            run_dir = OUT / f"lr{lr:g}_{name.replace(' ', '').replace('+', '_')}"
            trainer, summary, wall = train(cfg, run_dir, evaluate_start=start is None)
            losses = evals(run_dir)
            start = losses[0] if start is None else start
            table.append(describe(name, lr, summary, losses[-1], sample(trainer, args), wall))
            del trainer
            print(
                f"lr {lr:g} {name}: val {start:.4f} → {losses[-1]:.4f}, "
                f"{summary['sim_tokens_per_s']:.1f} tokens/s, {wall:.0f} s",
                flush=True,
            )
    references = json.loads(Path(args.dense_from).read_text())["rows"] if args.dense_from else table
    for row in table:
        dense = next(r for r in references if r["lr"] == row["lr"] and r["row"] == "dense")
        row["gain"] = start - row["val_end"]
        row["vs_dense"] = row["val_end"] / dense["val_end"] - 1
        row["speedup"] = row["tokens_per_s"] / dense["tokens_per_s"]
    wall = time.perf_counter() - started
    payload = {
        "args": {k: v for k, v in vars(args).items()},
        "val_start": start,
        "start_sample": start_sample,
        "probe": probes,
        "rows": table,
        "wall_s": wall,
        "training_tokens_per_row": args.steps * args.batch_size * args.seq_len,
    }
    write_results(args.results, payload, markdown(args, start, start_sample, table, probes, wall))
    print(dumps({"wall_s": wall}))


if __name__ == "__main__":
    main()
