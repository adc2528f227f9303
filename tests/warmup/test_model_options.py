"""The usual remedies beside architecture warm-up: QK-norm and soft-capping (model options)."""

import dataclasses

import torch

from meshlearn.models import DecoderConfig, init_model

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
