"""Mesh adaptation of SmolLM2-135M to Shakespeare: the paper's table re-measured (issue 12).

Continual pretraining of the pretrained preset (``model.init = smollm2-135m``, untied: a P > 1 mesh
gives the last stage its own copy of the embedding) on the Shakespeare corpus, tokenized by the
model's own tokenizer, on a P = ``--stages`` × D = ``--replicas`` fast mesh, async schedule,
200 Mbit/s / 50 ms links, device model (RTX 4090 @ 40%). For each learning rate of ``--lrs`` (AdamW,
linear warm-up then cosine to 0.1 × lr) the rows of ``--rows`` (default: the paper's six, as in
``bench/adaptation.py``: dense, dense + DP compression, M90, M90 + anchor, M95, M95 + anchor).

**One row per process.** A row's trainer holds 12 workers' weights, AdamW moments, the DP strategy's
state and the async schedule's weight versions (the M90 row peaked at 15.7 GB resident); the process
that ran row after row was OOM-killed in its 11th, on a machine shared with other jobs. So this
script, as the outer process, runs each row as ``--row NAME --lr LR`` in a child process (its memory
is returned when it exits) that takes the bench lock (``--lock``) for that row only, and assembles
the table from the rows' results. A row's process writes its run folder
``bench/out/adaptation_smollm2/<row>_<settings hash>/`` (metrics.jsonl, summary.json, config.toml;
no checkpoint: 3.9 GB each) and, last and atomically, ``result.json``: the settings it ran with, the
validation loss (dense, nats/token) of the pretrained start and after adaptation, the masked
validation loss after (mask rows: the final weights with the run's own mask at every boundary, open
detail 7), the summary's throughput, bytes and anchor counters, and two samples from replica 0's
merged stages, one before training (the pretrained start) and one after. A rerun skips every row
whose result.json was written with the same settings (the whole resolved config but the anchor and
spectral sections of a row without anchor, plus the prompt and sample length): the table resumes and
never mixes settings.

**PP compression of at least 10× (issue 29).** The rows of ``PP_ROWS`` code a boundary's two
directions differently (``codec.backward``): the gradients through the unbiased backward-only mask
(1/keep rescale), the activations through a lossy codec (top-k, random low-rank, int4, a rescaled
mask), with the DP compression of the masked rows; they are compared with dense + DP at the same
learning rate (run here, or read from ``--reference``, an earlier results file's rows). Every row's
process also evaluates the replicas' mean weights merged into the unsplit model with no codec at any
boundary ("val, no codec"): a lossy forward codec codes evaluation messages too, so the run's own
val_loss is the coded pipeline's, and the adapted weights' own loss is what compares across codecs.

``--lrs`` may hold ``probe``: the learning rate among ``--probe-lrs`` whose dense run on one
worker (P = 1, D = 1, same global batch and sequence length; one row process each) reaches the
lowest validation loss after ``--probe-steps`` steps. It stands for "a learning rate at which dense
adaptation actually moves"; the paper's 2e-5 hardly moves in a budget this small.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/adaptation_smollm2.py [--steps 20] [--lrs 2e-5,3e-4] \\
        [--rows "dense,M95"] [--no-run] [--reference adaptation_smollm2_densedp]

Results go to docs/results/adaptation_smollm2.{json,md} (``--results``): the rows asked for;
``--no-run`` assembles them from the finished rows alone.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import resource
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from adaptation import PAPER, binding
from adaptation_sweep import bf16_factor, masked_val_loss, unsplit_val_loss
from common import RESULTS, ROOT, markdown_table, write_results

from meshlearn.atomic import atomic_write_json
from meshlearn.config import RunConfig, load_config, to_dict
from meshlearn.jsonl import read_records
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import merge_stages
from meshlearn.sample import Generation, generate_text
from meshlearn.train import Trainer
from meshlearn.train.provenance import describe_run

OUT = ROOT / "bench" / "out" / "adaptation_smollm2"
PROMPT = "**KING**  \nWhat news from"
BACK_M95 = ["codec.backward.name=mask", "codec.backward.keep=0.05"]  # rescaled: unbiased, 58 B/token
PP_ROWS = {
    # Codec settings of the PP-compression rows (d = 576: a bf16 boundary is 2,304 B per token both
    # ways, 1/10 of it 230.4 B). Bytes per boundary and token, forward + backward, in the comments.
    "bwd M95 + fwd top-40": ["codec.name=topk", "codec.topk=40", *BACK_M95],  # 160 + 58: 10.6×
    "bwd M95 + fwd lowrank-86": ["codec.name=lowrank", "codec.lowrank=86", *BACK_M95],  # 172 + 58: 10.0×
    "bwd M95 + fwd int4": ["codec.name=int4", *BACK_M95],  # 292 + 58: 6.6×, over the budget
    "bwd M98 + fwd top-51": ["codec.name=topk", "codec.topk=51", "codec.backward.name=mask",
                            "codec.backward.keep=0.02"],  # 204 + 24: 10.1×
    "bwd M98 + fwd lowrank-103": ["codec.name=lowrank", "codec.lowrank=103", "codec.backward.name=mask",
                                  "codec.backward.keep=0.02"],  # 206 + 24: 10.0×
    "bwd M95 + fwd M85 rescale": ["codec.name=mask", "codec.keep=0.15", "codec.rescale=true",
                                 *BACK_M95],  # 172 + 58: 10.0×
    "M95 rescale": ["codec.name=mask", "codec.keep=0.05", "codec.rescale=true"],  # 58 + 58: 19.9×
    # Issue 29, 4(b): the same with the anchor's clean gradient as a delayed error feedback.
    "M95 rescale + anchor EF": ["codec.name=mask", "codec.keep=0.05", "codec.rescale=true"],
}
# The error-feedback anchor: full gradients, computed on fast replica 0's own weights of the step.
EF = ["anchor.send=gradients", "anchor.weights=snapshot", "anchor.use=error_feedback"]
ROW_NAMES = ["dense", "dense + DP", "M90", "M90 + anchor", "M95", "M95 + anchor", *PP_ROWS]
# The options a row's process needs (every other option is the outer process's own).
ROW_OPTIONS = ["steps", "stages", "replicas", "microbatches", "seq_len", "batch_size", "eval_batches",
               "probe_steps", "rank", "inner_steps", "anchor_delay", "anchor_bandwidth", "sample_tokens",
               "seed"]


class BenchTrainer(Trainer):
    """A trainer that writes no checkpoint (3.9 GB each at this size; a row reruns from the start)."""

    def save_checkpoint(self) -> Path:
        return self.run_dir


# --- the rows' configs ---------------------------------------------------------------------


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


def row_sets(args, name: str) -> list[str]:
    """The paper's six rows (DP compression: mode B, streaming DiLoCo with PowerSGD; the masked rows
    compress the DP axis too, as the paper's byte counts imply), on the fast mesh; ``probe``: dense
    on one worker."""
    if name == "probe":
        return ["mesh.stages=1", "mesh.replicas=1", "mesh.schedule=1f1b",
                f"mesh.microbatches={args.microbatches}", "codec.name=identity"]
    mesh = [f"mesh.stages={args.stages}", f"mesh.replicas={args.replicas}", "mesh.schedule=async",
            f"mesh.microbatches={args.microbatches}"]
    dp = ["dp.name=diloco", "dp.compress=powersgd", f"dp.rank={args.rank}",
          f"dp.inner_steps={args.inner_steps}"]
    anchor = ["optim.spectral.enabled=true", "anchor.z=1", f"anchor.delay={args.anchor_delay}",
              f"anchor.max_late={args.anchor_delay}", f"anchor.bandwidth_mbit={args.anchor_bandwidth}"]
    keep = {"M90": "0.1", "M95": "0.05"}.get(name.split(" ")[0])
    codec = PP_ROWS.get(name) or (["codec.name=bf16"] if keep is None else
                                  ["codec.name=mask", f"codec.keep={keep}"])
    anchored = [*anchor, *EF] if name.endswith("anchor EF") else anchor if name.endswith("anchor") else []
    return [*mesh, *codec, *(dp if name != "dense" else []), *anchored]


def row_config(args, name: str, lr: float) -> RunConfig:
    steps = args.probe_steps if name == "probe" else args.steps
    return load_config(None, [*base_sets(args, lr, steps), *row_sets(args, name), *args.sets])


def settings(cfg: RunConfig, args) -> dict:
    """What a row's result depends on, as JSON: a row without anchor leaves out the anchor and
    spectral sections (settings it does not use, so their defaults may change without a rerun)."""
    config = to_dict(cfg)
    if cfg.anchor.z == 0:
        config.pop("anchor")
        config["optim"].pop("spectral")
    return json.loads(json.dumps({"config": config, "prompt": PROMPT, "sample_tokens": args.sample_tokens},
                                 sort_keys=True, default=str))


def row_dir(name: str, lr: float, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    slug = name.replace(" ", "").replace("+", "_")
    return OUT / f"lr{lr:g}_{slug}_{digest}"


# --- one row (the child process) -----------------------------------------------------------


def replica0_model(trainer: Trainer) -> Decoder:
    """Replica 0's stages merged into the unsplit model (its RNG draws do not touch the run's)."""
    stages = [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(trainer.cfg.mesh.stages)]
    return merge_stages(DecoderConfig(**to_dict(trainer.cfg)["model"]), stages).eval()


def sample(model: Decoder, trainer: Trainer, args) -> str:
    return generate_text(model, trainer.corpus.tokenizer, PROMPT, args.sample_tokens,
                         Generation(seed=args.seed))


def run_row(args) -> None:
    """Train one row from the pretrained start and write its result.json (last, atomically)."""
    cfg = row_config(args, args.row, args.lr)
    key = settings(cfg, args)
    run_dir = row_dir(args.row, args.lr, key)
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    trainer = BenchTrainer(cfg, run_dir, progress=False)
    val_start = trainer.evaluate()
    before = sample(replica0_model(trainer), trainer, args)
    summary = trainer.train()
    model = replica0_model(trainer)
    with torch.no_grad():
        masked = masked_val_loss(model, cfg, trainer.val_batches) if cfg.codec.name == "mask" else None
    replicas = [[trainer.workers[WorkerId(r, s)].module.state_dict() for s in range(cfg.mesh.stages)]
                for r in range(cfg.mesh.replicas)]
    unsplit = unsplit_val_loss(model.cfg, replicas, trainer.val_batches)
    result = {
        "row": args.row, "lr": args.lr, "settings": key, "run_dir": run_dir.name,
        "measured_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": describe_run()["commit"], "val_start": val_start, "val_end": summary["final_val_loss"],
        "masked_val_end": masked, "unsplit_val_end": unsplit,
        "pp_factor": bf16_factor(cfg, summary["bytes_per_token_pp"]), "sample_before": before,
        "sample_after": sample(model, trainer, args),
        "summary": summary, "wall_s": time.perf_counter() - started,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: kB
    }
    atomic_write_json(run_dir / "result.json", result)
    print(f"lr {args.lr:g} {args.row}: val {val_start:.4f} → {summary['final_val_loss']:.4f}"
          + ("" if masked is None else f" (masked {masked:.4f})") + f", no codec {unsplit:.4f}, "
          f"{result['wall_s']:.0f} s", flush=True)


# --- the table (the outer process) ---------------------------------------------------------


def ensure(args, name: str, lr: float) -> dict:
    """The row's result: read back if its process already ran with these settings, else run it
    (under the bench lock); a row whose process died is returned with its last logged step."""
    key = settings(row_config(args, name, lr), args)
    run_dir = row_dir(name, lr, key)
    result_file = run_dir / "result.json"
    if not result_file.is_file() or json.loads(result_file.read_text())["settings"] != key:
        if args.no_run:
            print(f"not run: lr {lr:g} {name} → {run_dir.name}")
            return {"row": name, "lr": lr, "missing": "not run"}
        options = [f"--{o.replace('_', '-')}={getattr(args, o)}" for o in ROW_OPTIONS]
        options += [f"--set={o}" for o in args.sets]
        with open(args.lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another benchmark runs
            subprocess.run([sys.executable, __file__, "--row", name, f"--lr={lr!r}", *options], check=False)
    if result_file.is_file():
        print(f"done: lr {lr:g} {name} ({run_dir.name})", flush=True)
        return json.loads(result_file.read_text())
    train = [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"] \
        if (run_dir / "metrics.jsonl").is_file() else []
    last = f"died after step {train[-1]['step']} of {args.steps}" if train else "died before step 1"
    return {"row": name, "lr": lr, "missing": last}


def table_row(result: dict, start: float, dense: dict | None, dense_dp: dict | None) -> dict:
    if "missing" in result:
        return {key: "—" for key, _, _ in COLUMNS} | {"row": result["row"], "lr": result["lr"],
                                                      "val_end": f"({result['missing']})"}
    s = result["summary"]
    paper_tps, paper_bpt = PAPER.get(result["row"], ("—", "—"))
    unsplit = result.get("unsplit_val_end")
    return {
        "row": result["row"], "lr": result["lr"], "val_start": result["val_start"],
        "val_end": result["val_end"], "unsplit_val": "—" if unsplit is None else unsplit,
        "masked_val": "—" if result["masked_val_end"] is None else result["masked_val_end"],
        "gain": start - (unsplit if result["row"] in PP_ROWS else result["val_end"]),  # the weights'
        "vs_dense": "—" if dense is None else result["val_end"] / dense["val_end"] - 1,
        "vs_dense_dp": "—" if dense_dp is None or unsplit is None else unsplit / dense_dp["val_end"] - 1,
        "pp_factor": result.get("pp_factor", "—"),
        "tokens_per_s": s["sim_tokens_per_s"],
        "speedup": "—" if dense is None else s["sim_tokens_per_s"] / dense["summary"]["sim_tokens_per_s"],
        "bytes_pp": s["bytes_per_token_pp"], "bytes_dp": s["bytes_per_token_dp"],
        "bytes_anchor": s.get("bytes_per_token_anchor", 0.0), "binds": binding(s),
        "anchor": (f"{s['anchor_delivered']} in / {s['anchor_dropped_late']} late / "
                   f"{s['anchor_pending_at_end']} pending" if "anchor_delivered" in s else "—"),
        "paper_tokens_per_s": paper_tps, "paper_bytes": paper_bpt, "wall_s": result["wall_s"],
        "peak_rss_gb": result.get("peak_rss_gb", "—"),
        "measured": f"{result['measured_utc']} ({(result['commit'] or '?')[:7]})",
    }


COLUMNS = [
    ("row", "row", ""), ("lr", "lr", "g"), ("val_start", "val before", ".4f"),
    ("val_end", "val after", ".4f"),
    ("unsplit_val", "val, no codec", ".4f"), ("masked_val", "masked val after", ".4f"),
    ("gain", "gain vs start", "+.4f"), ("vs_dense", "÷ dense − 1", "+.2%"),
    ("vs_dense_dp", "no codec ÷ (dense + DP) − 1", "+.2%"), ("tokens_per_s", "virtual tokens/s", ".1f"),
    ("speedup", "÷ dense", ".1f"), ("bytes_pp", "PP B/token", ".0f"), ("pp_factor", "÷ bf16 PP", ".2f"),
    ("bytes_dp", "DP B/token", ".0f"),
    ("bytes_anchor", "anchor B/token", ".0f"), ("binds", "binds", ""), ("anchor", "anchor arrivals", ""),
    ("paper_tokens_per_s", "paper tokens/s", ".0f"), ("paper_bytes", "paper B/token", ".0f"),
    ("wall_s", "wall (s)", ".0f"), ("peak_rss_gb", "peak RSS (GB)", ".1f"),
    ("measured", "measured UTC (commit)", ""),
]


def reference_rows(name: str) -> list[dict]:
    """The finished rows of an earlier results file (docs/results/NAME.json), as they were measured
    (their own commit and time in the last column)."""
    return [r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"] if "missing" not in r]


def assemble(args, results: list[dict], probes: list[dict]) -> None:
    ran = {(r["row"], r["lr"]) for r in results}
    lrs = {r["lr"] for r in results}
    results = [*(r for r in (reference_rows(args.reference) if args.reference else [])
                 if (r["row"], r["lr"]) not in ran and r["lr"] in lrs), *results]
    done = [r for r in results if "missing" not in r]
    # A lossy forward codec codes the start's evaluation too: its own "val before" column.
    lossless = [r for r in done if r["row"] not in PP_ROWS]
    starts = sorted({round(r["val_start"], 6) for r in lossless})
    start = lossless[0]["val_start"] if lossless else float("nan")
    befores = {r["sample_before"] for r in done}
    dense = {r["lr"]: r for r in done if r["row"] == "dense"}
    dense_dp = {r["lr"]: r for r in done if r["row"] == "dense + DP"}
    table = [table_row(r, start, dense.get(r["lr"]), dense_dp.get(r["lr"])) for r in results]
    tokens = args.steps * args.batch_size * args.seq_len
    start_row = {key: "—" for key, _, _ in COLUMNS} | {"row": "no adaptation (pretrained start)",
                                                         "val_end": start, "gain": 0.0}
    lines = [
        "# Mesh adaptation of SmolLM2-135M to Shakespeare (issue 12's table)",
        "",
        f"`python bench/adaptation_smollm2.py {' '.join(args.argv)}`: one process per row, on 2 shared "
        "CPU cores (OMP_NUM_THREADS=1); each row's measurement time and commit are in its last column.",
        f"P = {args.stages}, D = {args.replicas} fast replicas, async, {args.microbatches} microbatches, "
        f"200 Mbit/s / 50 ms, device model RTX 4090 @ 40%; {args.steps} steps × {args.batch_size} "
        f"sequences × {args.seq_len} tokens = **{tokens:,} training tokens per row**; AdamW, warm-up "
        f"{max(1, args.steps // 10)} steps then cosine to 0.1 × lr; validation {args.eval_batches} × "
        f"{args.batch_size} × {args.seq_len} tokens, dense evaluation (masked beside it for the mask "
        f"rows: the final weights with the run's own mask at every boundary). DP compression: streaming "
        f"DiLoCo H = {args.inner_steps} with PowerSGD rank {args.rank}. Anchor rows: Z = 1, "
        f"K = {args.anchor_delay}, cap {args.anchor_delay} steps late, anchor links "
        f"{args.anchor_bandwidth or 200:g} Mbit/s, the anchor and spectral defaults otherwise.",
        "\"val, no codec\": the replicas' mean weights merged into the unsplit model, no codec at any "
        "boundary (a lossy forward codec codes the run's own evaluation too); \"no codec ÷ (dense + "
        "DP) − 1\" divides it by dense + DP's val after at the same lr, and the gain vs start of a "
        "PP-compression row is its val, no codec's; \"÷ bf16 PP\": bf16 "
        "boundaries' PP bytes per token over the row's."
        + (f" Rows not run by this command are read from results/{args.reference}.json "
           "(their commit and time in the last column)." if args.reference else ""),
        "",
        f"No adaptation (the pretrained start, evaluated by every row before its first step): val "
        f"**{start:.4f}** nats/token" + ("" if len(starts) <= 1 else f" (rows disagree: {starts})") + ".",
        "",
    ]
    if probes:
        lines += ["lr probe (dense, P = 1, D = 1, " f"{args.probe_steps} steps): "
                  + ", ".join(f"{p['lr']:g} → {p['val_end']:.4f}" for p in probes if "missing" not in p), ""]
    lines += [markdown_table([start_row, *table], COLUMNS), "", "## Samples", "",
              f"Prompt `{PROMPT!r}`, {args.sample_tokens} tokens, temperature 0.8, top-k 50, "
              f"seed {args.seed}; replica 0's stages merged.", ""]
    for before in sorted(befores):
        lines += ["**Pretrained start** (every row's weights before its first step"
                  + ("" if len(befores) == 1 else ", rows disagree") + "):", "", "```", before, "```", ""]
    for r in done:
        lines += [f"**{r['row']}, lr {r['lr']:g}, after adaptation:**", "", "```", r["sample_after"], "```",
                  ""]
    payload = {"args": {k: v for k, v in vars(args).items() if k != "row"}, "val_start": start,
               "training_tokens_per_row": tokens,
               "probe": [{k: v for k, v in p.items() if k != "settings"} for p in probes],
               "rows": [{k: v for k, v in r.items() if k != "settings"} for r in results]}
    write_results(args.results, payload, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="global (all replicas)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--lrs", default="2e-5,3e-4", help="comma-separated; 'probe' = the probe's pick")
    parser.add_argument("--probe-lrs", default="1e-4,3e-4,1e-3")
    parser.add_argument("--probe-steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--anchor-delay", type=int, default=4)
    parser.add_argument("--anchor-bandwidth", type=float, default=0.0,
                        help="Mbit/s of the anchor's own links (0 = the PP links')")
    parser.add_argument("--rows", default=",".join(ROW_NAMES), help="comma-separated row names, in order")
    parser.add_argument("--results", default="adaptation_smollm2", help="name under docs/results/")
    parser.add_argument("--reference", default="",
                        help="an earlier results name whose rows join the table (e.g. dense + DP)")
    parser.add_argument("--sample-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock", default="/tmp/meshlearn-bench.lock", help="held while a row runs")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="config override for every row (repeatable; part of each row's key, so a "
                             "variant never mixes with the default rows: give it its own --results)")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: list the rows not run yet, assemble the table of the others")
    parser.add_argument("--row", default="", help="(a row's process) run this row only")
    parser.add_argument("--lr", type=float, default=0.0, help="(a row's process) its learning rate")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.row:
        run_row(args)
        return
    wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in ROW_NAMES]
    if unknown:
        sys.exit(f"--rows: {unknown} unknown; allowed: {ROW_NAMES}")
    lrs, probes = [], []
    for value in args.lrs.split(","):
        if value != "probe":
            lrs.append(float(value))
            continue
        probes = [ensure(args, "probe", float(lr)) for lr in args.probe_lrs.split(",")]
        ran = [p for p in probes if "missing" not in p]
        if len(ran) < len(probes):
            sys.exit("--lrs probe: a probe row has not finished; see its run folder")
        lrs.append(min(ran, key=lambda p: p["val_end"])["lr"])
    assemble(args, [ensure(args, name, lr) for lr in lrs for name in wanted], probes)


if __name__ == "__main__":
    main()
