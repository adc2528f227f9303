"""Compression of what crosses the mesh: pipeline-boundary codecs with exact wire-byte accounting."""

from meshlearn.compress.baselines import Int4RowCodec, RandomProjectionCodec, TopKCodec
from meshlearn.compress.codecs import CastCodec, Codec, Encoded, IdentityCodec, Int8RowCodec
from meshlearn.compress.registry import CODECS, WIRE_DTYPES, CodecConfig, build_codec
from meshlearn.compress.subspace import SubspaceCodec

__all__ = [
    "CODECS",
    "WIRE_DTYPES",
    "CastCodec",
    "Codec",
    "CodecConfig",
    "Encoded",
    "IdentityCodec",
    "Int4RowCodec",
    "Int8RowCodec",
    "RandomProjectionCodec",
    "SubspaceCodec",
    "TopKCodec",
    "build_codec",
]
