"""Unextractable protocol models on the demo model: the attacks, the cost of morphing, fine-tuning.

1. Three demo runs (P = 4, D = 2, Muon, 150 steps) side by side, each in its own process (peak
   RSS): the plain decoder (``protocol.morph = off``), the protocol model never morphed (``none``)
   and orthogonal morphs every 10 steps, keeping the snapshots of the last two morphs.
2. ``meshlearn attack stitch|bridge|covariance`` on the morphing run, for two snapshot pairs:
   the last morph's before/after (one training state in two bases) and one morph plus 10 steps
   of training apart. The covariance attack again with more passive traffic (computed from the
   snapshots' stages on more fresh training windows).
3. Fine-tuning the stitched model (alternating stages of the two newest snapshots) until it
   reaches the real model's validation loss, against the same loop from the run's random init.
4. (``--smollm``) SmolLM2-135M, eval only: the pretrained model as a protocol model in P stages,
   morphed twice; real vs stitched (alternating and every single-cut mix) vs random init on the
   validation split of Hamlet, in nats/token, plus the bridge and covariance attacks.

    python bench/unextractable.py --runs DIR      # about 50 minutes from nothing on 2 busy cores
    python bench/unextractable.py --smollm        # + SmolLM2-135M
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import DEMO, ROOT, demo_config, finished_run, markdown_table, write_results

from meshlearn.assemble import resolve
from meshlearn.attack_run import attack_run, attack_snapshots, random_init_loss, unigram_loss
from meshlearn.compressibility.evaluate import validation_loss
from meshlearn.config import load_config
from meshlearn.data import global_batch, validation_batches
from meshlearn.data.corpus import load_corpus
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.split import init_model, split_model
from meshlearn.optim import build_optimizer
from meshlearn.optim.schedule_lr import lr_factor
from meshlearn.protocol.model import ProtocolDecoder, protocol_model
from meshlearn.protocol.morph import StageMorph, morph_mesh
from meshlearn.protocol.snapshots import (
    SNAPSHOT_DIR,
    Snapshot,
    boundary_traffic,
    list_snapshots,
    load_snapshot,
    take_snapshot,
    traffic_windows,
)

ATTACKS = ("stitch", "bridge", "covariance")
RSS_WRAPPER = """import resource, runpy, sys
sys.argv = ["meshlearn", *sys.argv[2:]]
try:
    runpy.run_module("meshlearn", run_name="__main__")
finally:
    open(sys.argv_rss, "w").write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
