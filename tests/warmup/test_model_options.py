"""The usual remedies beside architecture warm-up: QK-norm and soft-capping (model options)."""

import dataclasses

import pytest
import torch
from tiny import reference_run, tiny_config

from meshlearn.errors import ConfigError
from meshlearn.mesh.topology import WorkerId
from meshlearn.models import DecoderConfig, init_model
from meshlearn.train import Trainer

CFG = DecoderConfig(vocab_size=32, n_layer=2, d_model=32, n_head=2, seq_len=16)


def tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=torch.Generator().manual_seed(0))


def test_logit_softcap_bounds_the_logits():
    base = init_model(CFG, 0)
    with torch.no_grad():
        base.head.weight.mul_(500.0)
    capped = init_model(dataclasses.replace(CFG, logit_softcap=5.0), 0)
    capped.load_state_dict(base.state_dict())
    raw, out = base(tokens()), capped(tokens())
    assert raw.abs().max() > 5.0 >= out.abs().max()
    assert torch.allclose(out, 5.0 * torch.tanh(raw / 5.0), atol=1e-6)


def test_attention_softcap_is_the_plain_attention_when_the_cap_is_far_away():
    base = init_model(CFG, 0)
    far = init_model(dataclasses.replace(CFG, attn_softcap=1e6), 0)
    near = init_model(dataclasses.replace(CFG, attn_softcap=0.01), 0)
    far.load_state_dict(base.state_dict())
    near.load_state_dict(base.state_dict())
    x = tokens()
    assert torch.allclose(far(x), base(x), atol=1e-5)
    assert not torch.allclose(near(x), base(x), atol=1e-5)


def test_qk_norm_normalises_queries_and_keys():
    model = init_model(dataclasses.replace(CFG, qk_norm=True), 0)
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.attn.q_norm.weight" in names and "layers.1.attn.k_norm.weight" in names
    seen = {}
    model.layers["0"].attn.q_norm.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    out = model(tokens())
    rms = seen["q"].pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-2)  # 1 up to RMSNorm's eps
    plain = init_model(CFG, 0)  # same init stream: QK-norm draws no random numbers
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if "q_norm" not in k and "k_norm" not in k})
    assert not torch.allclose(plain(tokens()), out)  # the option is live


REMEDIES = ["model.qk_norm=true", "model.attn_softcap=2.0", "model.logit_softcap=3.0"]


def test_the_options_reach_every_stage_from_config_and_match_the_unsplit_model(tiny_corpus, tmp_path):
    """``--set model.*`` builds the stages with the options (small caps, so they bind), and a
    2-stage mesh still reproduces the unsplit model built from the same config."""
    cfg = tiny_config(tiny_corpus, "mesh.stages=2", *REMEDIES)
    trainer = Trainer(cfg, tmp_path, progress=False)
    first, last = (trainer.workers[WorkerId(0, s)].module for s in (0, 1))
    assert all(b.attn.softcap == 2.0 and hasattr(b.attn, "q_norm")
               for m in (first, last) for b in m.layers.values())
    assert last.cfg.logit_softcap == 3.0
    mesh_losses = [trainer.step() for _ in range(3)]
    ref_losses, _ = reference_run(trainer, 3)
    assert max(abs(a - b) for a, b in zip(mesh_losses, ref_losses, strict=True)) <= 1e-5
    plain = Trainer(tiny_config(tiny_corpus, "mesh.stages=2"), tmp_path / "plain", progress=False)
    assert abs(plain.step() - mesh_losses[0]) > 1e-3  # the options change the function


@pytest.mark.parametrize("key", ["attn_softcap", "logit_softcap"])
def test_a_negative_softcap_is_refused(tiny_corpus, key):
    with pytest.raises(ConfigError, match=f"model.{key}"):
        tiny_config(tiny_corpus, f"model.{key}=-1")
