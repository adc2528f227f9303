"""Why masked adaptation is so far from dense at small scale: one lever at a time (issue 12).

``bench/adaptation.py`` (small scale) measured M95 at +101% and M95 + anchor at +96% of dense
validation loss, against the paper's "within 2%". This sweep starts from the same pretrained demo
model and the same adaptation run (P = 4, D = 2, async, 60 steps, streaming-DiLoCo DP compression
in the masked rows) and changes one thing per row: keep, rescaling, the mask form, DP compression,
the spectral correction's α and τ, the anchor's K, the number of boundaries (P = 2: one boundary
after 2 layers, the paper's 2 layers per stage) and the learning rate (the bench's 1e-3 against
the paper's 2e-5). Every row is compared with the dense row at the same P and learning rate.

The PP-compression screen (issue 29): rows that code the two directions of a boundary differently
(``codec.backward``): the gradients through the unbiased backward-only mask (keep 0.05 or 0.02,
1/keep rescale), the activations through a lossy codec (top-k, random low-rank, int4, a rescaled
mask), each at a PP byte budget of at most 1/10 of the bf16 boundary's where the codec allows, all
with the masked rows' DP compression and compared with the dense + DP row. A lossy forward codec
also codes evaluation messages, so the run's own validation loss is the coded pipeline's; the
"val, no codec" column is the replicas' mean weights merged into the unsplit model, the adapted
weights' own loss (the mask rows' dense evaluation is this too).

Per row: the dense validation loss before and after (masking off, as the codec does at
evaluation), the *masked* validation loss after (the final weights with the run's own mask applied
at every boundary as a forward hook, as in training: the note's open detail 7), the training loss
of the first and the last step, and the ratio to the matching dense row.

    flock /tmp/meshlearn-bench.lock env PYTHONPATH=src OMP_NUM_THREADS=1 python bench/adaptation_sweep.py \\
        [--steps 60] [--reuse] [--only NAME ...] [--results adaptation_sweep]

Reuses bench/out/adaptation/pretrain (run ``bench/adaptation.py`` first, or it is trained here);
runs live in bench/out/adaptation_sweep/; results go to docs/results/adaptation_sweep.{json,md}
(``--results``: another name, for a subset of rows such as the PP-compression screen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from adaptation import OUT as PRETRAIN_OUT
from adaptation import run
from common import DEMO, ROOT, dumps, markdown_table, write_results

from meshlearn.compress.codecs import MessageContext
from meshlearn.compress.registry import BackwardCodecConfig, build_codec
from meshlearn.config import RunConfig, load_config
from meshlearn.mesh.topology import WorkerId
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.models.split import merge_stages, stage_layer_ranges
from meshlearn.train import Trainer
from meshlearn.train.restore import load_run_model, load_run_state

OUT = ROOT / "bench" / "out" / "adaptation_sweep"
DP = ["dp.name=diloco", "dp.compress=powersgd", "dp.rank=4", "dp.inner_steps=10"]
M95 = ["codec.name=mask", "codec.keep=0.05", *DP]
ANCHOR = ["optim.spectral.enabled=true", "anchor.z=1", "anchor.delay=5", "anchor.max_late=5"]
EF = ["anchor.send=gradients", "anchor.weights=snapshot", "anchor.use=error_feedback"]
BACK_M95 = ["codec.backward.name=mask", "codec.backward.keep=0.05"]  # rescaled: unbiased
BACK_M98 = ["codec.backward.name=mask", "codec.backward.keep=0.02"]


def rows() -> dict[str, tuple[str, list[str]]]:
    """Row name → (its dense reference row, overrides on top of the base run)."""
    p2, lr4, lr5 = ["mesh.stages=2"], ["train.lr=1e-4"], ["train.lr=2e-5"]
    return {
        "dense": ("dense", ["codec.name=bf16"]),
        "M95": ("dense", M95),
        "M95, no DP compression": ("dense", ["codec.name=mask", "codec.keep=0.05"]),
        "M95 rescale": ("dense", [*M95, "codec.rescale=true"]),
        "M95 bernoulli": ("dense", [*M95, "codec.mask=bernoulli"]),
        "M90": ("dense", [*M95, "codec.keep=0.1"]),
        "M95 + anchor (α 0.3, τ 1e-3 abs, K 5)": ("dense", [*M95, *ANCHOR]),
        "M95 + anchor τ 0.1 rel": ("dense", [*M95, *ANCHOR, "optim.spectral.tau=0.1",
                                             "optim.spectral.tau_mode=relative"]),
        "M95 + anchor α 0, τ 0.1 rel, K 2": ("dense", [*M95, *ANCHOR, "optim.spectral.alpha=0",
                                                       "optim.spectral.tau=0.1",
                                                       "optim.spectral.tau_mode=relative",
                                                       "anchor.delay=2", "anchor.max_late=2"]),
        "dense P=2": ("dense P=2", ["codec.name=bf16", *p2]),
        "M95 P=2": ("dense P=2", [*M95, *p2]),
        "M95 P=2 + anchor": ("dense P=2", [*M95, *p2, *ANCHOR]),
        "dense lr 1e-4": ("dense lr 1e-4", ["codec.name=bf16", *lr4]),
        "M95 lr 1e-4": ("dense lr 1e-4", [*M95, *lr4]),
        "dense lr 2e-5": ("dense lr 2e-5", ["codec.name=bf16", *lr5]),
        "M95 lr 2e-5": ("dense lr 2e-5", [*M95, *lr5]),
        # The PP-compression screen (d = 128, 3 boundaries: bf16 is 512 B per boundary and token
        # both ways; 1/10 of it is 51.2 B). Bytes per boundary and token, forward + backward:
        "dense + DP": ("dense", ["codec.name=bf16", *DP]),
        "bwd M95 + fwd bf16": ("dense + DP", ["codec.name=bf16", *BACK_M95, *DP]),  # 256 + 12
        "bwd M95 + fwd top-9": ("dense + DP", ["codec.name=topk", "codec.topk=9", *BACK_M95, *DP]),  # 36 + 12
        "bwd M95 + fwd lowrank-19": ("dense + DP", ["codec.name=lowrank", "codec.lowrank=19", *BACK_M95,
                                                   *DP]),  # 38 + 12
        "bwd M95 + fwd int4": ("dense + DP", ["codec.name=int4", *BACK_M95, *DP]),  # 68 + 12: 6.4x
        "bwd M98 + fwd top-11": ("dense + DP", ["codec.name=topk", "codec.topk=11", *BACK_M98,
                                                *DP]),  # 44 + 6
        "bwd M95 + fwd M85 rescale": ("dense + DP", [*M95, "codec.keep=0.15", "codec.rescale=true",
                                                    *BACK_M95]),  # 38 + 12
        # Issue 29, 4(b): the rescaled forward mask with the anchor's clean gradient as a delayed
        # error feedback (fp32 copies of the targeted matrices kept per handed-off step).
        "M95 rescale + anchor EF": ("dense + DP", [*M95, "codec.rescale=true", *ANCHOR, *EF]),
    }


@torch.no_grad()
def masked_val_loss(model: Decoder, cfg: RunConfig, val_batches: list) -> float:
    """``model``'s validation loss with the mask of ``cfg`` (a mask-codec run) at every boundary (a
    forward hook multiplying each boundary layer's output by m, and by the codec's rescale factor):
    the loss on the distribution the fast circuit trained on (the activations' codec: a
    ``codec.backward`` of its own codes gradients only)."""
    codec = build_codec(dataclasses.replace(cfg.codec, backward=BackwardCodecConfig()), cfg.model)
    ends = [r[-1] for r in stage_layer_ranges(cfg.model.n_layer, cfg.mesh.stages)[:-1]]
    batch = [0]

    def hook_for(boundary: int):
        def hook(_module, _args, out):
            ctx = MessageContext(batch[0], 0, boundary, 0)
            return out * codec.mask(tuple(out.shape), ctx).to(out.dtype) * codec.scale
        return hook

    handles = [model.layers[str(layer)].register_forward_hook(hook_for(b)) for b, layer in enumerate(ends)]
    losses = []
    for i, (x, y) in enumerate(val_batches):
        batch[0] = i
        losses.append(Decoder.loss(model(x), y).item())
    for handle in handles:
        handle.remove()
    return sum(losses) / len(losses)


@torch.no_grad()
def unsplit_val_loss(model: DecoderConfig, replicas: list[list[dict]], val_batches: list) -> float:
    """The validation loss of the replicas' mean weights (``replicas[r][s]``: replica r's stage s
    state dict; float tensors summed in replica order, then divided, as ``average_modules``) merged
    into the unsplit model: no codec at any boundary. A lossy forward codec (top-k, low-rank, int4)
    codes evaluation messages too, so a run's own val_loss is the coded pipeline's; this is the
    adapted weights' own loss, comparable across codecs."""
    def mean(s: int) -> dict:
        first = replicas[0][s]
        return {k: (torch.stack([r[s][k] for r in replicas]).sum(0) / len(replicas)
                    if v.is_floating_point() else v) for k, v in first.items()}

    merged = merge_stages(model, [mean(s) for s in range(len(replicas[0]))]).eval()
    losses = [Decoder.loss(merged(x), y).item() for x, y in val_batches]
    return sum(losses) / len(losses)


