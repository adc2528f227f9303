"""The papers' throughput claims re-derived by ``meshlearn plan`` with their stated settings.

Three settings (docs/throughput.md says where each comes from and what is assumed):

- subspace networks: Llama-style 8B, 32 one-layer stages × 2 replicas (64 L4), GPipe, links of
  60–350 Mbit/s, the DP axis as Pluralis's production stack averages it (5% every 20 steps);
  subspace k = 40 (d/k ≈ 100, the official code) against uncompressed, and against
  uncompressed on 100 Gbit/s links;
- mesh adaptation: Llama-3.2-1B, 8 stages × 7 fast replicas, 200 Mbit/s, one update per step;
  dense, compressed DP (DiLoCo; PowerSGD), random masks M90/M95 (the planner's mask stand-in);
- AsyncMesh: its 12-layer d = 768 model on several meshes; fully synchronous (1F1B + all-reduce)
  against AsyncMesh (async pipeline + sparse averaging p = 0.05, D = 10).

Each number is ``plan.steady.predict`` (tokens/s of the whole run, drain points amortized); the
CPU time of each prediction is recorded, and one full ``meshlearn plan`` table per paper is timed.

    python bench/plan_papers.py
"""

from __future__ import annotations

import time

from common import markdown_table, write_results

from meshlearn.config import load_config
from meshlearn.plan.planner import plan
from meshlearn.plan.presets import preset_overrides
from meshlearn.plan.steady import predict

TRAIN = ["train.steps=1000", "train.eval_every=100", "train.checkpoint_every=0", "link.latency_ms=50"]
SUBSPACE_8B = [*preset_overrides("llama-8b"), "model.seq_len=1024", "mesh.stages=32", "mesh.replicas=2",
               "mesh.microbatches=8", "mesh.schedule=gpipe", "train.batch_size=64", "sim.device=l4",
               "codec.wire_dtype=bf16", "dp.name=sparse", "dp.fraction=0.05", "dp.every=20",
               "dp.rule=delta", *TRAIN]
K40 = ["model.subspace_rank=40", "model.subspace_dense_tail=1", "codec.name=subspace"]
ADAPT_1B = [*preset_overrides("llama-1b", tied=False), "model.seq_len=1024", "mesh.stages=8",
            "mesh.replicas=7", "mesh.microbatches=8", "mesh.schedule=async", "mesh.update_every=8",
            "train.batch_size=112",
            "sim.device=a100", "link.bandwidth_mbit=200", "codec.name=bf16", *TRAIN]
ASYNCMESH = ["model.vocab_size=50304", "model.n_layer=12", "model.d_model=768", "model.n_head=12",
             "model.seq_len=1024", "mesh.microbatches=8", "sim.device=a100", *TRAIN]
FULLSYNC = ["mesh.schedule=1f1b", "dp.name=allreduce"]
ASYNC_SPARSE = ["mesh.schedule=async", "dp.name=sparse", "dp.fraction=0.05", "dp.delay=10",
                "optim.name=nadamw"]
BF16 = [*SUBSPACE_8B, "codec.name=bf16"]
POWERSGD = [*ADAPT_1B, "dp.name=powersgd", "dp.rank=64"]


def predicted(paper: str, label: str, sets: list[str], mask_keep: float | None = None) -> dict:
    cfg = load_config(None, sets)
    started = time.process_time()
    p = predict(cfg, mask_keep)
    w = p.window
    return {"paper": paper, "setting": label, "tokens_per_s": p.tokens_per_s,
            "bytes_per_token_pp": w.bytes_pp / w.tokens, "bytes_per_token_dp": w.bytes_dp / w.tokens,
            "idle": w.idle_fraction, "steps_simulated": p.steps_simulated,
            "cpu_s": time.process_time() - started}


def subspace_rows() -> list[dict]:
    rows = []
    for mbit in (60, 100, 350):
        link = [f"link.bandwidth_mbit={mbit}"]
        rows.append(predicted("subspace", f"dense bf16, {mbit} Mbit/s", [*BF16, *link]))
        rows.append(predicted("subspace", f"k=40, {mbit} Mbit/s", [*SUBSPACE_8B, *K40, *link]))
    rows.append(predicted("subspace", "dense bf16, 100 Gbit/s (centralized)",
                          [*BF16, "link.bandwidth_mbit=100000", "link.latency_ms=0.01"]))
    return rows


def adaptation_rows() -> list[dict]:
    rows = [predicted("adaptation", "dense, all-reduce", [*ADAPT_1B, "dp.name=allreduce"]),
            predicted("adaptation", "dense, +DP (DiLoCo H=10)", [*ADAPT_1B, "dp.name=diloco"]),
            predicted("adaptation", "dense, +DP (PowerSGD r=64)", POWERSGD)]
    for keep, name in ((0.10, "M90"), (0.05, "M95")):
        rows.append(predicted("adaptation", f"{name} (keep {keep}), +DP (PowerSGD r=64)", POWERSGD, keep))
    return rows


def asyncmesh_rows() -> list[dict]:
    rows = []
    for stages, replicas, mbit in ((4, 2, 1000), (4, 2, 100), (6, 2, 100), (4, 4, 100)):
        mesh = [f"mesh.stages={stages}", f"mesh.replicas={replicas}", f"link.bandwidth_mbit={mbit}",
                f"train.batch_size={8 * replicas * 8}"]
        for label, keys in (("FullSync", FULLSYNC), ("AsyncMesh", ASYNC_SPARSE)):
            rows.append(predicted("asyncmesh", f"{stages}×{replicas} {mbit} Mbit/s {label}",
                                  [*ASYNCMESH, *mesh, *keys]))
    return rows


def timed_table(paper: str, sets: list[str], **kw) -> dict:
    started = time.process_time()
    result = plan(load_config(None, sets), **kw)
    return {"paper": paper, "rows": len(result["methods"]), "cpu_s": time.process_time() - started,
            "sweep_points": len(result["sweep"]["bandwidth_mbit"])}


def main() -> None:
    rows = subspace_rows() + adaptation_rows() + asyncmesh_rows()
    tables = [timed_table("subspace (8B, 32×2, 100 Mbit/s)", [*SUBSPACE_8B, "link.bandwidth_mbit=100"],
                          rank=40, keeps=(0.05,)),
              timed_table("adaptation (1B, 8×7, 200 Mbit/s)", ADAPT_1B, keeps=(0.1, 0.05)),
              timed_table("asyncmesh (4×2, 100 Mbit/s)",
                          [*ASYNCMESH, "mesh.stages=4", "mesh.replicas=2", "link.bandwidth_mbit=100",
                           "train.batch_size=128"])]
    columns = [("paper", "paper", ""), ("setting", "setting", ""), ("tokens_per_s", "tokens/s", ",.0f"),
               ("bytes_per_token_pp", "B/token PP", ",.0f"), ("bytes_per_token_dp", "B/token DP", ",.0f"),
               ("idle", "idle", ".2f"), ("steps_simulated", "steps simulated", "d"),
               ("cpu_s", "CPU s", ".2f")]
    timing = [("paper", "full `meshlearn plan` table", ""), ("rows", "method rows", "d"),
              ("sweep_points", "sweep points", "d"), ("cpu_s", "CPU s (this machine)", ".1f")]
    markdown = ("The papers' settings through the planner (`python bench/plan_papers.py`); "
                "settings and assumptions in docs/throughput.md.\n\n" + markdown_table(rows, columns)
                + "\n\n" + markdown_table(tables, timing))
    write_results("plan_papers", {"predictions": rows, "tables": tables}, markdown)


if __name__ == "__main__":
    main()