""".replace("sys.argv_rss", "__import__('os').environ['RSS_OUT']")


def demo_overrides(steps: int, every: int) -> list[str]:
    return ["optim.name=muon", f"train.steps={steps}", f"protocol.every_steps={every}",
            "protocol.keep_snapshots=2"]


def train_run(out: Path, overrides: list[str], measured: bool = True) -> dict:
    """One demo run in its own process; its summary plus the process's peak RSS (a run this
    script already finished in ``out`` with the same config is reused; with ``measured``, only
    if it was run by this script, which measured its RSS)."""
    rss = out.with_suffix(".rss")
    done = finished_run(out, demo_config(*overrides))
    if done is not None and not measured:
        return done
    if done is not None and rss.is_file() and out.with_suffix(".wall").is_file():
        return done | {"peak_rss_mb": int(rss.read_text()) / 1024,
                       "process_wall_s": float(out.with_suffix(".wall").read_text())}
    sets = [x for o in overrides for x in ("--set", o)]
    cmd = [sys.executable, "-c", RSS_WRAPPER, "-", "train", "--config", str(DEMO), *sets,
           "--out", str(out), "--overwrite"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**__import__("os").environ, "RSS_OUT": str(rss)})
    summary = json.loads((out / "summary.json").read_text())
    summary["process_wall_s"] = time.perf_counter() - started
    out.with_suffix(".wall").write_text(str(summary["process_wall_s"]))
    summary["peak_rss_mb"] = int(rss.read_text()) / 1024
    return summary


def overhead_rows(summaries: dict[str, dict]) -> list[dict]:
    rows = []
    for name, s in summaries.items():
        morphs = s.get("protocol_morphs", 0)
        rows.append({
            "run": name, "val_loss": s["final_val_loss"], "wall_s": s["wall_time_s"],
            "sim_time_s": s["sim_time_s"], "bytes_pp_mb": s["bytes_per_token_pp"] * s["tokens"] / 1e6,
            "morphs": morphs,
            "morph_wall_ms": 1e3 * s["protocol_morph_wall_s"] / morphs if morphs else 0.0,
            "morph_bytes_kb": s.get("protocol_morph_bytes", 0) / morphs / 1e3 if morphs else 0.0,
            "master_mb": s.get("protocol_master_bytes_peak", 0) / 1e6,
            "snapshot_mb": s.get("protocol_snapshot_bytes", 0) / 1e6,
            "snapshot_wall_s": s.get("protocol_snapshot_wall_s", 0.0),
            "peak_rss_mb": s["peak_rss_mb"],
        })
    return rows


def attack_rows(run_dir: Path, pairs: dict[str, str], out: Path) -> tuple[list[dict], dict]:
    rows, raw = [], {}
    for label, pair in pairs.items():
        for attack in ATTACKS:
            done = out / label / f"{attack}.json"  # this script's own result of an earlier call
            r = json.loads(done.read_text()) if done.is_file() else attack_run(
                run_dir, attack, pair, out_dir=out / label)
            raw[f"{label}/{attack}"] = r
            rows.append({"pair": label, "snapshots": " + ".join(r["snapshots"]), "attack": attack,
                         "real": r["real_val_loss"], "random_init": r["random_init_val_loss"],
                         "unigram": r["unigram_val_loss"], "stitched_best": r["best_mix_val_loss"],
                         "best_mix": " ".join(r["best_assignment"]), "alternating": r["stitched_val_loss"],
                         "recovered": r["recovered_fraction"]})
    return rows, raw


def more_traffic(snap: Snapshot, tokens, n_tokens: int, seq_len: int, seed: int) -> Snapshot:
    """``snap`` with its passive sample replaced by ``n_tokens`` tokens on fresh windows."""
    windows = traffic_windows(tokens, n_tokens, seq_len, seed, "bench-traffic", snap.epoch, snap.step)
    return dataclasses.replace(snap, passive=boundary_traffic(snap.modules(), windows))


def covariance_vs_traffic(run_dir: Path, counts: list[int]) -> list[dict]:
    cfg = load_config(run_dir / "config.toml")
    corpus = load_corpus(cfg, run_dir)
    val = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size,
                             cfg.model.seq_len)
    files = list_snapshots(run_dir / SNAPSHOT_DIR)
    a, b = load_snapshot(files[-2][2]), load_snapshot(files[-1][2])
    rows = []
    for n in counts:
        pair = tuple(more_traffic(s, corpus.splits.train, n, cfg.model.seq_len, cfg.seed) for s in (a, b))
        r = attack_snapshots("covariance", pair, val, alternating_only=True)
        rows.append({"passive_tokens": n, "alternating": r["stitched_val_loss"],
                     "aligned": sum(x["aligned_fraction"] for x in r["bridges"]) / len(r["bridges"]),
                     "variance_aligned": sum(x["variance_aligned"] for x in r["bridges"]) / len(r["bridges"]),
                     "probe_rel_error": sum(x["probe_rel_error"] for x in r["bridges"]) / len(r["bridges"])})
        print(f"covariance, {n} passive tokens: {rows[-1]}", flush=True)
    return rows


def finetune(model: torch.nn.Module, cfg, tokens, val, target: float, steps: int,
             eval_every: int) -> dict:
    """The run's own recipe (optimizer, lr schedule, batches, clipping) in one process, from
    ``model``; the val curve and the first step reaching ``target`` (linear between evals)."""
    optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, steps)
    curve = [(0, validation_loss(model, val))]
    for t in range(steps):
        model.train()
        x, y = global_batch(tokens, t, cfg.train.batch_size, cfg.model.seq_len, cfg.seed)
        ProtocolDecoder.loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=False)
        factor = lr_factor(t, cfg.train.warmup_steps, steps, cfg.train.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (t + 1) % eval_every == 0:
            curve.append((t + 1, validation_loss(model, val)))
    reached = None
    target += 1e-6 * abs(target)  # the from-scratch loop is the run's own trajectory, to rounding
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if v0 <= target:
            reached = s0
            break
        if v1 <= target:
            reached = s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
            break
    return {"curve": curve, "steps_to_target": reached}


def finetune_fraction(run_dir: Path, steps: int, eval_every: int) -> dict:
    cfg = load_config(run_dir / "config.toml")
    corpus = load_corpus(cfg, run_dir)
    val = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size,
                             cfg.model.seq_len)
    files = list_snapshots(run_dir / SNAPSHOT_DIR)
    a, b = load_snapshot(files[-2][2]), load_snapshot(files[-1][2])
    target = attack_snapshots("stitch", (a, b), val, alternating_only=True)["real_val_loss"]
    merged = {}
    for s in range(len(a.stages)):  # alternating: a, b, a, b
        merged.update((b if s % 2 else a).stages[s])
    stitched = ProtocolDecoder(a.model)
    stitched.load_state_dict(merged)
    scratch = protocol_model(init_model(dataclasses.replace(a.model, init=""), cfg.seed), cfg.seed)
    out = {"target_val_loss": target, "steps": steps}
    for name, model in (("stitched", stitched), ("scratch", scratch)):
        torch.manual_seed(0)
        out[name] = finetune(model, cfg, corpus.splits.train, val, target, steps, eval_every)
        print(f"fine-tune {name}: {out[name]['curve'][-1]}, reached at {out[name]['steps_to_target']}",
              flush=True)
    s, f = out["scratch"]["steps_to_target"], out["stitched"]["steps_to_target"]
    out["fraction"] = (f / s) if (s and f is not None) else None
    return out


def smollm(stages: int, n_windows: int, seq_len: int, passive_tokens: int) -> dict:
    """SmolLM2-135M as a protocol model in ``stages`` stages, morphed twice (epochs 1, 2): the
    attacks on Hamlet's validation split, eval only."""
    started = time.perf_counter()
    play = next(Path(__import__("meshlearn.data", fromlist=["shakespeare_dir"]).shakespeare_dir())
                .rglob("hamlet.md"))
    cfg = load_config(None, ["model.init=smollm2-135m", f"data.corpus={play}", f"model.seq_len={seq_len}",
                             f"mesh.stages={stages}", "mesh.replicas=1", "mesh.microbatches=1",
                             "train.batch_size=1", "model.tie_embeddings=false"])
    corpus = load_corpus(cfg, None)
    cfg = resolve(cfg, corpus.vocab_size)
    val_tokens = corpus.splits.val
    step = (len(val_tokens) - seq_len - 1) // n_windows
    rows = torch.as_tensor(val_tokens[[i * step + j for i in range(n_windows) for j in range(seq_len + 1)]]
                           .reshape(n_windows, seq_len + 1), dtype=torch.long)
    val = [(rows[i:i + 1, :-1], rows[i:i + 1, 1:]) for i in range(n_windows)]
    plain = init_model(cfg.model, cfg.seed)
    modules = {WorkerId(0, s): protocol_model(m, cfg.seed).eval()
               for s, m in enumerate(split_model(plain, stages))}
    del plain
    morphs = {w: StageMorph(m, None, torch.float32) for w, m in modules.items()}  # eval only: no drift
    mesh, ordered = MeshShape(1, stages), [modules[WorkerId(0, s)] for s in range(stages)]
    probe = traffic_windows(corpus.splits.train, passive_tokens, seq_len, cfg.seed, "probe")
    snaps = []
    for epoch in (1, 2):
        morph_mesh(morphs, mesh, "orthogonal", 0.01, cfg.seed, epoch - 1)
        passive = traffic_windows(corpus.splits.train, passive_tokens, seq_len, cfg.seed, "traffic", epoch)
        snaps.append(take_snapshot(ordered, epoch, 0, passive, probe))
    del morphs, modules, ordered
    results = {}
    for attack in ATTACKS:
        r = attack_snapshots(attack, tuple(snaps), val, alternating_only=True)
        if attack == "stitch":  # the attacker's easiest mixes too: a single boundary crossing epochs
            cuts = [tuple(int(s >= c) for s in range(stages)) for c in range(1, stages)]
            r["single_cut"] = [{"cut_after_stage": c - 1, "val_loss": validation_loss(
                _assemble(snaps, mix), val)} for c, mix in zip(range(1, stages), cuts, strict=True)]
        results[attack] = {k: v for k, v in r.items() if k != "assignments"}
        print(f"smollm {attack}: stitched {r['stitched_val_loss']:.3f}", flush=True)
    return {"stages": stages, "windows": n_windows, "seq_len": seq_len, "passive_tokens": passive_tokens,
            "real_val_loss": results["stitch"]["real_val_loss"],
            "random_init_val_loss": random_init_loss(snaps[0], cfg.seed, val),
            "unigram_val_loss": unigram_loss(corpus.splits.train, cfg.model.vocab_size, val),
            "uniform": math.log(cfg.model.vocab_size),
            "attacks": results, "wall_s": time.perf_counter() - started}