def run_replicas(run_dir: Path, cfg: RunConfig) -> list[list[dict]]:
    """Every replica's stage state dicts from a finished run's checkpoint."""
    workers = load_run_state(run_dir)["workers"]
    return [[workers[str(WorkerId(r, s))]["module"] for s in range(cfg.mesh.stages)]
            for r in range(cfg.mesh.replicas)]


def bf16_factor(cfg: RunConfig, bytes_pp: float) -> float:
    """How many times fewer PP bytes per token than bf16 boundaries (2 bytes × d, both ways, at
    each of the P − 1 boundaries)."""
    return 4 * cfg.model.d_model * (cfg.mesh.stages - 1) / bytes_pp


def train_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if r["kind"] == "train"]


COLUMNS = [("row", "row", ""), ("val_start", "dense val before", ".4f"),
           ("val_end", "dense val after", ".4f"), ("vs_dense", "÷ its dense − 1", "+.1%"),
           ("reference", "its dense", ""), ("unsplit_val", "val, no codec", ".4f"),
           ("vs_dense_unsplit", "no codec ÷ its dense's − 1", "+.1%"),
           ("masked_val", "masked val after", ""), ("bytes_pp", "PP B/token", ".1f"),
           ("factor", "÷ bf16 PP bytes", ".2f"), ("train_first", "train loss, step 0", ".3f"),
           ("train_last", "train loss, last step", ".3f"), ("wall_s", "wall (s)", ".0f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reuse", action="store_true",
                        help="keep finished runs in bench/out/adaptation_sweep")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run (their dense rows too)")
    parser.add_argument("--results", default="adaptation_sweep", help="name under docs/results/")
    args = parser.parse_args()
    started = time.perf_counter()
    pretrain_dir = PRETRAIN_OUT / "pretrain"
    pre_cfg = load_config(DEMO, ["mesh.replicas=1", "mesh.schedule=1f1b", "codec.name=bf16",
                                 "train.steps=150", "train.checkpoint_every=0", "train.eval_every=150"])
    run(pre_cfg, pretrain_dir, reuse=True)
    base = [f"model.init={pretrain_dir}", "mesh.stages=4", "mesh.replicas=2", "mesh.schedule=async",
            f"train.steps={args.steps}", f"train.eval_every={args.steps}", "train.checkpoint_every=0",
            "train.lr=1e-3", "train.warmup_steps=5"]
    table = rows()
    wanted = list(table) if args.only is None else set(args.only)
    while any(table[n][0] not in wanted for n in wanted):  # references, and theirs
        wanted |= {table[n][0] for n in wanted}
    wanted = sorted(wanted, key=list(table).index)
    OUT.mkdir(parents=True, exist_ok=True)
    val_batches = Trainer(load_config(DEMO, base), OUT / "_val", progress=False).val_batches
    results: dict[str, dict] = {}
    for name in wanted:
        reference, sets = table[name]
        cfg = load_config(DEMO, [*base, *sets])
        run_dir = OUT / "".join(c if c.isalnum() else "_" for c in name)
        result = run(cfg, run_dir, args.reuse)
        losses = train_losses(run_dir)
        masked = (masked_val_loss(load_run_model(run_dir)[0], cfg, val_batches)
                  if cfg.codec.name == "mask" else None)
        unsplit = unsplit_val_loss(cfg.model, run_replicas(run_dir, cfg), val_batches)
        bytes_pp = result["summary"]["bytes_per_token_pp"]
        results[name] = {"row": name, "reference": reference, "overrides": sets,
                         "val_start": result["val_start"], "val_end": result["val_end"],
                         "unsplit_val": unsplit, "bytes_pp": bytes_pp, "factor": bf16_factor(cfg, bytes_pp),
                         "masked_val": "—" if masked is None else f"{masked:.4f}",
                         "train_first": losses[0], "train_last": losses[-1], "wall_s": result["wall_s"]}
        print(f"{name}: dense val {result['val_start']:.4f} → {result['val_end']:.4f}, masked val "
              f"{results[name]['masked_val']}, train {losses[0]:.3f} → {losses[-1]:.3f}", flush=True)
    for row in results.values():
        row["vs_dense"] = row["val_end"] / results[row["reference"]]["val_end"] - 1
        row["vs_dense_unsplit"] = row["unsplit_val"] / results[row["reference"]]["unsplit_val"] - 1
    wall = time.perf_counter() - started
    command = "python bench/adaptation_sweep.py" + (f" --steps {args.steps}" if args.steps != 60 else "") + (
        " --reuse" if args.reuse else "") + (
        "" if args.only is None else " --only " + " ".join(repr(n) for n in args.only)) + (
        "" if args.results == "adaptation_sweep" else f" --results {args.results}")
    markdown = "\n".join([
        "# Mesh adaptation at small scale: one lever at a time",
        "",
        f"`{command}`; {wall / 60:.1f} min on 2 shared CPU cores"
        + (" (finished runs reused; each row's own training wall in the last column)" if args.reuse else "")
        + ". Demo model (4 layers, d = 128, byte "
        f"tokens) pretrained densely for 150 steps (val 1.9753), then adapted for {args.steps} steps: "
        "P = 4, D = 2, async, AdamW lr 1e-3 (5 warm-up steps, cosine), batch 32 × 128, "
        "mask rows with streaming-DiLoCo + PowerSGD rank 4 on the DP axis unless the row says "
        "otherwise; anchor rows Z = 1, K = 5, α = 0.3, τ = 1e-3 absolute, β_anc = 0.95 unless the row "
        "says otherwise. \"÷ its dense\" compares with the dense row at the same P and lr. "
        "\"masked val\": the final weights evaluated with the run's mask at every boundary. "
        "\"val, no codec\": the replicas' mean weights merged, no codec at any boundary (a lossy "
        "forward codec also codes the run's own evaluation). \"÷ bf16 PP bytes\": bf16 boundaries' "
        "PP bytes per token over the row's.",
        "",
        markdown_table(list(results.values()), COLUMNS),
    ])
    write_results(args.results, {"args": vars(args), "rows": list(results.values()), "wall_s": wall},
                  markdown)
    print(dumps({"wall_s": wall}))


if __name__ == "__main__":
    main()
