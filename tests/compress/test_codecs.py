"""Boundary codecs: exact wire bytes, exact identity, bounded error for the lossy ones."""

import pytest
import torch

from meshlearn.compress import CodecConfig, build_codec
from meshlearn.models import DecoderConfig

SHAPE = (4, 16, 64)  # (B, T, d)


def build_codec_for(cfg: CodecConfig):
    return build_codec(cfg, DecoderConfig(vocab_size=256, d_model=SHAPE[-1]))


@pytest.fixture
def x():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def test_identity_is_exact_and_costs_fp32(x):
    codec = build_codec_for(CodecConfig("identity"))
    message = codec.encode(x)
    assert torch.equal(codec.decode(message), x)
    assert message.wire_bytes == x.numel() * 4


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_casts_cost_two_bytes_per_value(x, name):
    codec = build_codec_for(CodecConfig(name))
    message = codec.encode(x)
    assert message.wire_bytes == x.numel() * 2
    out = codec.decode(message)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out - x).abs().max() <= 2**-7 * x.abs().max()


def test_int8_costs_one_byte_per_value_plus_a_scale_per_row(x):
    codec = build_codec_for(CodecConfig("int8"))
    message = codec.encode(x)
    rows = x.numel() // x.shape[-1]
    assert message.wire_bytes == x.numel() + 4 * rows
    err = (codec.decode(message) - x).abs()
    half_step = x.abs().amax(-1, keepdim=True) / 254
    assert (err <= half_step * (1 + 1e-5)).all()


def test_int8_survives_an_all_zero_row():
    codec = build_codec_for(CodecConfig("int8"))
    x = torch.zeros(2, 3, 8)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_unknown_codec_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"codec.name = 'zip'.*bf16.*identity"):
        build_codec_for(CodecConfig("zip"))


def test_topk_keeps_the_largest_values_with_int16_positions(x):
    codec = build_codec_for(CodecConfig("topk", topk=5, wire_dtype="fp32"))
    message = codec.encode(x)
    rows = x.numel() // x.shape[-1]
    assert message.wire_bytes == rows * 5 * (4 + 2)
    out = codec.decode(message).reshape(rows, -1)
    flat = x.reshape(rows, -1)
    kept = out != 0
    assert (kept.sum(1) == 5).all() and torch.equal(out[kept], flat[kept])
    assert (flat.abs()[~kept].reshape(rows, -1).amax(1) <= out.abs().amax(1)).all()


def test_int4_packs_two_values_per_byte_within_half_a_step(x):
    codec = build_codec_for(CodecConfig("int4"))
    message = codec.encode(x)
    rows = x.numel() // x.shape[-1]
    assert message.wire_bytes == rows * (x.shape[-1] // 2 + 4)
    err = (codec.decode(message) - x).abs()
    assert (err <= x.abs().amax(-1, keepdim=True) / 14 * (1 + 1e-5)).all()


def test_lowrank_projection_is_exact_only_inside_its_span(x):
    codec = build_codec_for(CodecConfig("lowrank", lowrank=8, wire_dtype="fp32"))
    inside = (x @ codec.projection) @ codec.projection.t()
    assert torch.allclose(codec.decode(codec.encode(inside)), inside, atol=1e-5)
    assert (codec.decode(codec.encode(x)) - x).norm() > 0.5 * x.norm()
    assert codec.encode(x).wire_bytes == x.numel() // x.shape[-1] * 8 * 4