def _assemble(snaps: list[Snapshot], mix: tuple[int, ...]) -> torch.nn.Module:
    from meshlearn.protocol.attacks import Bridged

    return Bridged([snaps[a].modules()[s] for s, a in enumerate(mix)], [])


def cached(path: Path, compute):
    """A phase's result: computed once per runs folder (so a later failure costs no rerun)."""
    if path.is_file():
        return json.loads(path.read_text())
    result = compute()
    path.write_text(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--overhead-steps", type=int, default=50,
                        help="steps of the three side-by-side runs that measure the cost")
    parser.add_argument("--traffic", default="2048,8192,32768",
                        help="passive tokens per boundary for the covariance attack")
    parser.add_argument("--finetune-steps", type=int, default=150)
    parser.add_argument("--finetune-eval", type=int, default=10)
    parser.add_argument("--smollm", action="store_true", help="also SmolLM2-135M (eval only)")
    parser.add_argument("--smollm-only", action="store_true",
                        help="only SmolLM2-135M, written to docs/results/unextractable_smollm.*")
    parser.add_argument("--smollm-stages", type=int, default=5)
    parser.add_argument("--smollm-windows", type=int, default=4)
    parser.add_argument("--smollm-passive", type=int, default=4096)
    parser.add_argument("--runs", help="folder for the three runs (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.smollm_only:
        payload = {"smollm": smollm(args.smollm_stages, args.smollm_windows, 256, args.smollm_passive)}
        write_results("unextractable_smollm", payload, render_smollm(payload["smollm"]))
        return
    base = Path(args.runs) if args.runs else Path(tempfile.mkdtemp(prefix="meshlearn-unextract-"))
    base.mkdir(parents=True, exist_ok=True)
    common = demo_overrides(args.overhead_steps, args.every)
    summaries = {name: train_run(base / f"overhead-{name}", [*common, f"protocol.morph={name}"])
                 for name in ("off", "none", "orthogonal")}
    morph_dir = base / "attack-run"
    attacked = train_run(morph_dir, [*demo_overrides(args.steps, args.every), "protocol.morph=orthogonal"],
                         measured=False)
    files = list_snapshots(morph_dir / SNAPSHOT_DIR)
    names = [f"{e}@{s}" for e, s, _ in files]
    pairs = {"same step": f"{names[-2]},{names[-1]}", "1 morph + drift": f"{names[1]},{names[-1]}"}
    attacks, raw = attack_rows(morph_dir, pairs, base / "attack")
    covariance = cached(base / "covariance.json", lambda: covariance_vs_traffic(
        morph_dir, [int(n) for n in args.traffic.split(",")]))
    tuned = cached(base / "finetune.json", lambda: finetune_fraction(
        morph_dir, args.finetune_steps, args.finetune_eval))
    payload = {"steps": args.steps, "every": args.every, "overhead_steps": args.overhead_steps,
               "attack_run": {k: attacked[k] for k in ("final_val_loss", "steps", "protocol_morphs",
                                                       "protocol_snapshot_bytes", "wall_time_s")},
               "overhead": overhead_rows(summaries),
               "attacks": attacks, "attack_results": raw, "covariance_vs_traffic": covariance,
               "finetune": tuned, "snapshots": names}
    if args.smollm:
        payload["smollm"] = smollm(args.smollm_stages, args.smollm_windows, 256, args.smollm_passive)
    write_results("unextractable", payload, render(payload))


def render(p: dict) -> str:
    parts = [f"# Unextractable protocol models: demo model, {p['steps']} steps, a morph every "
             f"{p['every']}\n",
             f"## Cost of morphing (three {p['overhead_steps']}-step runs side by side)\n",
             markdown_table(p["overhead"], [
                 ("run", "protocol.morph", ""), ("val_loss", "val loss", ".4f"),
                 ("wall_s", "wall s", ".1f"), ("sim_time_s", "virtual s", ".2f"),
                 ("bytes_pp_mb", "pp MB", ".2f"), ("morphs", "morphs", "d"),
                 ("morph_wall_ms", "ms / morph", ".1f"), ("morph_bytes_kb", "kB / morph", ".1f"),
                 ("master_mb", "fp64 master MB / worker", ".2f"), ("snapshot_mb", "snapshots MB", ".1f"),
                 ("snapshot_wall_s", "snapshot s", ".1f"), ("peak_rss_mb", "peak RSS MB", ".0f")]),
             "\n## Attacks (nats/token on the run's validation batches)\n",
             markdown_table(p["attacks"], [
                 ("pair", "pair", ""), ("snapshots", "snapshots", ""), ("attack", "attack", ""),
                 ("real", "real", ".4f"), ("random_init", "random init", ".4f"),
                 ("unigram", "token counts", ".4f"), ("alternating", "alternating a b a b", ".4f"),
                 ("stitched_best", "best of 14 mixes", ".4f"), ("best_mix", "best mix", ""),
                 ("recovered", "recovered", ".3f")]),
             "\n## Covariance attack vs passive traffic (same-step pair, alternating)\n",
             markdown_table(p["covariance_vs_traffic"], [
                 ("passive_tokens", "passive tokens / boundary", "d"), ("alternating", "val loss", ".4f"),
                 ("aligned", "directions aligned (cos > 0.9)", ".3f"),
                 ("variance_aligned", "variance-weighted cos", ".3f"),
                 ("probe_rel_error", "probe rel. error", ".3f")])]
    f = p["finetune"]
    parts.append(f"\n## Fine-tuning the stitched model\n\ntarget (real model) {f['target_val_loss']:.4f}; "
                 f"steps to reach it: stitched {f['stitched']['steps_to_target']}, from random init "
                 f"{f['scratch']['steps_to_target']} (of {f['steps']}); fraction {f['fraction']}\n")
    if "smollm" in p:
        parts.append(render_smollm(p["smollm"]))
    return "\n".join(parts)


def render_smollm(s: dict) -> str:
    rows = [{"model": k, "val_loss": v} for k, v in (
            ("real (protocol model, epoch 2)", s["real_val_loss"]),
            ("random init", s["random_init_val_loss"]), ("token counts", s["unigram_val_loss"]),
            ("uniform", s["uniform"]),
            *((f"{a}, alternating", s["attacks"][a]["stitched_val_loss"]) for a in ATTACKS),
            *((f"stitch, single cut after stage {c['cut_after_stage']}", c["val_loss"])
              for c in s["attacks"]["stitch"]["single_cut"]))]
    return "\n".join([f"\n## SmolLM2-135M, {s['stages']} stages, {s['windows']} × {s['seq_len']} tokens "
                      f"of Hamlet validation, {s['passive_tokens']} traffic tokens\n",
                      markdown_table(rows, [("model", "model", ""), ("val_loss", "nats/token", ".4f")])])


if __name__ == "__main__":
    main()
