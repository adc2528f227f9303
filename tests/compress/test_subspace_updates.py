"""Optional Grassmann updates of U: orthonormal, ascending, and boundaries stay exact after them."""

from __future__ import annotations

import json

import torch
from tiny import tiny_config

from meshlearn.mesh.topology import WorkerId
from meshlearn.models.grassmann import grassmann_step
from meshlearn.models.subspace import subspace_basis
from meshlearn.train import Trainer

UPDATES = ["model.subspace_rank=4", "codec.name=subspace", "codec.wire_dtype=fp32",
           "subspace_update.every=2", "subspace_update.lr=0.5", "mesh.stages=2", "mesh.replicas=2"]


def test_step_keeps_the_basis_orthonormal_and_ascends_the_objective():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(500, 32, generator=gen) * torch.linspace(3, 0.1, 32)
    s = g.t() @ g
    best = torch.linalg.eigvalsh(s)[-4:].sum().item()  # tr(UᵀSU) at the top-4 eigenvectors
    basis = subspace_basis(32, 4, 0)
    objective = [torch.trace(basis.t() @ s @ basis).item()]
    for _ in range(50):
        basis = grassmann_step(basis, s, lr=2.0)
        assert (basis.t() @ basis - torch.eye(4)).abs().max() < 1e-5
        objective.append(torch.trace(basis.t() @ s @ basis).item())
    assert all(b >= a - 1e-4 * abs(a) for a, b in zip(objective, objective[1:], strict=False))
    assert objective[0] < 0.5 * best and objective[-1] > 0.99 * best


def test_training_with_updates_keeps_boundaries_exact(tiny_corpus, tmp_path):
    trainer = Trainer(tiny_config(tiny_corpus, *UPDATES, "train.steps=4"), tmp_path, progress=False)
    trainer.train()
    assert trainer.plugins["subspace_update"].updater.updates == 2
    worker = trainer.workers[WorkerId(1, 0)]
    moved = trainer.plugins["subspace_update"].updater.basis
    assert not torch.allclose(moved, subspace_basis(32, 4, trainer.cfg.model.subspace_seed))
    assert torch.equal(worker.codec.basis, moved)
    x, _ = trainer.val_batches[0]
    h = worker.module(x).detach()
    decoded = worker.codec.decode(worker.codec.encode(h, "act", x), "act")
    assert ((decoded - h).norm() / h.norm()).item() <= 1e-5
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "event"] == [2, 4]


def test_resume_after_an_update_continues_exactly(tiny_corpus, tmp_path):
    straight = Trainer(tiny_config(tiny_corpus, *UPDATES, "train.steps=5"), tmp_path / "a",
                       progress=False)
    straight.train()
    Trainer(tiny_config(tiny_corpus, *UPDATES, "train.steps=5", "train.stop_at_step=3"),
            tmp_path / "b", progress=False).train()
    resumed = Trainer(tiny_config(tiny_corpus, *UPDATES, "train.steps=5"), tmp_path / "b",
                      resume=True, progress=False)
    resumed.train()

    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["train_loss"] for r in map(json.loads, lines) if r["kind"] == "train"]

    assert max(abs(a - b) for a, b in zip(losses("a"), losses("b"), strict=True)) <= 1e-6
    basis = [t.plugins["subspace_update"].updater.basis for t in (straight, resumed)]
    assert torch.equal(*basis)
