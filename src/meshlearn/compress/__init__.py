"""Compression of what crosses the mesh: pipeline-boundary codecs with exact wire-byte accounting."""

from meshlearn.compress.codecs import CastCodec, Codec, Encoded, IdentityCodec, Int8RowCodec
from meshlearn.compress.registry import CODECS, CodecConfig, build_codec

__all__ = [
    "CODECS",
    "CastCodec",
    "Codec",
    "CodecConfig",
    "Encoded",
    "IdentityCodec",
    "Int8RowCodec",
    "build_codec",
]
