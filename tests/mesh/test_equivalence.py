"""The unsplit model is the oracle: a synchronous mesh with the identity codec must reproduce it."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_run, tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.models import merge_stages
from meshlearn.train import Trainer


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_mesh_matches_unsplit_model(tiny_corpus, tmp_path, stages, replicas, schedule):
    cfg = tiny_config(tiny_corpus, f"mesh.stages={stages}", f"mesh.replicas={replicas}",
                      f"mesh.schedule={schedule}")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = reference_run(trainer, 3)

    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    reference = ref_model.state_dict()
    for r in range(replicas):
        states = [trainer.workers[WorkerId(r, s)].module.state_dict() for s in range(stages)]
        merged = merge_stages(trainer.cfg.model, states).state_dict()
        worst = max((merged[k] - reference[k]).abs().max().item() for k in reference)
        assert worst <= 1e-5, f"replica {r}: parameters differ by {worst}"


@pytest.mark.parametrize("optimizer", ["sgd", "muon", "numuon"])
def test_mesh_matches_unsplit_model_for_every_optimizer(tiny_corpus, tmp_path, optimizer):
    """Every registered optimizer acts per parameter, so splitting the model changes nothing."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "mesh.replicas=2", f"optim.name={optimizer}")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = reference_run(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    states = [trainer.workers[WorkerId(0, s)].module.state_dict() for s in range(2)]
    merged = merge_stages(trainer.cfg.model, states).state_dict()
    reference = ref_model.state_dict()
    assert max((merged[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5


def test_lossy_codec_is_detected_by_the_oracle(tiny_corpus, tmp_path):
    """The same comparison notices a bf16 boundary: the equivalence check has teeth."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "codec.name=bf16")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, _ = reference_run(trainer, 3)
    gap = max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True))
    assert 1e-5 < gap < 0.05


def test_an_update_whose_every_microbatch_was_quarantined_leaves_the_weights_alone(tiny_corpus, tmp_path):
    """Zero loss weight on every microbatch (what SENTINEL's quarantine gives) means an exactly zero
    gradient: AdamW would still apply weight decay (and momentum); the worker skips the step."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", "train.steps=1", "optim.weight_decay=0.1")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    before = {n: p.detach().clone() for w in trainer.workers.values() for n, p in w.module.named_parameters()}
    for worker in trainer.workers.values():
        worker.skipped.update(range(cfg.mesh.microbatches))
    trainer.train()
    after = {n: p.detach() for w in trainer.workers.values() for n, p in w.module.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    # Negative control: the same run without quarantine moves every stage's weights.
    honest = Trainer(cfg, tmp_path / "honest", progress=False)
    honest.train()
    moved = {n: p.detach() for w in honest.workers.values() for n, p in w.module.named_parameters()}
    assert not any(torch.equal(before[n], moved[n]) for n in before if n.endswith("weight"))
