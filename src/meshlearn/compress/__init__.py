"""Compression of what crosses the mesh: pipeline-boundary codecs with exact wire-byte accounting."""

from meshlearn.compress.baselines import Int4RowCodec, RandomProjectionCodec, TopKCodec
from meshlearn.compress.codecs import (
    CastCodec,
    Codec,
    Encoded,
    IdentityCodec,
    Int8RowCodec,
    MessageContext,
)
from meshlearn.compress.directional import DirectionalCodec
from meshlearn.compress.mask import MaskCodec
from meshlearn.compress.registry import CODECS, WIRE_DTYPES, CodecConfig, build_codec, validate_codec
from meshlearn.compress.subspace import SubspaceCodec

__all__ = [
    "CODECS",
    "WIRE_DTYPES",
    "CastCodec",
    "Codec",
    "CodecConfig",
    "DirectionalCodec",
    "Encoded",
    "IdentityCodec",
    "Int4RowCodec",
    "Int8RowCodec",
    "MaskCodec",
    "MessageContext",
    "RandomProjectionCodec",
    "SubspaceCodec",
    "TopKCodec",
    "build_codec",
    "validate_codec",
]
