"""Boundary codecs: exact wire bytes, exact identity, bounded error for the lossy ones."""

import pytest
import torch

from meshlearn.compress import CodecConfig, build_codec

SHAPE = (4, 16, 64)  # (B, T, d)


@pytest.fixture
def x():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def test_identity_is_exact_and_costs_fp32(x):
    codec = build_codec(CodecConfig("identity"))
    message = codec.encode(x)
    assert torch.equal(codec.decode(message), x)
    assert message.wire_bytes == x.numel() * 4


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_casts_cost_two_bytes_per_value(x, name):
    codec = build_codec(CodecConfig(name))
    message = codec.encode(x)
    assert message.wire_bytes == x.numel() * 2
    out = codec.decode(message)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out - x).abs().max() <= 2**-7 * x.abs().max()


def test_int8_costs_one_byte_per_value_plus_a_scale_per_row(x):
    codec = build_codec(CodecConfig("int8"))
    message = codec.encode(x)
    rows = x.numel() // x.shape[-1]
    assert message.wire_bytes == x.numel() + 4 * rows
    err = (codec.decode(message) - x).abs()
    half_step = x.abs().amax(-1, keepdim=True) / 254
    assert (err <= half_step * (1 + 1e-5)).all()


def test_int8_survives_an_all_zero_row():
    codec = build_codec(CodecConfig("int8"))
    x = torch.zeros(2, 3, 8)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_unknown_codec_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"codec.name = 'zip'.*bf16.*identity"):
        build_codec(CodecConfig("zip"))
