"""``meshlearn attack stitch|bridge|covariance RUN``: what an attacker assembles from the stage
snapshots a morphing run kept (``protocol/snapshots.py``), scored on the run's validation batches
against the real model and the run's own random initialization.

The attacker holds two snapshots, a (older) and b (newer), and takes each stage from one of them.
``stitched_val_loss`` is the alternating assembly a, b, a, ...: every stage comes from a different
epoch than its neighbours, so every pipeline boundary crosses epochs (the paper's stitching).
Every other mix but the two whole ones is tried too (unless ``alternating_only``), and the best
of all is reported beside it (``best_mix_val_loss``): a mix keeps some neighbours from one epoch,
so part of the model works as trained.
Where a boundary crosses epochs, ``bridge`` and ``covariance`` insert their estimate of the basis
change there (``protocol/attacks.py``); ``stitch`` inserts nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from meshlearn.atomic import atomic_write_json
from meshlearn.compressibility.evaluate import validation_loss
from meshlearn.config import load_config
from meshlearn.data import validation_batches
from meshlearn.data.batches import Batch
from meshlearn.errors import ConfigError
from meshlearn.models.split import init_model
from meshlearn.protocol.attacks import (
    ATTACKS,
    Bridged,
    covariance_alignment,
    least_squares,
    mixed_assignments,
    procrustes,
    relative_error,
)
from meshlearn.protocol.snapshots import SNAPSHOT_DIR, Snapshot, list_snapshots, load_snapshot

OUT_DIR = "attack"
RECOVERED_MARGIN = 0.05  # nats/token below random init: the bar for "no better than random"


def fit_bridge(attack: str, a: Snapshot, b: Snapshot, boundary: int) -> dict:
    """The attack's estimate of the basis change from ``a`` to ``b`` at one pipeline boundary, with
    how well it maps a's probe traffic onto b's (``probe_rel_error``, 0 = exact; for the covariance
    attack an evaluation the attacker cannot make, since it never sees identical inputs)."""
    pa, pb = a.probe[boundary], b.probe[boundary]
    if attack == "bridge":
        half = len(pa) // 2  # fit on one half, choose on the other: no knowledge of the morph kind
        fits = {"procrustes": procrustes(pa[:half], pb[:half]),
                "least_squares": least_squares(pa[:half], pb[:half])}
        held_out = {k: relative_error(pa[half:], pb[half:], t) for k, t in fits.items()}
        method = min(held_out, key=held_out.get)
        t = procrustes(pa, pb) if method == "procrustes" else least_squares(pa, pb)
        return {"T": t, "method": method, "held_out_rel_error": held_out,
                "probe_rel_error": relative_error(pa, pb, t)}
    t = covariance_alignment(a.passive[boundary], b.passive[boundary])
    best = procrustes(pa, pb)  # the best orthogonal bridge, to score the estimate against
    # Per eigendirection u_i of a's traffic: the cosine between where the estimate and where the
    # best bridge send it (u_iᵀ·T̂ vs u_iᵀ·T*), and those cosines weighted by the variance along u_i.
    x = a.passive[boundary].double()
    values, vectors = torch.linalg.eigh(torch.cov(x.T))
    cosines = torch.diagonal(vectors.T @ t @ best.T @ vectors)
    return {"T": t, "method": "eigenbasis matching with sign fixing",
            "passive_tokens": [len(a.passive[boundary]), len(b.passive[boundary])],
            "probe_rel_error": relative_error(pa, pb, t),
            "procrustes_probe_rel_error": relative_error(pa, pb, best),
            "aligned_fraction": float((cosines > 0.9).double().mean()),
            "variance_aligned": float((values.clamp_min(0) * cosines).sum() / values.clamp_min(0).sum())}


def attack_snapshots(attack: str, snaps: tuple[Snapshot, Snapshot], val: list[Batch],
                     alternating_only: bool = False) -> dict:
    """Every mixed assignment of stages from ``snaps`` (with the attack's bridges) scored on ``val``;
    also the two real models. No files touched."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; allowed: {', '.join(ATTACKS)}")
    modules = [s.modules() for s in snaps]
    stages = len(modules[0])
    fits: dict[tuple[int, int, int], dict] = {}
    results = []
    for assignment in mixed_assignments(stages, alternating_only):
        bridges = []
        for boundary in range(stages - 1):
            src, dst = assignment[boundary], assignment[boundary + 1]
            if attack == "stitch" or src == dst:
                bridges.append(None)
                continue
            key = (boundary, src, dst)
            if key not in fits:
                fits[key] = fit_bridge(attack, snaps[src], snaps[dst], boundary)
            bridges.append(fits[key]["T"])
        model = Bridged([modules[a][s] for s, a in enumerate(assignment)], bridges)
        results.append({"stages_from": [snaps[a].name for a in assignment],
                        "val_loss": validation_loss(model, val)})
    best = min(results, key=lambda r: r["val_loss"])
    alternating = [snaps[s % 2].name for s in range(stages)]
    return {
        "attack": attack,
        "snapshots": [s.name for s in snaps],
        "stitched_val_loss": next(r["val_loss"] for r in results if r["stages_from"] == alternating),
        "best_mix_val_loss": best["val_loss"],
        "best_assignment": best["stages_from"],
        "assignments": results,
        "real_val_loss": validation_loss(Bridged(modules[1], []), val),
        "real_val_loss_older": validation_loss(Bridged(modules[0], []), val),
        "bridges": [{"boundary": b, "from": snaps[src].name, "to": snaps[dst].name,
                     **{k: v for k, v in fit.items() if k != "T"}}
                    for (b, src, dst), fit in sorted(fits.items())],
    }


