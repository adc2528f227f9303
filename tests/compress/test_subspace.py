"""Subspace networks: exact boundaries on a constrained model, exact gradients, measured bytes."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_run, tiny_config

from meshlearn.compress import CodecConfig, build_codec
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import Decoder, DecoderConfig, init_model, merge_stages, split_model
from meshlearn.models.subspace import fixed_token_table, subspace_basis, tensor_hash
from meshlearn.optim import build_optimizer
from meshlearn.optim.factory import OptimConfig
from meshlearn.train import Trainer

CFG = DecoderConfig(vocab_size=64, n_layer=4, d_model=64, n_head=4, seq_len=16, subspace_rank=8)
IDS = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))


def codec_for(cfg: DecoderConfig, wire: str = "fp32"):
    return build_codec(CodecConfig("subspace", wire_dtype=wire), cfg)


def boundary_outputs(cfg: DecoderConfig) -> list[torch.Tensor]:
    """What each of the first three stages of a 4-stage split sends forward."""
    stages = split_model(init_model(cfg, 0), 4)
    outputs, h = [], IDS
    for stage in stages[:-1]:
        h = stage(h)
        outputs.append(h.detach())
    return outputs


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_basis_is_orthonormal_and_shared_artifacts_are_bit_identical():
    u = subspace_basis(64, 8, 1337)
    assert (u.t() @ u - torch.eye(8)).abs().max() < 1e-6
    assert tensor_hash(u) == tensor_hash(subspace_basis(64, 8, 1337))
    assert tensor_hash(fixed_token_table(64, 64, 0.02, 1)) == tensor_hash(fixed_token_table(64, 64, 0.02, 1))
    assert tensor_hash(u) != tensor_hash(subspace_basis(64, 8, 1338))


def test_round_trip_is_exact_at_every_boundary_of_a_constrained_model():
    codec = codec_for(CFG)
    for x in boundary_outputs(CFG):
        assert relative_error(codec.decode(codec.encode(x, "act", IDS), "act"), x) <= 1e-5


def test_round_trip_fails_on_a_dense_model():
    """Negative control: the same codec on an unconstrained model loses most of the signal."""
    dense = DecoderConfig(**{**vars(CFG), "subspace_rank": 0})
    codec = codec_for(CFG)
    errors = [relative_error(codec.decode(codec.encode(x, "act", IDS), "act"), x)
              for x in boundary_outputs(dense)]
    assert min(errors) > 0.1


def test_gradients_through_the_codec_are_exact():
    """The sender's parameter gradients from (∂L/∂X)·Π equal those from ∂L/∂X itself."""
    codec = codec_for(CFG)
    stage = split_model(init_model(CFG, 0), 2)[0]
    grad = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(1))

    def param_grads(upstream: torch.Tensor) -> list[torch.Tensor]:
        stage.zero_grad()
        stage(IDS).backward(upstream)
        return [p.grad.clone() for p in stage.parameters()]

    exact = param_grads(grad)
    projected = codec.decode(codec.encode(grad, "grad"), "grad")
    basis = subspace_basis(64, 8, CFG.subspace_seed)
    assert torch.allclose(codec.encode(grad, "grad").tensors["coeffs"], grad @ basis)
    for a, b in zip(param_grads(projected), exact, strict=True):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("wire,value_bytes", [("fp32", 4), ("bf16", 2)])
def test_wire_bytes_are_k_values_per_token_plus_the_id_forward(wire, value_bytes):
    codec = codec_for(CFG, wire)
    x = boundary_outputs(CFG)[0]
    tokens = IDS.numel()
    assert codec.encode(x, "act", IDS).wire_bytes == tokens * (8 * value_bytes + 2)  # int16 ids
    assert codec.encode(x, "grad").wire_bytes == tokens * 8 * value_bytes


def test_mismatched_artifacts_are_refused():
    sender = codec_for(CFG)
    receiver = codec_for(DecoderConfig(**{**vars(CFG), "subspace_seed": 7}))
    with pytest.raises(ValueError, match="disagree"):
        receiver.decode(sender.encode(boundary_outputs(CFG)[0], "act", IDS), "act")


@pytest.mark.parametrize("stages,replicas", [(2, 2), (4, 1)])
def test_mesh_with_subspace_codec_equals_unsplit_constrained_model(tiny_corpus, tmp_path, stages,
                                                                    replicas):
    cfg = tiny_config(tiny_corpus, f"mesh.stages={stages}", f"mesh.replicas={replicas}",
                      "model.subspace_rank=4", "codec.name=subspace", "codec.wire_dtype=fp32")
    trainer = Trainer(cfg, tmp_path, progress=False)
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, ref_model = reference_run(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    merged = merge_stages(trainer.cfg.model, [trainer.workers[WorkerId(0, s)].module.state_dict()
                                              for s in range(stages)]).state_dict()
    reference = ref_model.state_dict()
    assert max((merged[k] - reference[k]).abs().max().item() for k in reference) <= 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_constraint_survives_training_with_any_optimizer(optimizer):
    """Reparametrization keeps W = U·Z whatever the update: boundaries stay exact after steps."""
    model = init_model(CFG, 0)
    opt = build_optimizer(model, OptimConfig(name=optimizer), lr=1e-2)
    targets = torch.roll(IDS, -1, dims=1)
    for _ in range(5):
        Decoder.loss(model(IDS), targets).backward()
        opt.step()
        opt.zero_grad()
    codec = codec_for(CFG)
    stages = split_model(model, 2)
    x = stages[0](IDS).detach()
    assert relative_error(codec.decode(codec.encode(x, "act", IDS), "act"), x) <= 1e-5
    basis = subspace_basis(64, 8, CFG.subspace_seed)
    projector = torch.eye(64) - basis @ basis.t()
    for name, module in model.named_modules():
        if name.endswith((".o", ".down")):
            w = module.weight  # (d, in): columns of U·Z lie in span(U)
            assert (projector @ w).norm() / w.norm() < 1e-6, name
