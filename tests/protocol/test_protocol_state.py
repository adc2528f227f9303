"""Basis-dependent state under morphs (``meshlearn.basis``): PowerSGD's error feedback and warm
start, streaming DiLoCo's outer weights, outer momentum and in-flight merges, and the curvature
tracker's warm-start vectors follow each morph, so a morphing run reproduces the run without
morphs. Each comparison has a negative control: the same run with that state left in the old basis
departs, so the test can fail."""

import pytest
import torch
from test_protocol_training import records, train

from meshlearn.basis import BasisTensor
from meshlearn.curvature.plugin import CurvatureCallback
from meshlearn.dp.diloco import StreamingDiLoCo
from meshlearn.dp.powersgd import PowerSGD
from meshlearn.mesh.topology import MeshShape, WorkerId
from meshlearn.models.llama import Decoder, DecoderConfig
from meshlearn.protocol import protocol_model
from meshlearn.protocol.morph import StageMorph, morph_mesh

D2 = ["mesh.replicas=2", "mesh.schedule=1f1b"]
POWERSGD = [*D2, "dp.name=powersgd", "dp.rank=2"]
# H = 4 with two fragments at offsets 0 and 2, merges one update after a sync: the sync after
# step 2 (u = 1) merges after the morph at that drain point, so a round is in flight across it.
DILOCO = [*D2, "dp.name=diloco", "dp.inner_steps=4", "dp.fragments=2", "dp.overlap=1",
          "dp.outer_momentum=0.9", "dp.merge_weight=0.5"]
CURVATURE = ["curvature.every=2", "curvature.iters=2", "curvature.batch_size=2", "curvature.per_stage=false",
             "curvature.preconditioned=false"]


def gap(a_dir, b_dir, kind="train", key="train_loss") -> float:
    a, b = records(a_dir, kind), records(b_dir, kind)
    assert len(a) == len(b) > 0
    return max(abs(ra[key] - rb[key]) for ra, rb in zip(a, b, strict=True))


def forget(monkeypatch, cls) -> None:
    """The negative control: ``cls`` no longer lists its basis state, so morphs leave it be."""
    monkeypatch.setattr(cls, "basis_state", lambda self, *args: {})


@pytest.mark.parametrize("strategy,holder", [(POWERSGD, PowerSGD), (DILOCO, StreamingDiLoCo)],
                         ids=["powersgd", "diloco"])
def test_dp_state_follows_morphs(tiny_corpus, tmp_path, monkeypatch, strategy, holder):
    train(tiny_corpus, tmp_path / "none", *strategy, "protocol.morph=none")
    train(tiny_corpus, tmp_path / "orth", *strategy, "protocol.morph=orthogonal")
    assert gap(tmp_path / "none", tmp_path / "orth") <= 1e-4
    assert gap(tmp_path / "none", tmp_path / "orth", "eval", "val_loss") <= 1e-4
    forget(monkeypatch, holder)
    train(tiny_corpus, tmp_path / "stale", *strategy, "protocol.morph=orthogonal")
    # measured: 3.6e-7 / 2.4e-7 with the transform, 1.2e-3 / 5.9e-2 without (PowerSGD / DiLoCo)
    assert gap(tmp_path / "none", tmp_path / "stale") > 3e-4


def test_state_moves_by_its_kind_under_low_condition_morphs():
    """Under a non-orthogonal T the two kinds differ: weight-like state moves as the writer
    (Tᵀ·X here), gradient-like state as its gradient (T⁻¹·X); both folded in fp64."""
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, n_layer=2, d_model=16, n_head=2, seq_len=8)
    module = protocol_model(Decoder(cfg), seed=1)
    name = "layers.1.mlp.down.weight"
    writer = dict(module.named_parameters())[name]
    start = writer.detach().double().clone()
    state = {"w": writer.detach().clone(), "g": writer.detach().clone()}
    morph = StageMorph(module, None, holders={"test": lambda: {
        "w": BasisTensor(name, "weight", state["w"]), "g": BasisTensor(name, "gradient", state["g"])}})
    morph_mesh({WorkerId(0, 0): morph}, MeshShape(1, 1), "lowcond", 0.5, seed=2, epoch=0)
    master = morph.master.tensors
    t_transpose = master[name] @ torch.linalg.pinv(start)  # Tᵀ, recovered from the writer's fold
    assert torch.allclose(master[f"{name}#test:w"], master[name], atol=1e-12)
    assert torch.allclose(master[f"{name}#test:g"], torch.linalg.inv(t_transpose).T @ start, atol=1e-9)
    assert not torch.allclose(master[f"{name}#test:g"], master[name], atol=1e-3)  # T is not orthogonal
    assert torch.equal(state["w"], writer.detach())  # cast back into the live tensors


def test_curvature_vectors_follow_morphs(tiny_corpus, tmp_path, monkeypatch):
    """Two power iterations per estimate: far from converged, so each estimate depends on its
    warm start, which must be the previous vector carried into the new basis. The random share
    the tracker mixes into each warm start is drawn in each run's own basis, so it is switched off
    here: what is tested is the carried vector."""
    monkeypatch.setattr("meshlearn.curvature.tracker.WARM_MIX", 0.0)
    train(tiny_corpus, tmp_path / "none", *CURVATURE, "protocol.morph=none")
    train(tiny_corpus, tmp_path / "orth", *CURVATURE, "protocol.morph=orthogonal")
    a = [r["lambda_max"] for r in records(tmp_path / "none", "curvature")]
    b = [r["lambda_max"] for r in records(tmp_path / "orth", "curvature")]
    assert len(a) == len(b) == 4
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) <= 1e-3
    forget(monkeypatch, CurvatureCallback)
    train(tiny_corpus, tmp_path / "stale", *CURVATURE, "protocol.morph=orthogonal")
    c = [r["lambda_max"] for r in records(tmp_path / "stale", "curvature")]
    assert c[0] == pytest.approx(a[0], rel=1e-3)  # before the first morph
    # measured: λ 2.96, 25.07, 40.26 after the morphs; 0.83, 3.35, 10.65 from stale vectors
    assert max(abs(x - y) / abs(x) for x, y in zip(a[1:], c[1:], strict=True)) > 1e-2
