"""The attacks on a protocol model: the fitting functions on synthetic data, what a morphing run
folder keeps (snapshots of two epochs, boundary traffic), and ``meshlearn attack`` on a tiny run."""

import json

import pytest
import torch
from tiny import tiny_config

from meshlearn.entry.cli import main
from meshlearn.protocol.attacks import (
    covariance_alignment,
    least_squares,
    mixed_assignments,
    procrustes,
    relative_error,
)
from meshlearn.protocol.snapshots import SNAPSHOT_DIR, list_snapshots, load_snapshot
from meshlearn.protocol.transforms import haar_orthogonal, low_condition, seeded_generator
from meshlearn.statefile import load_state
from meshlearn.train import Trainer

# 4 stages of one layer each, a morph every 4 steps, trained long enough to be far from random init.
RUN = ["optim.name=muon", "mesh.stages=4", "train.steps=24", "train.lr=1e-2", "protocol.morph=orthogonal",
       "protocol.every_steps=4", "protocol.keep_snapshots=2", "protocol.traffic_tokens=256",
       "train.eval_every=4", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def morph_run(tiny_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("attack") / "run"
    Trainer(tiny_config(tiny_corpus, *RUN), run_dir, progress=False).train()
    return run_dir


def attack_json(capsys, *argv) -> dict:
    assert main(["attack", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def skewed(n: int, d: int, generator) -> torch.Tensor:
    """Non-Gaussian samples with distinct variances and a mean, like residual activations."""
    scales = torch.linspace(3.0, 0.3, d, dtype=torch.float64)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    return (x + 0.4 * x.pow(2)) * scales + 0.1


def test_bridges_recover_a_transform_from_identical_inputs():
    g = seeded_generator(0, "bridge")
    x = skewed(400, 16, g)
    t = haar_orthogonal(16, g).matrix
    assert (procrustes(x, x @ t) - t).abs().max() < 1e-10
    lc = low_condition(16, 0.5, g).matrix
    assert (least_squares(x, x @ lc) - lc).abs().max() < 1e-10
    assert relative_error(x, x @ lc, procrustes(x, x @ lc)) > 1e-3  # Procrustes cannot fit it


def test_covariance_alignment_recovers_an_orthogonal_map_from_different_samples():
    """Two independent samples of the same distribution, one seen through T: the eigenbases and
    the moment signs give T back (approximately: from 20k samples in d = 8)."""
    g = seeded_generator(1, "covariance")
    d = 8
    t = haar_orthogonal(d, g).matrix
    estimate = covariance_alignment(skewed(20000, d, g), skewed(20000, d, g) @ t)
    assert (estimate - t).abs().max() < 0.1
    assert (estimate.T @ estimate - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-10
    # Without the sign fix half the directions would be wrong: the estimate is not -T in places.
    assert torch.diagonal(estimate.T @ t).min() > 0.9


def test_mixed_assignments_leave_out_the_real_models():
    mixes = mixed_assignments(3)
    assert len(mixes) == 6 and (0, 0, 0) not in mixes and (1, 1, 1) not in mixes
    assert mixed_assignments(4, alternating_only=True) == [(0, 1, 0, 1)]


def test_a_morphing_run_keeps_two_epochs_of_snapshots_and_traffic(morph_run):
    found = list_snapshots(morph_run / SNAPSHOT_DIR)
    # The last 2 morphs (after steps 20 and 24), each before and after: epochs 4, 5 | 5, 6.
    assert [(e, s) for e, s, _ in found] == [(4, 20), (5, 20), (5, 24), (6, 24)]
    before, after = load_snapshot(found[-2][2]), load_snapshot(found[-1][2])
    assert len(before.stages) == 4 and len(before.passive) == len(before.probe) == 3
    assert before.probe[0].shape == (256, 32)
    # The same weights in two bases: probe traffic (identical inputs) differs by an orthogonal map
    # only; the passive samples are on different windows.
    for b in range(3):
        assert relative_error(before.probe[b], after.probe[b], torch.eye(32, dtype=torch.float64)) > 0.5
        fit = procrustes(before.probe[b], after.probe[b])
        assert relative_error(before.probe[b], after.probe[b], fit) < 1e-5
        assert not torch.equal(before.passive[b], load_snapshot(found[0][2]).passive[b])
    # The final snapshot holds the checkpoint's weights.
    ckpt = load_state(morph_run / "checkpoint.pt")
    final = ckpt["workers"]["r0s3"]["module"]
    assert all(torch.equal(final[k], after.stages[3][k]) for k in final)


def test_attack_stitch_command_reports_no_better_than_random_init(morph_run, capsys):
    result = attack_json(capsys, "stitch", str(morph_run))
    print({k: result[k] for k in ("stitched_val_loss", "real_val_loss", "random_init_val_loss",
                                   "unigram_val_loss")})
    assert result["snapshots"] == ["5@24", "6@24"] and len(result["assignments"]) == 14
    assert result["real_val_loss"] < result["random_init_val_loss"] - 1.0
    alternating = next(r for r in result["assignments"] if r["stages_from"] == ["5@24", "6@24"] * 2)
    assert result["stitched_val_loss"] == alternating["val_loss"]
    assert result["stitched_val_loss"] >= result["random_init_val_loss"] - 0.05
    assert not result["recovered"] and not result["beats_token_counts"]
    assert result["best_mix_val_loss"] == min(r["val_loss"] for r in result["assignments"])
    assert (morph_run / "attack" / "stitch.json").is_file()


def test_attack_bridge_with_identical_inputs_recovers_the_model(morph_run, capsys):
    """The red-team result the paper predicts: with identical inputs at both times, the bridge
    assembles a working model (the defence is detection, docs/unextractable.md)."""
    result = attack_json(capsys, "bridge", str(morph_run), "--alternating")
    assert result["recovered"]
    assert abs(result["stitched_val_loss"] - result["real_val_loss"]) < 1e-3
    assert all(b["method"] == "procrustes" and b["probe_rel_error"] < 1e-5 for b in result["bridges"])


def test_attack_covariance_and_older_snapshots(morph_run, capsys):
    result = attack_json(capsys, "covariance", str(morph_run), "--snapshots", "6@24,4@20",
                         "--alternating")
    assert result["snapshots"] == ["4@20", "6@24"]  # ordered oldest first
    assert len(result["bridges"]) == 3
    assert all(0 <= b["aligned_fraction"] <= 1 for b in result["bridges"])
    assert result["real_val_loss_older"] != result["real_val_loss"]


def test_attack_needs_snapshots(tiny_corpus, tmp_path, capsys):
    run_dir = tmp_path / "plain"
    Trainer(tiny_config(tiny_corpus, "optim.name=muon", "mesh.stages=2", "protocol.morph=none"),
            run_dir, progress=False).train()
    assert main(["attack", "stitch", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs two stage snapshots" in err


def test_bad_snapshot_names_are_one_line(morph_run, capsys):
    assert main(["attack", "stitch", str(morph_run), "--snapshots", "1@2,6@24"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--snapshots" in err and "5@24" in err


def test_a_resumed_run_keeps_the_snapshots_an_uninterrupted_one_keeps(tiny_corpus, tmp_path):
    """Snapshots written after the checkpoint a run resumes from are redone, not kept beside the
    new ones (the newest files would otherwise be stale)."""
    run = ["optim.name=muon", "mesh.stages=2", "train.steps=8", "protocol.morph=orthogonal",
           "protocol.every_steps=2", "protocol.traffic_tokens=64", "train.checkpoint_every=4"]
    Trainer(tiny_config(tiny_corpus, *run), tmp_path / "a", progress=False).train()
    Trainer(tiny_config(tiny_corpus, *run, "train.stop_at_step=6"), tmp_path / "b",
            progress=False).train()
    kept = list_snapshots(tmp_path / "b" / SNAPSHOT_DIR)
    assert [(e, s) for e, s, _ in kept] == [(2, 6), (3, 6)]
    # As if the run had gone on to a morph after step 7 and crashed before its next checkpoint.
    stale = tmp_path / "b" / SNAPSHOT_DIR / "epoch-0009-step-000007.pt"
    stale.write_bytes(kept[-1][2].read_bytes())
    Trainer(tiny_config(tiny_corpus, *run), tmp_path / "b", resume=True, progress=False).train()
    assert not stale.exists()
    a, b = (list_snapshots(tmp_path / x / SNAPSHOT_DIR) for x in "ab")
    assert [(e, s) for e, s, _ in a] == [(e, s) for e, s, _ in b] == [(3, 8), (4, 8)]
    for (_, _, pa), (_, _, pb) in zip(a, b, strict=True):
        sa, sb = load_snapshot(pa), load_snapshot(pb)
        assert all(torch.equal(sa.stages[1][k], sb.stages[1][k]) for k in sa.stages[1])