def random_init_loss(snap: Snapshot, seed: int, val: list[Batch]) -> float:
    """The run's own starting point (plain decoder at the run seed; the protocol model computes the
    same function at init), never pretrained weights."""
    return validation_loss(init_model(dataclasses.replace(snap.model, init=""), seed), val)


def unigram_loss(train_tokens, vocab_size: int, val: list[Batch]) -> float:
    """Cross-entropy of the training split's token frequencies (add-one smoothed) on ``val``: what
    an attacker gets with no weights at all, by counting tokens. A stitched model between this and
    random init has learnt nothing an attacker could not count."""
    counts = torch.bincount(torch.as_tensor(train_tokens, dtype=torch.long), minlength=vocab_size)
    logp = torch.log((counts.double() + 1) / (counts.sum() + vocab_size))
    return float(torch.cat([-logp[y.reshape(-1)] for _, y in val]).mean())


def verdict(result: dict) -> dict:
    """The headline fields, for the alternating assembly and the best mix: how much of the gap
    between random init and the real model the attacker closed (0: none, 1: all), whether it beat
    random init by the issue's margin, and whether it beat counting tokens (no weights at all)."""
    real, rand, counts = (result[k] for k in ("real_val_loss", "random_init_val_loss", "unigram_val_loss"))
    out = {}
    for prefix, got in (("", result["stitched_val_loss"]), ("best_mix_", result["best_mix_val_loss"])):
        out |= {f"{prefix}recovered_fraction": (rand - got) / (rand - real) if rand != real else float("nan"),
                f"{prefix}recovered": got < rand - RECOVERED_MARGIN,
                f"{prefix}beats_token_counts": got < counts}
    return out


def choose_pair(run_dir: Path, pair: str | None) -> tuple[Path, Path]:
    """The two snapshot files to attack: ``EPOCH@STEP,EPOCH@STEP``, or by default the two newest
    (the last morph's before and after: one training state in two bases)."""
    found = list_snapshots(Path(run_dir) / SNAPSHOT_DIR)
    names = {f"{e}@{s}": p for e, s, p in found}
    if len(found) < 2:
        raise ConfigError("attack", str(run_dir), f"needs two stage snapshots in {SNAPSHOT_DIR}/, found "
                          f"{len(found)}: train with protocol.morph = orthogonal or lowcond and "
                          "protocol.keep_snapshots >= 1 (the default)")
    if pair is None:
        return found[-2][2], found[-1][2]
    chosen = [p.strip() for p in pair.split(",")]
    if len(chosen) != 2 or chosen[0] == chosen[1] or not all(c in names for c in chosen):
        raise ConfigError("--snapshots", pair, f"two different of {', '.join(names)} (EPOCH@STEP)")
    a, b = sorted(chosen, key=lambda c: tuple(map(int, c.split("@"))))
    return names[a], names[b]


def attack_run(run_dir: Path, attack: str, pair: str | None = None, alternating_only: bool = False,
               out_dir: Path | None = None) -> dict:
    """Attack a run folder; writes ``RUN/attack/ATTACK.json`` and returns what it holds."""
    from meshlearn.data.corpus import load_corpus

    run_dir = Path(run_dir)
    if attack not in ATTACKS:
        raise ConfigError("attack", attack, f"allowed: {', '.join(ATTACKS)}")
    cfg = load_config(run_dir / "config.toml")
    paths = choose_pair(run_dir, pair)
    snaps = (load_snapshot(paths[0]), load_snapshot(paths[1]))
    corpus = load_corpus(cfg, run_dir)
    val = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size,
                             cfg.model.seq_len)
    result = {"run": cfg.name or run_dir.name, "run_dir": str(run_dir), "morph": cfg.protocol.morph,
              **attack_snapshots(attack, snaps, val, alternating_only),
              "random_init_val_loss": random_init_loss(snaps[0], cfg.seed, val),
              "unigram_val_loss": unigram_loss(corpus.splits.train, snaps[0].model.vocab_size, val),
              "validation": {"batches": len(val), "batch_size": cfg.train.batch_size,
                             "seq_len": cfg.model.seq_len}}
    result |= verdict(result)
    out = Path(out_dir) if out_dir else run_dir / OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{attack}.json", result)
    return result
