"""Could a verifier see a sign-flipped gradient by pairing it with the activation it answers?

SENTINEL's four metrics miss attacks on gradients alone (docs/sentinel.md): a gradient message's
batch mean is noise around a small reference, and −g looks like g. A verifier sees both the
activation h a worker received and the gradient g = ∂L/∂h it sends back for the same microbatch, and
mean cos(h, g) changes sign under g → −g. This measures whether honest traffic gives that statistic a
consistent sign: the demo model, unsplit, trained with its own optimizer and lr (constant), and at the
s1|s2 boundary of the demo's 4-stage split (after block 1) the per-microbatch mean over tokens of
cos(h, g), every ``--every`` steps, for microbatches of the demo's size (4 sequences).

    python bench/sentinel_grad_pairing.py [--steps 300] [--every 10]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import demo_config, markdown_table, write_results

from meshlearn.assemble import resolve
from meshlearn.data import global_batch
from meshlearn.data.corpus import load_corpus
from meshlearn.models import Decoder, init_model
from meshlearn.optim import build_optimizer

BOUNDARY_AFTER = "1"  # block 1 ends stage 1 of the demo's 4 stages: the s1|s2 boundary
MICROBATCH = 4  # sequences per microbatch on the demo mesh: 32 / 2 replicas / 4 microbatches


def forward_with_boundary(model: Decoder, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, and the residual stream at the boundary with its gradient retained."""
    h = model.tok_emb(x)
    boundary = h
    for name, block in model.layers.items():
        h = block(h, model.rope_cos, model.rope_sin)
        if name == BOUNDARY_AFTER:
            h.retain_grad()
            boundary = h
    return model.head(model.norm(h)), boundary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = demo_config()
    corpus = load_corpus(cfg, None)
    cfg = resolve(cfg, corpus.vocab_size)
    model = init_model(cfg.model, cfg.seed)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, args.steps)
    rows = []
    for step in range(args.steps):
        x, y = global_batch(corpus.splits.train, step, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
        logits, boundary = forward_with_boundary(model, x)
        loss = Decoder.loss(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            cos = torch.nn.functional.cosine_similarity(boundary.detach(), boundary.grad, dim=-1)
            per_microbatch = cos.reshape(-1, MICROBATCH, cos.shape[-1]).mean(dim=(1, 2)).tolist()
            rows.append({"step": step, "loss": loss.item(), "mean": statistics.mean(per_microbatch),
                         "min": min(per_microbatch), "max": max(per_microbatch),
                         "positive": sum(c > 0 for c in per_microbatch) / len(per_microbatch)})
    values = [r["mean"] for r in rows]
    summary = {"mean": statistics.mean(values), "stdev": statistics.stdev(values),
               "min": min(r["min"] for r in rows), "max": max(r["max"] for r in rows),
               "positive_share": statistics.mean(r["positive"] for r in rows)}
    text = "\n\n".join([
        f"Per-microbatch mean cos(h, g) at the demo's s1|s2 boundary, unsplit demo model, "
        f"{args.steps} steps (constant lr {cfg.train.lr:g}), every {args.every} steps. "
        f"`python bench/sentinel_grad_pairing.py --steps {args.steps} --every {args.every}`",
        f"Over all records: mean {summary['mean']:+.4f}, stdev {summary['stdev']:.4f}, range "
        f"[{summary['min']:+.4f}, {summary['max']:+.4f}], share of positive microbatches "
        f"{summary['positive_share']:.2f}. A usable detector of g → −g needs one sign, far from 0.",
        markdown_table(rows, [("step", "step", "d"), ("loss", "train loss", ".3f"),
                              ("mean", "mean over microbatches", "+.4f"), ("min", "min", "+.4f"),
                              ("max", "max", "+.4f"), ("positive", "share > 0", ".2f")]),
    ])
    write_results("sentinel_grad_pairing", {"steps": args.steps, "every": args.every, "rows": rows,
                                            "summary": summary}, text)


if __name__ == "__main__":
    main()
