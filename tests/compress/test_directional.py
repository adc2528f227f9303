"""``codec.backward``: one codec per direction, and the unbiased backward-only mask."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_config

from meshlearn.compress import (
    CodecConfig,
    DirectionalCodec,
    MaskCodec,
    MessageContext,
    TopKCodec,
    build_codec,
)
from meshlearn.compress.registry import BackwardCodecConfig
from meshlearn.compress.wire_checks import WireGuard, payload_layout
from meshlearn.errors import ConfigError
from meshlearn.models import DecoderConfig

B, T, D = 2, 8, 64
MODEL = DecoderConfig(vocab_size=8, d_model=D)


def codec_of(forward: str = "topk", **backward) -> DirectionalCodec:
    backward_cfg = BackwardCodecConfig(**backward)
    return build_codec(CodecConfig(forward, topk=5, wire_dtype="fp32", backward=backward_cfg), MODEL)


@pytest.fixture
def x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))


def test_same_is_the_one_codec_for_both_directions():
    assert isinstance(build_codec(CodecConfig("topk"), MODEL), TopKCodec)


def test_activations_and_gradients_go_through_their_own_codecs(x):
    codec = codec_of(name="mask", keep=0.25)
    assert isinstance(codec.forward, TopKCodec) and isinstance(codec.backward, MaskCodec)
    ctx = MessageContext(3, 1, 0, 1)
    act, grad = codec.encode(x, "act", ctx=ctx), codec.encode(x, "grad", ctx=ctx)
    assert set(act.tensors) == {"values", "index"} and act.tensors["values"].shape == (B * T, 5)
    assert set(grad.tensors) == {"values"} and grad.tensors["values"].shape == (B, T, 16)
    assert torch.equal(codec.decode(act, "act", ctx), codec.forward.decode(act, "act", ctx))
    mask = codec.backward.mask((B, T, D), ctx)
    assert torch.allclose(codec.decode(grad, "grad", ctx), x * mask * 4.0)  # rescaled by d/K = 4
    assert codec.backward.scale == 4.0 and codec.name == "topk"  # evaluation follows the forward


@pytest.mark.parametrize("form", ["fixed", "bernoulli"])
def test_the_backward_only_mask_is_unbiased(x, form):
    """Over N = 1000 masks (steps 0..N-1) the mean decoded gradient is the gradient: per element
    the decoded value is g·m/keep, variance g²(1/keep − 1), so the mean's error has standard
    deviation σ = |g|·√((1/keep − 1)/N) (0.055·|g| at keep 0.25); every element is within 5σ and
    the whole tensor's relative error within 1.2 × √((1/keep − 1)/N). Without the rescale the mean
    is keep·g and fails both."""
    n, keep = 1000, 0.25
    for rescale, unbiased in ((True, True), (False, False)):
        codec = codec_of(name="mask", keep=keep, mask=form, rescale=rescale)
        total = torch.zeros_like(x)
        for step in range(n):
            ctx = MessageContext(step, 0, 1, 0)
            total += codec.decode(codec.encode(x, "grad", ctx=ctx), "grad", ctx)
        mean = total / n
        rel = math.sqrt((1 / keep - 1) / n)
        z = ((mean - x).abs() / (x.abs() * rel)).max().item()
        norm = ((mean - x).norm() / x.norm()).item()
        assert (z <= 5 and norm <= 1.2 * rel) == unbiased, (rescale, z, norm, rel)


def test_the_wire_guard_checks_each_direction_against_its_own_codec(x):
    codec = codec_of(name="mask", keep=0.25, mask="bernoulli")
    ctx = MessageContext(2, 0, 0, 0)
    assert codec.per_message_layout  # the Bernoulli gradients' size is the message's own
    act = payload_layout(codec, "act", (B, T, D), ctx=ctx)
    grad = payload_layout(codec, "grad", (B, T, D), ctx=ctx)
    assert set(act.fields) == {"values", "index"} and set(grad.fields) == {"values"}
    guard = WireGuard(codec, T, D, 8)
    assert guard.layout("grad", (B, T, D), ctx).wire_bytes == codec.encode(x, "grad", ctx=ctx).wire_bytes


@pytest.mark.parametrize(("overrides", "hint"), [
    (("codec.backward.name=zip",), "codec.backward.name = 'zip': allowed: ['same', 'bf16'"),
    (("codec.backward.name=subspace",), "codec.backward.name = 'subspace': allowed: ['same'"),
    (("codec.name=subspace", "model.subspace_rank=4", "codec.backward.name=mask"),
     "codec.backward.name = 'mask': 'same' under codec.name = 'subspace'"),
    (("codec.backward.keep=0",), "codec.backward.keep = 0.0: a fraction of the channels in (0, 1]"),
    (("codec.backward.keep=1.5",), "codec.backward.keep = 1.5: a fraction of the channels in (0, 1]"),
    (("codec.backward.name=mask", "codec.backward.keep=0.01"),
     "codec.backward.keep = 0.01: keeps round(0.01 * model.d_model = 32) = 0 channels"),
    (("codec.backward.mask=topk",), "codec.backward.mask = 'topk': allowed: ['fixed', 'bernoulli']"),
    (("codec.backward.rescale=maybe",), "codec.backward.rescale = 'maybe': expected a boolean"),
])
def test_bad_backward_settings_are_refused_with_one_line(tiny_corpus, overrides, hint):
    with pytest.raises(ConfigError) as err:
        tiny_config(tiny_corpus, *overrides)
    assert str(err.value).startswith(hint) and "\n" not in str(err.value)
