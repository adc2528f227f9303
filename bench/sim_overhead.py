"""Simulator overhead: wall tokens/s of the mesh against the unsplit model, side by side.

The mesh is P=4, D=1, identity codec, unlimited bandwidth; the reference is the same model in one
process, trained on the same global batches with the same optimizer. Steps alternate between the
two so both see the same machine load. Two references are reported: the whole batch in one
forward/backward (what a user would run), and the same microbatches accumulated (isolating the
simulator's own cost from the smaller matmuls microbatching implies).

    python bench/sim_overhead.py [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import demo_config, markdown_table, scratch_trainer, write_results

from meshlearn.data import global_batch
from meshlearn.models import Decoder, init_model
from meshlearn.optim import build_optimizer


def reference_step(model, optimizer, x, y, microbatches: int) -> None:
    for mx, my in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        (Decoder.loss(model(mx), my) / microbatches).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    cfg = demo_config("mesh.stages=4", "mesh.replicas=1", "codec.name=identity",
                      "link.bandwidth_mbit=inf", "link.latency_ms=0", "sim.compute=measured")
    trainer = scratch_trainer(cfg)
    cfg = trainer.cfg
    M = cfg.mesh.microbatches
    refs = {"unsplit, whole batch": 1, f"unsplit, {M} microbatches": M}
    models = {name: init_model(cfg.model, cfg.seed) for name in refs}
    optims = {name: build_optimizer(m, cfg.optim, cfg.train.lr) for name, m in models.items()}
    wall = {"mesh": 0.0} | {name: 0.0 for name in refs}

    for t in range(args.warmup + args.steps):
        x, y = global_batch(trainer.corpus.splits.train, t, cfg.train.batch_size,
                            cfg.model.seq_len, cfg.seed)
        started = time.perf_counter()
        trainer.step()
        mesh_s = time.perf_counter() - started
        ref_s = {}
        for name, micro in refs.items():
            started = time.perf_counter()
            reference_step(models[name], optims[name], x, y, micro)
            ref_s[name] = time.perf_counter() - started
        if t >= args.warmup:
            wall["mesh"] += mesh_s
            for name in refs:
                wall[name] += ref_s[name]

    tokens = args.steps * cfg.train.batch_size * cfg.model.seq_len
    rows = []
    for name, seconds in wall.items():
        rows.append({"runner": name, "tokens_per_s": tokens / seconds,
                     "mesh_over_this": wall[name] / wall["mesh"]})
    payload = {"steps": args.steps, "tokens_per_step": cfg.train.batch_size * cfg.model.seq_len,
               "mesh": "P=4, D=1, identity codec, unlimited bandwidth, measured compute",
               "model": vars(cfg.model) | {}, "rows": rows, "torch_threads": torch.get_num_threads()}
    table = markdown_table(rows, [("runner", "runner", ""), ("tokens_per_s", "wall tokens/s", ".0f"),
                                  ("mesh_over_this", "mesh tokens/s ÷ this", ".3f")])
    write_results("sim_overhead", payload,
                  f"Simulator overhead ({args.steps} steps, demo model, {torch.get_num_threads()} "
                  f"threads; `python bench/sim_overhead.py`)\n\n{table}")


if __name__ == "__main__":
    main()
