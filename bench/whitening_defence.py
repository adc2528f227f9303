"""The whitening-morph defence against the passive covariance attack, on a trained protocol model
served with static weights (the note's hard case: all the traffic an attacker wants, no drift).

From a morphing run's newest snapshot (the demo run ``DIR/demo`` of ``bench/unextractable.py
--runs DIR``), two morph epochs a and b, each morph either orthogonal (the protocol's default) or
whitening at every pipeline boundary (T = C^{−1/2}·Q, C the sender's covariance of its own
outgoing traffic on calibration windows it served, ``protocol/transforms.whitening``; internal
boundaries stay orthogonal). An attacker holding the stages of both epochs, alternating a b a b,
bridges every boundary by covariance alignment from passive traffic of each epoch (different
windows), or, as a control, by the direct bridge from identical inputs. Scored on the run's
validation batches.

    flock /tmp/meshlearn-bench.lock python bench/whitening_defence.py --run DIR/demo   # → docs/results/
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path

import torch
from common import markdown_table, write_results

from meshlearn.attack_run import attack_snapshots, random_init_loss, unigram_loss
from meshlearn.config import load_config
from meshlearn.data import validation_batches
from meshlearn.data.corpus import load_corpus
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.protocol.morph import StageMorph, morph_mesh
from meshlearn.protocol.snapshots import (
    SNAPSHOT_DIR,
    boundary_traffic,
    list_snapshots,
    load_snapshot,
    take_snapshot,
    traffic_windows,
)
from meshlearn.protocol.transforms import seeded_generator, whitening


def morph(stages, morphs, mesh, scheme: str, epoch: int, calibration, shrinkage: float) -> float:
    """One morph epoch; whitening boundaries from the senders' covariance on ``calibration``.
    Returns the largest κ(T) of the boundary transforms (1 for orthogonal)."""
    boundaries, kappa = None, 1.0
    if scheme == "whitening":
        traffic = boundary_traffic(stages, calibration)
        boundaries = {s: whitening(torch.cov(x.double().T), seeded_generator("whiten", s, epoch), shrinkage)
                      for s, x in enumerate(traffic)}
        kappa = max(t.condition() for t in boundaries.values())
    morph_mesh(morphs, mesh, "orthogonal", 0.0, seed=7, epoch=epoch, boundaries=boundaries)
    return kappa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a morphing run folder with snapshots (DIR/demo)")
    parser.add_argument("--passive", default="2048,8192,32768", help="attacker's passive tokens per epoch")
    parser.add_argument("--calibration", type=int, default=8192, help="defender's tokens per whitening")
    parser.add_argument("--shrinkage", type=float, default=0.1)
    parser.add_argument("--name", default="whitening_defence")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = Path(args.run)
    cfg = load_config(run / "config.toml")
    corpus = load_corpus(cfg, run)
    train, seq_len = corpus.splits.train, cfg.model.seq_len
    val = validation_batches(corpus.splits.val, cfg.train.eval_batches, cfg.train.batch_size, seq_len)
    base = load_snapshot(list_snapshots(run / SNAPSHOT_DIR)[-1][2])
    sizes = [int(n) for n in args.passive.split(",")]
    probe = traffic_windows(train, 2048, seq_len, cfg.seed, "probe")
    rows = []
    for scheme in ("orthogonal", "whitening"):
        started = time.perf_counter()
        stages = [copy.deepcopy(m) for m in base.modules()]
        mesh = MeshShape(1, len(stages))
        morphs = {WorkerId(0, s): StageMorph(m, None) for s, m in enumerate(stages)}
        snaps, kappas = [], []
        for epoch, tag in ((0, "a"), (1, "b")):
            calibration = traffic_windows(train, args.calibration, seq_len, cfg.seed, "defender", epoch)
            kappas.append(morph(stages, morphs, mesh, scheme, epoch, calibration, args.shrinkage))
            passive = traffic_windows(train, max(sizes), seq_len, cfg.seed, "attacker", tag)
            snaps.append(take_snapshot(stages, base.epoch + epoch + 1, base.step, passive, probe))
        white = [float((torch.cov(x.double().T) - torch.eye(x.shape[1], dtype=torch.float64)).abs().max())
                 for x in snaps[1].passive]
        bridge = attack_snapshots("bridge", tuple(snaps), val, alternating_only=True)
        for n in sizes:
            cut = tuple(dataclasses.replace(s, passive=[x[:n] for x in s.passive]) for s in snaps)
            cov = attack_snapshots("covariance", cut, val, alternating_only=True)
            rows.append({"scheme": scheme, "passive_tokens": n, "real_val_loss": cov["real_val_loss"],
                         "covariance_stitched": cov["stitched_val_loss"],
                         "bridge_stitched": bridge["stitched_val_loss"],
                         "variance_aligned": min(b["variance_aligned"] for b in cov["bridges"]),
                         "kappa_max": max(kappas), "cov_minus_identity_max": max(white),
                         "seconds": time.perf_counter() - started})
            print(rows[-1], flush=True)
    random_init = random_init_loss(base, cfg.seed, val)
    unigram = unigram_loss(train, base.model.vocab_size, val)
    columns = [("scheme", "boundary morphs", ""), ("passive_tokens", "passive tokens", "d"),
               ("real_val_loss", "real model", ".4f"), ("covariance_stitched", "covariance attack", ".3f"),
               ("bridge_stitched", "direct bridge (control)", ".3f"),
               ("variance_aligned", "variance aligned (worst boundary)", ".2f"),
               ("kappa_max", "max κ(T)", ".1f")]
    markdown = (f"# Whitening morphs against the covariance attack ({cfg.name or run.name}, snapshot "
                f"{base.name}, static weights)\n\n`python bench/whitening_defence.py --run {args.run}` "
                f"(defender calibration {args.calibration} tokens per whitening, shrinkage "
                f"{args.shrinkage}). Nats/token on {len(val)} validation batches; random init "
                f"{random_init:.4f}, token counts {unigram:.4f}. Stitched: stages alternating from two "
                f"epochs a b a b, every boundary bridged by the attack.\n\n"
                + markdown_table(rows, columns) + "\n")
    write_results(args.name, {"args": vars(args), "random_init_val_loss": random_init,
                              "unigram_val_loss": unigram, "rows": rows}, markdown)


if __name__ == "__main__":
    main()
